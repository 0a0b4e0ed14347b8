"""Scheduler side: vLLM's scheduler, admitting and preempting by real pages.

vLLM's ``KVCacheManager`` keeps handing out *logical* token blocks (the worker's
block table and vLLM's bookkeeping still want them), but over a virtual pool
large enough never to be the binding limit. Whether a request may be admitted
or extended is decided by ``PageAccounting``: the pages its heads would hold,
``sum over (layer, head) of ceil(head_len / block_size)``, against the pages of
the real pool.

Compression (decided here, executed by the worker at the start of the step):

- after a sequence's prefill completes (it is then "due"), and every
  ``--kv-compress-interval`` steps if set;
- when a running request cannot grow: running requests not yet scheduled this
  step (the ones vLLM would preempt) are compressed first; only if that frees too
  little does ``allocate_slots`` return ``None`` and vLLM's own preemption run,
  which frees every page of the victim. A preempted request is compressed again
  once its recomputed prefill completes.

Each step at most ``--kv-compress-max-kv-per-iteration`` KVs are sorted; never-
compressed requests go first, then the least recently compressed. The pages a
compression frees are known exactly from head lengths (``budget.blocks_to_evict``)
and credited at once; the per-head lengths arrive with the step's output.
"""

from __future__ import annotations

import copy
import inspect

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvcompress.policies import POLICY_NAMES
from kvcompress.budget import RequestBudget, RequestFieldError, blocks_to_evict, request_budget
from kvcompress.config import KVCompressConfig
from kvcompress.page_accounting import PageAccounting
from kvcompress.vllm_glue.kv_layout import pages_in_pool

logger = init_logger(f"vllm.{__name__}")

_ALLOCATE_SLOTS = inspect.signature(KVCacheManager.allocate_slots)


class PerHeadKVCacheManager:
    """Wraps vLLM's ``KVCacheManager``; capacity is decided in per-head pages.

    Every attribute not defined here is the inner manager's.
    """

    def __init__(
        self,
        inner: KVCacheManager,
        accounting: PageAccounting,
        max_model_len: int,
        watermark_pages: int,
        relieve=None,
    ) -> None:
        self._inner = inner
        self.accounting = accounting
        self.max_model_len = max_model_len
        self.watermark_pages = watermark_pages
        # relieve(request, pages_short) compresses other requests instead of preempting.
        self.relieve = relieve
        self.scheduled_this_step: set[str] = set()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    @property
    def usage(self) -> float:
        return self.accounting.num_used_pages / max(1, self.accounting.num_pages)

    def allocate_slots(self, request, *args, **kwargs):
        bound = _ALLOCATE_SLOTS.bind(self._inner, request, *args, **kwargs)
        bound.apply_defaults()
        arg = bound.arguments
        accounting = self.accounting
        request_id = request.request_id
        target_tokens = min(
            request.num_computed_tokens
            + arg["num_new_computed_tokens"]
            + arg["num_external_computed_tokens"]
            + arg["num_new_tokens"]
            + arg["num_lookahead_tokens"],
            self.max_model_len,
        )
        needed = accounting.pages_to_grow(request_id, target_tokens)
        reserve = arg["reserved_blocks"] * accounting.pages_per_token_block
        if arg["has_scheduled_reqs"] and request.status.name in ("WAITING", "PREEMPTED"):
            reserve += self.watermark_pages
        if arg["full_sequence_must_fit"]:
            full_tokens = min(request.num_tokens, self.max_model_len)
            full_needed = accounting.pages_to_grow(request_id, max(full_tokens, target_tokens))
            if full_needed + reserve > accounting.num_free_pages:
                return None
        if (
            needed + reserve > accounting.num_free_pages
            and self.relieve is not None
            and request.status.name == "RUNNING"
        ):
            self.relieve(request, needed + reserve - accounting.num_free_pages)
            needed = accounting.pages_to_grow(request_id, target_tokens)
        if needed + reserve > accounting.num_free_pages:
            return None
        blocks = self._inner.allocate_slots(request, *args, **kwargs)
        if blocks is None:
            logger.warning(
                "kvcompress: vLLM's logical block pool refused request %s although "
                "%d pages are free", request_id, accounting.num_free_pages,
            )
            return None
        accounting.grow(request_id, target_tokens)
        self.scheduled_this_step.add(request_id)
        return blocks

    def free(self, request) -> None:
        self.accounting.release(request.request_id)
        self._inner.free(request)

    def pop_blocks_for_free(self, request):
        self.accounting.release(request.request_id)
        return self._inner.pop_blocks_for_free(request)


