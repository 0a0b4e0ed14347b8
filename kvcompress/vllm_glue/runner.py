"""Model-runner side of kvcompress: vLLM's model-runner overrides, each delegating.

Mixed into vLLM's V1 model runner (``CPUModelRunner`` on CPU, ``GPUModelRunner`` on
CUDA). Per step:

1. before vLLM updates its persistent batch, pages of finished / preempted / resumed
   requests go back to the allocator and the scheduler's new requests are admitted
   (``StepPlanner.release`` / ``admit``); the sequences the scheduler ordered
   compressed (``StepCompression.orders``) are compressed (``worker_compression.py``);
2. after it, every scheduled request's heads grow by its scheduled tokens and the
   step's plan is published for the attention backend (``step_planner.py``, its metric
   queries from ``metric_queries.py``);
3. after the forward, the decode metric queue and the post-forward hooks of the
   scoring kinds run (kvzip's reconstruction, surprisal: ``scoring_kinds.py``), and the step's output carries a
   ``WorkerReport`` (``worker_compression.step_report``), gathered over TP ranks
   (``tensor_parallel.py``), which the scheduler adopts and cross-checks.

The pool is built over vLLM's KV buffer in ``initialize_kv_cache`` (``pool_builder.py``).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvcompress.config import KVCompressConfig
from kvcompress.contract import CompressionOrder, WorkerReport
from kvcompress.ops import PerHeadPagedCache
from kvcompress.ops.prefix_groups import PrefixGroups
from kvcompress.vllm_glue import diagnostics
from kvcompress.vllm_glue.kv_layout import compressible_layers, layer_windows_checked, single_full_attention_group
from kvcompress.vllm_glue.metric_queries import MetricQuerySelector
from kvcompress.vllm_glue.outputs import step_compression_of, with_report
from kvcompress.vllm_glue.pool_builder import BuiltPool, buffer_config, build_pool, model_rope
from kvcompress.vllm_glue.scoring_kind import ScoringContext
from kvcompress.vllm_glue.scoring_kinds import ScoringKinds
from kvcompress.vllm_glue.step import WorkerCacheState, set_current_step, set_worker_state
from kvcompress.vllm_glue.step_planner import StepPlanner
from kvcompress.vllm_glue.tensor_parallel import gather_reports, tp_rank
from kvcompress.vllm_glue.warm_up import mixed_warm_up_due, warm_up_mixed_steps
from kvcompress.worker_compression import (
    NO_COMPRESSION, CompressionOutcome, CompressionRun, WorkerStats, run_orders, step_report,
)
from kvcompress.worker_requests import WorkerRequests

logger = init_logger(f"vllm.{__name__}")


class KVCompressRunnerMixin:
    """Adds the per-(layer, KV head) page pool to a vLLM V1 model runner.

    Its parts, set when the pool is built: ``kvc_state`` (the pool, published for the
    attention backend), ``kvc_requests`` (live requests), ``kvc_planner`` (step plans,
    ``step_planner.py``), ``kvc_scoring`` (the scoring kinds' hooks,
    ``scoring_kinds.py``), ``kvc_stats`` (counters) and ``kvc_report`` (this step's report)."""

    kvc_cache: PerHeadPagedCache | None = None
    kvc_planner: StepPlanner | None = None

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig, *args, **kwargs) -> None:
        # vLLM's CUDA-graph memory profiling builds a minimal KV cache first
        # (is_profiling=True), then the real one: the previous pool's tables go before
        # the next buffer is allocated, not after (two table sets alive at once).
        self._kvc_drop_pool()
        super().initialize_kv_cache(self._kvc_buffer_config(kv_cache_config), *args, **kwargs)
        self._kvc_build_pool(self.kv_cache_config)

    def _kvc_buffer_config(self, kv_cache_config: KVCacheConfig) -> KVCacheConfig:
        """vLLM's configuration with the KV buffer grown by the pages past the pool."""
        return buffer_config(kv_cache_config, self.vllm_config, self.device.type)

    def _kvc_drop_pool(self) -> None:
        """Forget the pool: every reference to its cache and to views of the KV buffer."""
        set_current_step(None)
        set_worker_state(None)
        self.kvc_cache = None
        self.kvc_state = None
        self.kvc_prefix_groups = None  # holds the cache
        self.kvc_planner = None  # holds the pool's views (vLLM's CPU kernel's decode plan)
        self.kvc_scoring = None  # holds the pool

    def _cleanup_profiling_kv_cache(self) -> None:
        # vLLM drops its references to the CUDA-graph profiling KV buffer here and empties
        # the allocator's cache: the pool's views of that buffer and its tables must go
        # too, or they stay allocated until the real KV cache replaces them.
        self._kvc_drop_pool()
        super()._cleanup_profiling_kv_cache()

    def _kvc_build_pool(self, kv_cache_config: KVCacheConfig) -> None:
        """The pool over vLLM's KV buffer (``pool_builder.py``) and the runner's parts."""
        config = self.vllm_config
        self.kvc_settings = settings = KVCompressConfig.from_additional_config(config.additional_config)
        # Decode queries of one batch share one kernel call: the server policy's power.
        self.kvc_decode_metric_power = settings.policy_for().metric.power
        built = build_pool(
            self.kv_caches[0], kv_cache_config, config, metric_power=self.kvc_decode_metric_power,
            # get_model(): the model itself, not a CUDA-graph wrapper forwarding to it.
            rope=model_rope(self.get_model()),
        )
        state = self.kvc_state = built.state
        cache = self.kvc_cache = state.cache
        set_worker_state(state)  # for the attention backend
        # Sliding-window layers keep every KV: compressions shrink the others only (the
        # scheduler counts the same layers, kv_layout.compressible_layers).
        windows = layer_windows_checked(config, list(built.shape.layer_names))
        layers = compressible_layers(windows)
        self.kvc_compress_layers = (
            None if len(layers) == len(windows) else torch.tensor(layers, dtype=torch.int64, device=cache.device)
        )
        self.kvc_requests = WorkerRequests(cache.max_seqs, cache.device)
        self.kvc_report: WorkerReport | None = None
        # Page groups of the blocks vLLM's prefix cache holds (None: prefix caching off).
        self.kvc_prefix_groups = PrefixGroups(cache) if config.cache_config.enable_prefix_caching else None
        # This worker's TP rank: it frees the pages the scheduler credited to its pool.
        self.kvc_tp_rank = tp_rank()
        self.kvc_tp_size = config.parallel_config.tensor_parallel_size
        self.kvc_stats = WorkerStats()
        self.kvc_generator: torch.Generator | None = None
        self.kvc_planner = self._kvc_make_planner(built)
        logger.info(
            "kvcompress: %d pages of %d tokens x 1 (layer, KV head) "
            "(%d layers x %d KV heads, %d bytes per page); kernels: %s",
            cache.num_pages, cache.block_size, cache.num_layers, cache.num_kv_heads, built.shape.page_bytes,
            state.ops,
        )
        if mixed_warm_up_due(state.ops, config):
            self._kvc_warm_up_mixed_steps()

    def _kvc_make_planner(self, built: BuiltPool) -> StepPlanner:
        """The step planner and the scoring kinds' glue (``scoring_kinds.py``); no
        compression's inputs recorded (tests switch it on)."""
        state, config = built.state, self.vllm_config
        self.kvc_scoring = ScoringKinds(ScoringContext(self, state, list(built.shape.layer_names)))
        # request id -> a compression's inputs, while tests record them (None: off).
        self.kvc_recorded: dict[str, dict] | None = None
        selector = MetricQuerySelector(
            self.kvc_settings, self.kvc_requests, config.model_config, state.cache.device,
            state.cache.num_layers, self.kvc_decode_metric_power, self.kvc_scoring,
        )
        return StepPlanner(
            state, config.model_config.dtype, self.kvc_requests, self.kvc_settings, self.kvc_stats,
            config.model_config.get_num_attention_heads(config.parallel_config), self.kvc_prefix_groups,
            selector, window_layers=self.kvc_compress_layers is not None,
        )

    def _kvc_warm_up_mixed_steps(self) -> int:
        """Compile the kernels of steps with prompt rows now, before vLLM arms its JIT
        monitor (``warm_up.py``); the pool is not touched. Returns the steps run."""
        started = time.perf_counter()
        spec = single_full_attention_group(self.kv_cache_config).kv_cache_spec
        steps = warm_up_mixed_steps(
            self.kvc_state, self.kvc_planner.num_q_heads, spec.head_size, spec.dtype, self.kvc_decode_metric_power,
        )
        logger.info("kvcompress: warmed up %d steps with prompt rows in %.2f s",
                    steps, time.perf_counter() - started)
        return steps

    def _update_states(self, scheduler_output):
        set_current_step(None)
        planner = self.kvc_planner
        if planner is not None:
            planner.current = None
            step = step_compression_of(scheduler_output)
            # Frees first: the scheduler may have handed these pages to new work.
            gone = set(scheduler_output.finished_req_ids)
            gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
            self.kvc_scoring.release(planner.release(gone))
            planner.admit(step, slots_changed=bool(gone))
            self.kvc_report = None
            self._kvc_step_started = time.perf_counter()
            if step.window_drops:
                self._kvc_drop_behind_windows(step.window_drops)
            outcome = self._kvc_compress(step.orders)
        result = super()._update_states(scheduler_output)
        if planner is not None:
            if scheduler_output.total_num_scheduled_tokens:
                self._kvc_plan_step(scheduler_output)
            self.kvc_report = step_report(
                self.kvc_cache, self.kvc_requests, outcome, step.report_pages_held, self.kvc_stats,
            )
        return result

    def _kvc_plan_step(self, scheduler_output) -> None:
        """Grow the scheduled rows' heads and publish the step (``step_planner.py``)."""
        self.kvc_planner.plan(self.input_batch, scheduler_output, self.requests)

    def _kvc_drop_behind_windows(self, drops: dict[str, np.ndarray]) -> None:
        """Give back the pages the scheduler ordered dropped behind sliding windows
        (``StepCompression.window_drops``, already credited; the step's free-page report
        cross-checks them)."""
        slots = self.kvc_requests.placed(drops)
        if not slots:
            return
        cache = self.kvc_cache
        # This rank's pool holds its own heads of every layer: the same pages per head.
        by_layer = torch.from_numpy(np.stack([np.asarray(drops[r], np.int64) for r in slots]))
        freed = cache.drop_leading_pages(torch.tensor(list(slots.values()), dtype=torch.int64), by_layer)
        self.kvc_stats.window_pages_freed += freed

    def _kvc_compress(self, orders: dict[str, CompressionOrder]) -> CompressionOutcome:
        """Compress the sequences the scheduler ordered (``worker_compression.py``); the
        step's report carries the outcome's records."""
        slots = self.kvc_requests.placed(orders) if orders else {}
        if not slots:
            return NO_COMPRESSION
        state = self.kvc_state
        run = CompressionRun(
            cache=state.cache, pool=state.pool, ops=state.ops, rank=self.kvc_tp_rank,
            block_cost=self.kvc_settings.block_cost, generator=self._kvc_random,
            flush=self.kvc_planner.decode_metrics.flush, layers=self.kvc_compress_layers,
            record=None if self.kvc_recorded is None else functools.partial(diagnostics.record_inputs, self),
        )
        outcome = run_orders(run, orders, slots, self.kvc_stats)
        if outcome.mismatch:
            # The scheduler credited the pages it ordered; the report corrects it.
            logger.error("kvcompress: scheduler ordered %d pages evicted, the schedule freed %d",
                         outcome.pages_ordered, outcome.pages_freed)
        return outcome

    def _kvc_random(self) -> torch.Generator:
        """The random policy's generator, seeded once from the model's seed."""
        if self.kvc_generator is None:
            self.kvc_generator = torch.Generator(device=self.kvc_cache.device)
            self.kvc_generator.manual_seed(self.vllm_config.model_config.seed or 0)
        return self.kvc_generator

    def _kvc_attach_report(self, output):
        if self.kvc_cache is None or self.kvc_report is None or output is None:
            return output
        if not hasattr(output, "req_ids"):
            return output  # async wrappers do not occur: kvcompress turns async scheduling off
        # One rank: its report is the step's (no gather, no group lookups every step).
        reports = (self.kvc_report,) if self.kvc_tp_size == 1 else gather_reports(self.kvc_report)
        self.kvc_report = None
        if reports is not None:  # this rank's output is the one vLLM reads
            output = with_report(output, reports)
        self.kvc_stats.step_seconds += time.perf_counter() - self._kvc_step_started
        return output

    def execute_model(self, *args, **kwargs):
        output = super().execute_model(*args, **kwargs)
        planner = self.kvc_planner
        if planner is not None:
            self._kvc_after_forward(planner)
        return self._kvc_attach_report(output)

    def _kvc_after_forward(self, planner: StepPlanner) -> None:
        """What scores from the step's forward: the queue of decode metric queries and
        the scoring kinds' post-forward passes (kvzip's reconstruction, surprisal)."""
        planner.after_forward()
        self.kvc_scoring.after_forward()

    def sample_tokens(self, *args, **kwargs):
        return self._kvc_attach_report(super().sample_tokens(*args, **kwargs))

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
        if uniform and force_uniform_decode is None and self.kvc_planner is not None:
            step = self.kvc_planner.current
            return step is not None and step.decode_only
        return uniform

    def _dummy_run(self, *args, **kwargs):
        # Warm-up, profiling and graph-capture batches must not touch the pages of
        # real requests: no plan, and decode buffers holding only padding rows.
        set_current_step(None)
        state: WorkerCacheState | None = self.kvc_state if self.kvc_planner is not None else None
        if state is not None:
            self.kvc_planner.current = None
            if state.decode_buffers is not None:
                state.decode_buffers.fill(0)
        return super()._dummy_run(*args, **kwargs)
