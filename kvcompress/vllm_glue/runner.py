"""Model-runner side of kvcompress: owns the page pool and plans each step.

Mixed into vLLM's V1 model runner (``CPUModelRunner`` on CPU). Per step, after
vLLM updates its persistent batch:

1. pages of finished / preempted / resumed requests go back to the allocator;
2. every scheduled request's heads grow by its scheduled tokens (pages come from
   the free-page stack, batched over requests x layers x heads);
3. the plan (tables, lengths, write slots, positions) is published for the
   attention backend.

The scheduler (``scheduler.py``) runs the same length arithmetic, so page
counts agree without a round trip; ``kvcompress_pages_used`` exposes the worker
side for tests.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

from kvcompress.ops import PerHeadPagedCache
from kvcompress.vllm_glue.attention_backend import (
    PerHeadStep,
    WorkerCacheState,
    set_current_step,
    set_worker_state,
)
from kvcompress.vllm_glue.kv_layout import single_full_attention_group

logger = init_logger(f"vllm.{__name__}")


class PerHeadRunnerMixin:
    """Adds the per-(layer, KV head) page pool to a vLLM V1 model runner."""

    kvc_cache: PerHeadPagedCache | None = None

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self._kvc_build_pool(self.kv_cache_config)

    def _kvc_build_pool(self, kv_cache_config: KVCacheConfig) -> None:
        group = single_full_attention_group(kv_cache_config)
        spec: FullAttentionSpec = group.kv_cache_spec
        layer_names = list(group.layer_names)
        num_layers, num_kv_heads = len(layer_names), spec.num_kv_heads
        block_size, head_dim, dtype = spec.block_size, spec.head_size, spec.dtype
        storage = self.kv_caches[0].untyped_storage()
        flat = torch.empty(0, dtype=torch.int8, device=self.kv_caches[0].device)
        flat.set_(storage)
        page_bytes = 2 * block_size * head_dim * dtype.itemsize
        num_pages = kv_cache_config.num_blocks * num_layers * num_kv_heads
        if num_pages * page_bytes > flat.numel():
            raise RuntimeError(
                f"KV buffer of {flat.numel()} bytes cannot hold {num_pages} pages "
                f"of {page_bytes} bytes"
            )
        pool = flat[: num_pages * page_bytes].view(dtype).view(
            num_pages, 2, block_size, head_dim
        )
        max_model_len = self.vllm_config.model_config.max_model_len
        cache = PerHeadPagedCache(
            num_pages=num_pages,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            max_seqs=self.vllm_config.scheduler_config.max_num_seqs,
            max_pages_per_head=-(-max_model_len // block_size),
            device=pool.device,
        )
        self.kvc_cache = cache
        self.kvc_seq_slot: dict[str, int] = {}
        self.kvc_logical_len: dict[str, int] = {}
        self.kvc_stats = {"steps_checked": 0, "mismatches": 0, "max_pages_used": 0}
        set_worker_state(
            WorkerCacheState(
                cache=cache,
                key_cache=pool[:, 0],
                value_cache=pool[:, 1],
                layer_index={name: i for i, name in enumerate(layer_names)},
            )
        )
        logger.info(
            "kvcompress: %d pages of %d tokens x 1 (layer, KV head) "
            "(%d layers x %d KV heads, %d bytes per page)",
            num_pages, block_size, num_layers, num_kv_heads, page_bytes,
        )

    def _kvc_release(self, request_ids) -> None:
        slots = [self.kvc_seq_slot.pop(r) for r in request_ids if r in self.kvc_seq_slot]
        for request_id in request_ids:
            self.kvc_logical_len.pop(request_id, None)
        if slots:
            self.kvc_cache.release(torch.tensor(slots, dtype=torch.int64))

    def _update_states(self, scheduler_output):
        set_current_step(None)
        if self.kvc_cache is not None:
            # Frees first: the scheduler may have handed these pages to new work.
            gone = set(scheduler_output.finished_req_ids)
            gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
            self._kvc_release(gone)
        result = super()._update_states(scheduler_output)
        if self.kvc_cache is not None and scheduler_output.total_num_scheduled_tokens:
            self._kvc_plan_step(scheduler_output)
        return result

    def _kvc_plan_step(self, scheduler_output) -> None:
        cache = self.kvc_cache
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        num_new = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64
        )
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        slots = []
        for request_id, done in zip(req_ids, computed.tolist()):
            slot = self.kvc_seq_slot.get(request_id)
            if slot is None:
                if done != 0:
                    raise RuntimeError(
                        f"kvcompress: request {request_id} starts with {done} computed "
                        "tokens but holds no pages (prefix caching must be off)"
                    )
                slot = cache.new_sequence()
                self.kvc_seq_slot[request_id] = slot
                self.kvc_logical_len[request_id] = 0
            elif self.kvc_logical_len[request_id] != done:
                raise RuntimeError(
                    f"kvcompress: request {request_id} has {done} computed tokens but "
                    f"its heads were grown for {self.kvc_logical_len[request_id]}"
                )
            slots.append(slot)
        for request_id, done, new in zip(req_ids, computed.tolist(), num_new.tolist()):
            self.kvc_logical_len[request_id] = done + new
        query_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        positions = np.repeat(computed - query_start[:-1], num_new) + np.arange(
            query_start[-1]
        )
        device = cache.device
        seq_slots = torch.tensor(slots, dtype=torch.int64, device=device)
        positions_t = torch.from_numpy(positions).to(device)
        plan = cache.append(seq_slots, torch.from_numpy(num_new).to(device), positions_t)
        self._kvc_check_against_scheduler(scheduler_output)
        head_lens = cache.head_lens[seq_slots]
        max_pages = int(((head_lens.max() + cache.block_size - 1) // cache.block_size).item())
        set_current_step(
            PerHeadStep(
                num_reqs=num_reqs,
                num_tokens=int(query_start[-1]),
                query_start_loc=query_start.tolist(),
                query_positions=positions_t,
                block_tables=cache.page_tables[seq_slots, :, :, : max(1, max_pages)],
                head_lens=head_lens,
                plan=plan,
            )
        )

    def _kvc_check_against_scheduler(self, scheduler_output) -> None:
        expected = getattr(scheduler_output, "kvcompress_expected_pages", None)
        if expected is None:
            return
        expected_free, expected_held = expected
        cache = self.kvc_cache
        stats = self.kvc_stats
        stats["steps_checked"] += 1
        stats["max_pages_used"] = max(stats["max_pages_used"], cache.allocator.num_used)
        held = {}
        if self.kvc_seq_slot:
            request_ids = list(self.kvc_seq_slot)
            slots = torch.tensor([self.kvc_seq_slot[r] for r in request_ids])
            per_request = cache.pages_held(slots).sum(dim=(1, 2)).tolist()
            held = dict(zip(request_ids, per_request))
        if cache.allocator.num_free != expected_free or held != expected_held:
            stats["mismatches"] += 1
            logger.error(
                "kvcompress: worker pages (free %d, held %s) differ from the "
                "scheduler's (free %d, held %s)",
                cache.allocator.num_free, held, expected_free, expected_held,
            )

    def _dummy_run(self, *args, **kwargs):
        # Warm-up and profiling batches must not touch the pages of real requests.
        set_current_step(None)
        return super()._dummy_run(*args, **kwargs)

    def kvcompress_pages_used(self) -> dict[str, int]:
        """Worker-side page counts (for tests and the consistency check)."""
        if self.kvc_cache is None:
            return {}
        held = self.kvc_cache.pages_held()
        return {
            "num_pages": self.kvc_cache.num_pages,
            "num_free": self.kvc_cache.allocator.num_free,
            "held_by_live_requests": int(held.sum().item()),
            "live_requests": len(self.kvc_seq_slot),
            **self.kvc_stats,
        }