def logical_block_count(
    num_pages: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> int:
    """Size of the virtual logical-block pool: enough for every running request at
    full length (+1 for vLLM's null block), never more than there are pages."""
    per_request = -(-max_model_len // block_size)
    return min(num_pages, max_num_seqs * per_request) + 1


class KVCompressScheduler(Scheduler):
    """vLLM's scheduler with per-(layer, KV head) page accounting and compression."""

    def __init__(self, vllm_config, kv_cache_config: KVCacheConfig, *args, **kwargs) -> None:
        settings = KVCompressConfig.from_additional_config(vllm_config.additional_config)
        num_pages, num_layers, num_kv_heads = pages_in_pool(kv_cache_config)
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        max_model_len = vllm_config.model_config.max_model_len
        logical_config = copy.deepcopy(kv_cache_config)
        logical_config.num_blocks = logical_block_count(
            num_pages, vllm_config.scheduler_config.max_num_seqs, max_model_len, block_size
        )
        super().__init__(vllm_config, logical_config, *args, **kwargs)
        self.kvcompress_config = settings
        self.num_preemptions = 0
        self.page_accounting = PageAccounting(
            num_pages=num_pages,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            max_requests=vllm_config.scheduler_config.max_num_seqs * 2,
        )
        watermark = self.scheduler_config.watermark
        self.kv_cache_manager = PerHeadKVCacheManager(
            self.kv_cache_manager,
            self.page_accounting,
            max_model_len=max_model_len,
            watermark_pages=int(watermark * num_pages),
            relieve=self._kvc_relieve if settings.enabled else None,
        )
        self.kvc_step = 0
        self.kvc_budgets: dict[str, RequestBudget] = {}
        self.kvc_last_compressed: dict[str, int] = {}  # request id -> step
        self.kvc_orders: dict[str, tuple[int, int, int, int]] = {}
        self.kvc_kvs_this_step = 0
        self.kvc_stats = {
            "steps_checked": 0,
            "mismatches": 0,
            "compressions": 0,
            "compressions_after_prefill": 0,
            "compressions_instead_of_preemption": 0,
            "compressions_on_interval": 0,
            "pages_freed": 0,
            "max_running": 0,
            "max_decoding": 0,
            "preempted_after_compression": 0,
            "recompressed_after_preemption": 0,
        }
        self.kvc_recompress_due: set[str] = set()
        logger.info(
            "kvcompress scheduler: %d pages (%d layers x %d KV heads x %d token blocks), "
            "block size %d", num_pages, num_layers, num_kv_heads,
            kv_cache_config.num_blocks, block_size,
        )

    # ------------------------------------------------------------------ budgets

    def _kvc_budget(self, request) -> RequestBudget:
        budget = self.kvc_budgets.get(request.request_id)
        if budget is None:
            params = request.sampling_params
            try:
                budget = request_budget(
                    self.kvcompress_config, getattr(params, "extra_args", None)
                )
            except RequestFieldError as error:
                # The front end rejects these with HTTP 400; a direct engine-core
                # client may not: keep serving with the server's settings.
                logger.warning("kvcompress: request %s: %s; using server settings",
                               request.request_id, error)
                budget = request_budget(self.kvcompress_config, None)
            self.kvc_budgets[request.request_id] = budget
        return budget

    def _kvc_compressible(self, request) -> bool:
        # Caught up: the prompt (or, after a preemption, the recomputed prompt and
        # outputs) is in the cache; only the last sampled token is not.
        return (
            request.num_computed_tokens >= max(request.num_prompt_tokens, request.num_tokens - 1)
            and self.page_accounting.logical_len(request.request_id) > 0
            and not self.page_accounting.is_pending(request.request_id)
            and self._kvc_budget(request).compresses
        )

    def _kvc_try_compress(self, request, reason: str) -> int:
        """Order a compression of ``request`` this step if it frees pages; returns pages."""
        accounting = self.page_accounting
        request_id = request.request_id
        head_lens = accounting.head_lens_of(request_id)
        kvs = int(head_lens.sum())
        cap = self.kvcompress_config.max_kv_per_iteration
        if self.kvc_kvs_this_step and self.kvc_kvs_this_step + kvs > cap:
            return 0
        budget = self._kvc_budget(request)
        context_len = accounting.logical_len(request_id)
        evict = blocks_to_evict(head_lens, context_len, budget, accounting.block_size)
        self.kvc_last_compressed[request_id] = self.kvc_step
        if request_id in self.kvc_recompress_due:
            self.kvc_recompress_due.discard(request_id)
            self.kvc_stats["recompressed_after_preemption"] += 1
        if evict <= 0:
            return 0
        self.kvc_kvs_this_step += kvs
        accounting.mark_compressed(request_id, evict)
        self.kvc_orders[request_id] = (
            evict, context_len, budget.protected_window, budget.sink_tokens,
            POLICY_NAMES.index(budget.policy),
        )
        stats = self.kvc_stats
        stats["compressions"] += 1
        stats[f"compressions_{reason}"] += 1
        stats["pages_freed"] += evict
        return evict

    def _kvc_candidates(self, requests) -> list:
        """Compressible requests, never compressed first, then least recently."""
        ready = [r for r in requests if self._kvc_compressible(r)]
        return sorted(ready, key=lambda r: self.kvc_last_compressed.get(r.request_id, -1))

    def _kvc_relieve(self, request, pages_short: int) -> None:
        """Compress running requests not yet scheduled this step (vLLM would preempt
        them next) and ``request`` itself, until ``pages_short`` pages are freed."""
        scheduled = self.kv_cache_manager.scheduled_this_step
        waiting_turn = [r for r in self.running if r.request_id not in scheduled]
        if request not in waiting_turn:
            waiting_turn.append(request)
        freed = 0
        for candidate in self._kvc_candidates(waiting_turn):
            freed += self._kvc_try_compress(candidate, "instead_of_preemption")
            if freed >= pages_short:
                break

    def _kvc_due(self) -> None:
        """Compress requests whose prefill completed, and on the interval."""
        interval = self.kvcompress_config.interval
        for request in self._kvc_candidates(self.running):
            last = self.kvc_last_compressed.get(request.request_id)
            if last is None:
                self._kvc_try_compress(request, "after_prefill")
            elif interval and self.kvc_step - last >= interval:
                self._kvc_try_compress(request, "on_interval")

    # ------------------------------------------------------------------ vLLM hooks

    def schedule(self, *args, **kwargs):
        self.kvc_step += 1
        self.kvc_orders = {}
        self.kvc_kvs_this_step = 0
        self.kv_cache_manager.scheduled_this_step = set()
        if self.kvcompress_config.enabled:
            self._kvc_due()
        output = super().schedule(*args, **kwargs)
        accounting = self.page_accounting
        # Orders of requests preempted later in this step are void (their pages are gone).
        output.kvcompress_compress = {
            request_id: order
            for request_id, order in self.kvc_orders.items()
            if accounting.is_pending(request_id)
        }
        stats = self.kvc_stats
        stats["max_running"] = max(stats["max_running"], len(self.running))
        decoding = sum(
            1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens
        )
        stats["max_decoding"] = max(stats["max_decoding"], decoding)
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        report = getattr(model_runner_output, "kvcompress_report", None)
        if report is not None:
            self._kvc_adopt(report)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _kvc_adopt(self, report: dict) -> None:
        """Take the worker's head lengths of compressed requests; cross-check counts."""
        accounting = self.page_accounting
        for request_id, head_lens in report["head_lens"].items():
            accounting.adopt(request_id, head_lens)
        for request_id in accounting.pending_request_ids():
            logger.error("kvcompress: no head lengths reported for compressed request %s",
                         request_id)
        stats = self.kvc_stats
        stats["steps_checked"] += 1
        held = {r: accounting.pages_held(r) for r in accounting.request_ids()}
        if report["free"] != accounting.num_free_pages or report["held"] != held:
            stats["mismatches"] += 1
            logger.error(
                "kvcompress: worker pages (free %d, held %s) differ from the "
                "scheduler's (free %d, held %s)",
                report["free"], report["held"], accounting.num_free_pages, held,
            )

    def _preempt_request(self, request, *args, **kwargs) -> None:
        self.num_preemptions += 1
        # Recomputed from scratch: due for compression again after its new prefill.
        if self.kvc_last_compressed.pop(request.request_id, None) is not None:
            self.kvc_stats["preempted_after_compression"] += 1
            self.kvc_recompress_due.add(request.request_id)
        self.kvc_orders.pop(request.request_id, None)
        super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        self.kvc_budgets.pop(request.request_id, None)
        self.kvc_last_compressed.pop(request.request_id, None)
        self.kvc_recompress_due.discard(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def kvcompress_page_stats(self) -> dict:
        """Scheduler-side page counts per running request (for tests and logs)."""
        accounting = self.page_accounting
        accounting.check_consistent()
        return {
            "num_pages": accounting.num_pages,
            "num_free": accounting.num_free_pages,
            "block_size": accounting.block_size,
            "num_layers": accounting.num_layers,
            "num_kv_heads": accounting.num_kv_heads,
            "requests": {
                request_id: {
                    "pages_held": accounting.pages_held(request_id),
                    "head_lens": accounting.head_lens_of(request_id).tolist(),
                    "logical_len": accounting.logical_len(request_id),
                }
                for request_id in accounting.request_ids()
            },
            "running": [request.request_id for request in self.running],
            "num_preemptions": self.num_preemptions,
            **self.kvc_stats,
        }

    def kvcompress_reset_peaks(self) -> None:
        """Zero the max-batch counters (benchmarks measure one batch at a time)."""
        self.kvc_stats["max_running"] = 0
        self.kvc_stats["max_decoding"] = 0
