"""Model-runner side of kvcompress: owns the page pool and plans each step.

Mixed into vLLM's V1 model runner (``CPUModelRunner`` on CPU). Per step, after
vLLM updates its persistent batch:

1. pages of finished / preempted / resumed requests go back to the allocator;
2. the sequences the scheduler ordered compressed (``kvcompress_compress``:
   blocks to evict, context length, protected window, sinks) are compressed:
   block-eviction schedule over their metrics, MoveCache, trailing pages freed;
3. every scheduled request's heads grow by its scheduled tokens (pages come from
   the free-page stack, batched over requests x layers x heads);
4. the plan (tables, lengths, write slots, positions, which queries add to the
   eviction metrics) is published for the attention backend;
5. the step's output carries ``kvcompress_report``: the per-head lengths of the
   compressed sequences and the worker's page counts, which the scheduler
   adopts and cross-checks before it schedules again.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from kvcompress.budget import request_budget
from kvcompress.config import KVCompressConfig
from kvcompress.ops import PerHeadPagedCache
from kvcompress.policies import POLICY_NAMES
from kvcompress.vllm_glue.step import (
    DecodeBuffers,
    MetricQueries,
    PromptMetricRows,
    PerHeadStep,
    WorkerCacheState,
    current_step,
    get_worker_state,
    set_current_step,
    set_worker_state,
)
from kvcompress.vllm_glue.kv_layout import (
    pages_in_buffer,
    pages_in_pool,
    single_full_attention_group,
)

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
        buffer_pages = pages_in_buffer(kv_cache_config)
        num_pages = pages_in_pool(kv_cache_config)[0]  # the last buffer page is scratch
        if buffer_pages * page_bytes > flat.numel():
            raise RuntimeError(
                f"KV buffer of {flat.numel()} bytes cannot hold {buffer_pages} pages "
                f"of {page_bytes} bytes"
            )
        pool = flat[: buffer_pages * page_bytes].view(dtype).view(
            buffer_pages, 2, block_size, head_dim
        )
        max_model_len = self.vllm_config.model_config.max_model_len
        max_num_seqs = self.vllm_config.scheduler_config.max_num_seqs
        max_pages_per_head = -(-max_model_len // block_size)
        cache = PerHeadPagedCache(
            num_pages=num_pages,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            max_seqs=max_num_seqs + 1,  # + the padding rows' empty slot
            max_pages_per_head=max_pages_per_head,
            device=pool.device,
        )
        pad_slot = cache.new_sequence()
        self.kvc_cache = cache
        self.kvc_settings = KVCompressConfig.from_additional_config(
            self.vllm_config.additional_config
        )
        self.kvc_seq_slot: dict[str, int] = {}
        self.kvc_logical_len: dict[str, int] = {}
        self.kvc_compresses: dict[str, bool] = {}
        self.kvc_report: dict | None = None
        self.kvc_stats = {
            "max_pages_used": 0,
            "compressions": 0,
            "pages_freed": 0,
            "kvs_evicted": 0,
            "compress_seconds": 0.0,
            "step_seconds": 0.0,
            "evict_mismatches": 0,
            # steps whose attention read the fixed-address DecodeBuffers
            "decode_only_steps": 0,
            "pages_freed_by_policy": {},
            # policy -> [layers]: unprotected KVs kept after its compressions.
            "kept_unprotected_by_layer": {},
        }
        # Resolved once: the server's policy settings are fixed for the engine's life.
        self.kvc_policies = {name: self.kvc_settings.policy_for(name) for name in POLICY_NAMES}
        # Decode queries of one batch share one kernel call: the server policy's power.
        self.kvc_decode_metric_power = self.kvc_policies[self.kvc_settings.policy].metric.power
        capture_sizes = self.vllm_config.compilation_config.max_cudagraph_capture_size or 0
        decode_buffers = DecodeBuffers.allocate(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            max_rows=max(max_num_seqs, capture_sizes),
            num_slots=cache.max_seqs,
            pad_slot=pad_slot,
            scratch_page=buffer_pages - 1,
            max_head_len=max_pages_per_head * block_size,
            block_size=block_size,
            metric_power=self.kvc_decode_metric_power,
            device=pool.device,
        )
        self.kvc_generator: torch.Generator | None = None
        self.kvc_policy: dict[str, object] = {}
        set_worker_state(
            WorkerCacheState(
                cache=cache,
                key_cache=pool[:, 0],
                value_cache=pool[:, 1],
                layer_index={name: i for i, name in enumerate(layer_names)},
                decode_buffers=decode_buffers,
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
            self.kvc_compresses.pop(request_id, None)
            self.kvc_policy.pop(request_id, None)
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
            self.kvc_report = None
            self._kvc_step_started = time.perf_counter()
            compressed = self._kvc_compress(
                getattr(scheduler_output, "kvcompress_compress", None) or {}
            )
        result = super()._update_states(scheduler_output)
        if self.kvc_cache is not None:
            if scheduler_output.total_num_scheduled_tokens:
                self._kvc_plan_step(scheduler_output)
            self.kvc_report = self._kvc_make_report(compressed)
        return result

    def _kvc_compress(self, orders: dict) -> list[str]:
        """Compress the sequences the scheduler ordered; returns their request ids.

        ``orders``: request id -> ``(evict_blocks, context_len, protected_window,
        sink_tokens, policy index in POLICY_NAMES)``, computed by the scheduler from
        the same head lengths.
        """
        from kvcompress.ops.move_cache import compress_sequences

        request_ids = [r for r in orders if r in self.kvc_seq_slot]
        if not request_ids:
            return []
        started = time.perf_counter()
        cache = self.kvc_cache
        device = cache.device
        columns = np.array([orders[r] for r in request_ids], dtype=np.int64)  # [S, 5]
        columns_t = torch.from_numpy(columns).to(device)
        seq_slots = torch.tensor(
            [self.kvc_seq_slot[r] for r in request_ids], dtype=torch.int64, device=device
        )
        state = get_worker_state()
        pages_freed = kvs_evicted = 0
        # One batched compression per policy present in this step's orders.
        for policy_index in np.unique(columns[:, 4]).tolist():
            rows = torch.from_numpy(np.flatnonzero(columns[:, 4] == policy_index)).to(device)
            policy = self.kvc_policies[POLICY_NAMES[policy_index]]
            if self.kvc_generator is None:
                self.kvc_generator = torch.Generator(device=device)
                self.kvc_generator.manual_seed(self.vllm_config.model_config.seed or 0)
            result = compress_sequences(
                cache,
                state.key_cache,
                state.value_cache,
                seq_slots[rows],
                columns_t[rows, 0],
                columns_t[rows, 1],
                columns_t[rows, 2],
                columns_t[rows, 3],
                block_cost=self.kvc_settings.block_cost,
                policy=policy,
                generator=self.kvc_generator,
            )
            pages_freed += int(result.pages_freed)
            kvs_evicted += int(result.kvs_evicted)
            by_policy = self.kvc_stats["pages_freed_by_policy"]
            by_policy[policy.name] = by_policy.get(policy.name, 0) + int(result.pages_freed)
            by_layer = self.kvc_stats["kept_unprotected_by_layer"]
            kept = result.kept_unprotected_by_layer.tolist()
            previous = by_layer.get(policy.name, [0] * len(kept))
            by_layer[policy.name] = [a + b for a, b in zip(previous, kept)]
        stats = self.kvc_stats
        stats["compressions"] += len(request_ids)
        stats["pages_freed"] += pages_freed
        stats["kvs_evicted"] += kvs_evicted
        if pages_freed != int(columns[:, 0].sum()):
            # The scheduler credited columns[:, 0] pages; the report corrects it.
            stats["evict_mismatches"] += 1
            logger.error(
                "kvcompress: scheduler ordered %d pages evicted, the schedule freed %d",
                int(columns[:, 0].sum()), pages_freed,
            )
        stats["compress_seconds"] += time.perf_counter() - started
        return request_ids

    def _kvc_make_report(self, compressed: list[str]) -> dict:
        """Worker-side truth for the scheduler after this step's appends."""
        cache = self.kvc_cache
        held = {}
        head_lens = {}
        if self.kvc_seq_slot:
            request_ids = list(self.kvc_seq_slot)
            slots = torch.tensor([self.kvc_seq_slot[r] for r in request_ids], device=cache.device)
            per_request = cache.pages_held(slots).sum(dim=(1, 2)).tolist()
            held = dict(zip(request_ids, per_request))
            for request_id in compressed:
                if request_id in self.kvc_seq_slot:
                    slot = self.kvc_seq_slot[request_id]
                    head_lens[request_id] = cache.head_lens[slot].cpu().numpy().copy()
        stats = self.kvc_stats
        stats["max_pages_used"] = max(stats["max_pages_used"], cache.allocator.num_used)
        return {"free": cache.allocator.num_free, "held": held, "head_lens": head_lens}

    def _kvc_attach_report(self, output):
        if self.kvc_cache is None or self.kvc_report is None or output is None:
            return output
        if not hasattr(output, "req_ids"):
            return output  # async wrappers do not occur: kvcompress turns async scheduling off
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = copy.copy(output)
        output.kvcompress_report = self.kvc_report
        self.kvc_report = None
        self.kvc_stats["step_seconds"] += time.perf_counter() - self._kvc_step_started
        return output

    def execute_model(self, *args, **kwargs):
        return self._kvc_attach_report(super().execute_model(*args, **kwargs))

    def sample_tokens(self, *args, **kwargs):
        return self._kvc_attach_report(super().sample_tokens(*args, **kwargs))

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
                params = self.requests[request_id].sampling_params
                budget = request_budget(self.kvc_settings, getattr(params, "extra_args", None))
                self.kvc_compresses[request_id] = budget.compresses
                policy = self.kvc_policies[budget.policy]
                if budget.observation_window is not None:
                    policy = dataclasses.replace(
                        policy,
                        metric=dataclasses.replace(
                            policy.metric, observation_window=budget.observation_window
                        ),
                    )
                self.kvc_policy[request_id] = policy
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
        if self._kvc_is_decode_only(req_ids, computed, num_new):
            self._kvc_plan_decode_step(req_ids, seq_slots, positions_t, plan, query_start)
            return
        head_lens = cache.head_lens[seq_slots]
        max_head_len = int(head_lens.max().item())
        max_pages = -(-max_head_len // cache.block_size)
        set_current_step(
            PerHeadStep(
                num_reqs=num_reqs,
                num_tokens=int(query_start[-1]),
                query_start_loc=query_start.tolist(),
                query_positions=positions_t,
                block_tables=cache.page_tables[seq_slots, :, :, : max(1, max_pages)],
                head_lens=head_lens,
                max_head_len=max_head_len,
                plan=plan,
                metrics=self._kvc_metric_queries(req_ids, computed, num_new, query_start),
            )
        )

    def _kvc_is_decode_only(self, req_ids, computed, num_new) -> bool:
        """Every row is one generated token (no prompt query, so no prompt metrics)."""
        if not len(req_ids) or not bool((num_new == 1).all()):
            return False
        return all(
            int(done) >= self.requests[request_id].num_prompt_tokens
            for request_id, done in zip(req_ids, computed.tolist())
        )

    def _kvc_plan_decode_step(self, req_ids, seq_slots, positions_t, plan, query_start) -> None:
        """Publish a decode-only step through the fixed-address ``DecodeBuffers``."""
        buffers = get_worker_state().decode_buffers
        self.kvc_stats["decode_only_steps"] += 1
        flagged = [i for i, r in enumerate(req_ids) if self.kvc_compresses.get(r, False)]
        buffers.fill(
            len(req_ids),
            seq_slots,
            positions_t,
            plan.write_pages,
            plan.write_offsets,
            seq_slots[flagged] if flagged else None,
        )
        set_current_step(
            PerHeadStep(
                num_reqs=len(req_ids),
                num_tokens=len(req_ids),
                query_start_loc=query_start.tolist(),
                query_positions=positions_t,
                block_tables=None,
                head_lens=None,
                max_head_len=buffers.max_head_len,
                plan=plan,
                decode_only=True,
            )
        )

    def _is_uniform_decode(
        self,
        max_num_scheduled_tokens: int,
        uniform_decode_query_len: int,
        num_tokens: int,
        num_reqs: int,
        force_uniform_decode: bool | None = None,
    ) -> bool:
        """vLLM replays a full decode CUDA graph only for batches it calls uniform
        decode; one-token prompt chunks look like that but need prompt metrics, which
        run eagerly. So a step is uniform only if the plan is decode-only too."""
        uniform = super()._is_uniform_decode(
            max_num_scheduled_tokens=max_num_scheduled_tokens,
            uniform_decode_query_len=uniform_decode_query_len,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            force_uniform_decode=force_uniform_decode,
        )
        if uniform and force_uniform_decode is None and self.kvc_cache is not None:
            step = current_step()
            return step is not None and step.decode_only
        return uniform

    def _kvc_metric_queries(self, req_ids, computed, num_new, query_start) -> MetricQueries | None:
        """Which of this step's queries add to eviction metrics (compressing requests only).

        Prompt queries, by the request's policy: the last ``observation_window``
        prompt positions (or, in ``full`` mode, every prompt query; none for the
        position and random policies); decode queries: every query past the prompt,
        added by the attention kernel itself.
        """
        settings = self.kvc_settings
        if not settings.compresses and not any(self.kvc_compresses.values()):
            return None
        prompt_rows = []
        decode_seqs = np.zeros(len(req_ids), dtype=bool)
        for index, request_id in enumerate(req_ids):
            if not self.kvc_compresses.get(request_id, False):
                continue
            prompt_len = self.requests[request_id].num_prompt_tokens
            first, count = int(computed[index]), int(num_new[index])
            if first >= prompt_len:
                decode_seqs[index] = count == 1
                continue
            spec = self.kvc_policy[request_id].metric
            if not spec.scores_prompt:
                continue  # position / random policies need no attention scores
            scoring_from = 0 if spec.queries == "full" else prompt_len - spec.observation_window
            lo = max(first, scoring_from)
            hi = min(first + count, prompt_len)
            if hi > lo:
                start = int(query_start[index]) - first
                prompt_rows.append(PromptMetricRows(index, start + lo, start + hi, hi == prompt_len, spec))
        if not prompt_rows and not decode_seqs.any():
            return None
        return MetricQueries(
            prompt_rows=prompt_rows,
            decode_seqs=torch.from_numpy(decode_seqs).to(self.kvc_cache.device)
            if decode_seqs.any() else None,
            power=self.kvc_decode_metric_power,
        )

    def _dummy_run(self, *args, **kwargs):
        # Warm-up, profiling and graph-capture batches must not touch the pages of
        # real requests: no plan, and decode buffers holding only padding rows.
        set_current_step(None)
        state = get_worker_state()
        if self.kvc_cache is not None and state is not None and state.decode_buffers is not None:
            state.decode_buffers.fill(0)
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
