"""Scheduler side: vLLM's scheduler, admitting and preempting by real pages.

vLLM's ``KVCacheManager`` keeps handing out *logical* token blocks (the worker's
block table and vLLM's bookkeeping still want them), but over a virtual pool
large enough never to be the binding limit. Whether a request may be admitted
or extended is decided by ``PageAccounting``: the pages its heads would hold,
``sum over (layer, head) of ceil(head_len / block_size)``, against the pages of
the real pool. When pages run out ``allocate_slots`` returns ``None`` and vLLM's
own preemption path runs, which frees every page of the victim.
"""

from __future__ import annotations

import copy
import inspect

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig

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
    ) -> None:
        self._inner = inner
        self.accounting = accounting
        self.max_model_len = max_model_len
        self.watermark_pages = watermark_pages

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
    """vLLM's scheduler with per-(layer, KV head) page accounting."""

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
        )
        logger.info(
            "kvcompress scheduler: %d pages (%d layers x %d KV heads x %d token blocks), "
            "block size %d", num_pages, num_layers, num_kv_heads,
            kv_cache_config.num_blocks, block_size,
        )

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        # The worker checks its allocator against these counts every step.
        accounting = self.page_accounting
        output.kvcompress_expected_pages = (
            accounting.num_free_pages,
            {rid: accounting.pages_held(rid) for rid in accounting.request_ids()},
        )
        return output

    def _preempt_request(self, request, *args, **kwargs) -> None:
        self.num_preemptions += 1
        super()._preempt_request(request, *args, **kwargs)

    def kvcompress_page_stats(self) -> dict:
        """Scheduler-side page counts per running request (for tests and logs)."""
        accounting = self.page_accounting
        accounting.check_consistent()
        return {
            "num_pages": accounting.num_pages,
            "num_free": accounting.num_free_pages,
            "block_size": accounting.block_size,
            "requests": {
                request_id: {
                    "pages_held": accounting.pages_held(request_id),
                    "head_lens": accounting.head_lens_of(request_id).tolist(),
                }
                for request_id in accounting.request_ids()
            },
            "running": [request.request_id for request in self.running],
            "num_preemptions": self.num_preemptions,
        }
