"""Model-runner side of kvcompress: owns the page pool and plans each step.

Mixed into vLLM's V1 model runner (``CPUModelRunner`` on CPU). Per step, after
vLLM updates its persistent batch:

1. pages of finished / preempted / resumed requests go back to the allocator;
2. the sequences the scheduler ordered compressed (``StepCompression.orders``:
   pages to evict, context length, the request's resolved budget and policy) are
   compressed: block-eviction schedule over their metrics, MoveCache, trailing
   pages freed;
3. every scheduled request's heads grow by its scheduled tokens (pages come from
   the free-page stack, batched over requests x layers x heads);
4. the plan (tables, lengths, write slots, positions, which queries add to the
   eviction metrics) is published for the attention backend;
5. the step's output carries a ``WorkerReport``: the per-head lengths of the
   compressed sequences and the worker's page counts, which the scheduler
   adopts and cross-checks before it schedules again.

The worker keeps its live requests in one ``WorkerRequests`` (``worker_requests.py``);
how a request is compressed arrives resolved from the scheduler
(``StepCompression.admitted``).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvcompress.config import KVCompressConfig
from kvcompress.contract import (
    CompressionOrder,
    CompressionRecord,
    PrefixCacheStep,
    WorkerReport,
)
from kvcompress.ops import PerHeadPagedCache
from kvcompress.ops import cpu_attention
from kvcompress.ops.cpu_decode_plan import DecodeBatchPlan
from kvcompress.ops.deferred_metrics import DeferredDecodeQueries, StepDecodeQueries
from kvcompress.ops.expected_attention import RopeFrequencies, rope_frequencies
from kvcompress.ops.flattened import flat_query_starts
from kvcompress.ops.prefix_groups import PrefixGroups
from kvcompress.ops.word_spans import WordEdges, span_starts
from kvcompress.vllm_glue.step import (
    MetricQueries,
    PromptMetricRows,
    PerHeadStep,
    StepTables,
    current_step,
    get_worker_state,
    set_current_step,
    set_worker_state,
)
from kvcompress.vllm_glue.kv_layout import (
    single_full_attention_group,
)
from kvcompress.vllm_glue import diagnostics
from kvcompress.worker_compression import CompressionRun, WorkerStats, run_orders
from kvcompress.batch_rows import BatchRows
from kvcompress.worker_requests import WorkerRequests
from kvcompress.vllm_glue.pool_builder import BuiltPool, build_pool
from kvcompress.vllm_glue.reconstruction import PendingReconstruction, ReconstructionPass
from kvcompress.vllm_glue.surprisal import SurprisalRows, SurprisalScoring
from kvcompress.vllm_glue.tokenizer_checks import word_edges
from kvcompress.vllm_glue.warm_up import mixed_warm_up_due, warm_up_mixed_steps
from kvcompress.vllm_glue.outputs import step_compression_of, with_report

logger = init_logger(f"vllm.{__name__}")


def model_rope(model) -> RopeFrequencies | None:
    """The model's RoPE frequencies and pairing, read from its first vLLM rotary
    embedding (``cos_sin_cache``, ``rotary_dim``, ``is_neox_style``), for the ``kvc-ea``
    policy's estimate; None (with a warning) when it has none that vLLM's base class
    describes, and ``kvc-ea`` then ranks by kvc's metrics alone."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase) and getattr(module, "cos_sin_cache", None) is not None:
            return RopeFrequencies(
                rope_frequencies(module.cos_sin_cache, module.rotary_dim), bool(module.is_neox_style),
            )
    logger.warning("kvcompress: no rotary embedding found in the model; --kv-compress-policy kvc-ea "
                   "ranks by kvc's metrics alone")
    return None


def _tp_rank() -> int:
    """This process's tensor-parallel rank (0 without a TP group)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


def _gather_reports(report: WorkerReport) -> tuple[WorkerReport, ...] | None:
    """Every TP rank's report, in rank order, on TP rank 0 (the rank whose output
    vLLM's executors read); None on the other ranks. Every rank calls it at the same
    point of the same step (their steps are the scheduler's same output)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return (report,)
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return (report,)
    gathered = [None] * group.world_size if group.rank_in_group == 0 else None
    torch.distributed.gather_object(report, gathered, dst=group.ranks[0], group=group.cpu_group)
    return tuple(gathered) if gathered is not None else None


class PerHeadRunnerMixin:
    """Adds the per-(layer, KV head) page pool to a vLLM V1 model runner."""

    kvc_cache: PerHeadPagedCache | None = None
    # Set by a step with prompt rows whose decode rows add to the metrics (vLLM's CPU kernel).
    kvc_step_decode_queries: StepDecodeQueries | None = None

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig, *args, **kwargs) -> None:
        # vLLM's CUDA-graph memory profiling builds a minimal KV cache first
        # (is_profiling=True), then the real one: the previous pool's tables go before
        # the next buffer is allocated, not after (two table sets alive at once).
        self._kvc_drop_pool()
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self._kvc_build_pool(self.kv_cache_config)

    def _kvc_drop_pool(self) -> None:
        """Forget the pool: every reference to its cache and to views of the KV buffer."""
        set_current_step(None)
        set_worker_state(None)
        self.kvc_cache = None
        self.kvc_prefix_groups = None  # holds the cache
        self.kvc_decode_plan = None  # holds the pool's views (vLLM's CPU kernel)

    def _cleanup_profiling_kv_cache(self) -> None:
        # vLLM drops its references to the CUDA-graph profiling KV buffer here and empties
        # the allocator's cache: the pool's views of that buffer and its tables must go
        # too, or they stay allocated until the real KV cache replaces them.
        self._kvc_drop_pool()
        super()._cleanup_profiling_kv_cache()

    def _kvc_build_pool(self, kv_cache_config: KVCacheConfig) -> None:
        self.kvc_settings = KVCompressConfig.from_additional_config(self.vllm_config.additional_config)
        # Decode queries of one batch share one kernel call: the server policy's power.
        self.kvc_decode_metric_power = self.kvc_settings.policy_for().metric.power
        built = build_pool(
            self.kv_caches[0], kv_cache_config, self.vllm_config, metric_power=self.kvc_decode_metric_power,
            # get_model(): the model itself, not a CUDA-graph wrapper forwarding to it.
            rope=model_rope(self.get_model()),
        )
        cache, state = built.cache, built.state
        self.kvc_cache = cache
        set_worker_state(state)
        self._kvc_reset_requests(cache)
        # Page groups of the blocks vLLM's prefix cache holds (None: prefix caching off).
        self.kvc_prefix_groups = PrefixGroups(cache) if self.vllm_config.cache_config.enable_prefix_caching else None
        self.kvc_prefix_step: PrefixCacheStep | None = None
        # Hit requests of this step: (sequence slot, hit block ids), filled after appends.
        self.kvc_prefix_fills: list[tuple[int, tuple[int, ...]]] = []
        # This worker's TP rank: it frees the pages the scheduler credited to its pool.
        self.kvc_tp_rank = _tp_rank()
        self.kvc_tp_size = self.vllm_config.parallel_config.tensor_parallel_size
        self.kvc_stats = WorkerStats()
        self.kvc_generator: torch.Generator | None = None
        self._kvc_init_scoring(built.shape.layer_names)
        self._kvc_init_cpu_kernel_plans(built)
        logger.info(
            "kvcompress: %d pages of %d tokens x 1 (layer, KV head) "
            "(%d layers x %d KV heads, %d bytes per page); kernels: %s",
            cache.num_pages, cache.block_size, cache.num_layers, cache.num_kv_heads, built.shape.page_bytes,
            state.ops,
        )
        if mixed_warm_up_due(state.ops, self.vllm_config):
            self._kvc_warm_up_mixed_steps()

    def _kvc_reset_requests(self, cache: PerHeadPagedCache) -> None:
        """No live request: the per-request and per-slot state of a new pool."""
        self.kvc_requests = WorkerRequests(cache.max_seqs, cache.device)
        self.kvc_report: WorkerReport | None = None

    def _kvc_init_scoring(self, layer_names) -> None:
        """The scoring passes some policies add to a step (word pooling, kvzip's
        reconstruction, surprisal) and the tests' recorder."""
        # The vocabulary's word edges (False: no tokenizer, pooling over tokens only; None:
        # not loaded yet). Loaded now when the server's policy pools over words (~0.3 s
        # for 49K ids), else at the first request whose policy does.
        self.kvc_word_edges: WordEdges | bool | None = None
        if self.kvc_settings.policy_for().metric.pool_words:
            self.kvc_word_edges = word_edges(self.vllm_config.model_config) or False
        # Requests whose prompt finishes prefilling this step and whose policy scores
        # KVs by a reconstruction pass (kvzip): run after the step's forward.
        self.kvc_reconstruction = ReconstructionPass(self, list(layer_names))
        self.kvc_reconstructions: list[PendingReconstruction] = []
        # Prompt positions of surprisal-scored requests in this step: scored from the
        # forward's hidden states after it.
        self.kvc_surprisal = SurprisalScoring(self)
        # request id -> a compression's inputs, while tests record them (None: off).
        self.kvc_recorded: dict[str, dict] | None = None

    def _kvc_init_cpu_kernel_plans(self, built: BuiltPool) -> None:
        """Decode steps on vLLM's CPU kernel: their tables in its terms once per step, the
        plan kept while the same rows decode, and the queue their metric queries wait in."""
        state = built.state
        self.kvc_num_q_heads = self.vllm_config.model_config.get_num_attention_heads(
            self.vllm_config.parallel_config
        )
        self.kvc_plan_kernel_decode = state.ops.kernel_page_layout and cpu_attention.supports_pool(
            built.shape.dtype, state.pool
        )
        # Their metric queries wait per sequence to be scored several at once.
        self.kvc_deferred_metrics = DeferredDecodeQueries() if self.kvc_plan_kernel_decode else None
        # A step with prompt rows: its decode rows' metric queries, for that queue after the forward.
        self.kvc_step_decode_queries = None
        self.kvc_decode_plan: DecodeBatchPlan | None = None
        if self.kvc_plan_kernel_decode and built.cache.host is not None:
            self.kvc_decode_plan = DecodeBatchPlan(built.cache, state.pool, self.kvc_num_q_heads)
        # num_reqs -> (ones, arange(num_reqs + 1), its list): a one-token step's shape.
        self.kvc_one_token_shapes: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}

    def _kvc_warm_up_mixed_steps(self) -> int:
        """Compile the kernels of steps with prompt rows now, before vLLM arms its JIT
        monitor (``warm_up.py``); the pool is not touched. Returns the steps run."""
        started = time.perf_counter()
        spec = single_full_attention_group(self.kv_cache_config).kv_cache_spec
        steps = warm_up_mixed_steps(
            get_worker_state(), self.kvc_num_q_heads, spec.head_size, spec.dtype, self.kvc_decode_metric_power,
        )
        logger.info("kvcompress: warmed up %d steps with prompt rows in %.2f s",
                    steps, time.perf_counter() - started)
        return steps

    def _kvc_release(self, request_ids) -> None:
        gone, slots = self.kvc_requests.release(request_ids)
        for request_id in gone:
            self.kvc_surprisal.release(request_id)
        if slots:
            self.kvc_cache.release(torch.tensor(slots, dtype=torch.int64))
            if self.kvc_deferred_metrics is not None:
                self.kvc_deferred_metrics.drop(slots)

    def _update_states(self, scheduler_output):
        set_current_step(None)
        self.kvc_step_decode_queries = None
        if self.kvc_cache is not None:
            step = step_compression_of(scheduler_output)
            # Frees first: the scheduler may have handed these pages to new work.
            gone = set(scheduler_output.finished_req_ids)
            gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
            self._kvc_release(gone)
            prefix_step = self.kvc_prefix_step = step.prefix_cache
            if prefix_step is not None:
                # Before this step's cached blocks: vLLM may reuse an evicted block id.
                self.kvc_prefix_groups.drop(prefix_step.uncached)
            for request_id, compression in step.admitted.items():
                hits = () if prefix_step is None else prefix_step.hits.get(request_id, ())
                self.kvc_requests.admit(request_id, compression, hits)
            if gone or step.admitted:
                self.kvc_requests.drop_rows()  # slots changed hands
            self.kvc_report = None
            self._kvc_step_started = time.perf_counter()
            compressed = self._kvc_compress(step.orders)
        result = super()._update_states(scheduler_output)
        if self.kvc_cache is not None:
            if scheduler_output.total_num_scheduled_tokens:
                self._kvc_plan_step(scheduler_output)
            self.kvc_report = self._kvc_make_report(compressed, step.report_pages_held)
        return result

    def _kvc_compress(self, orders: dict[str, CompressionOrder]) -> list[str]:
        """Compress the sequences the scheduler ordered (``worker_compression.py``);
        returns their request ids. The step's report carries the records."""
        slots = self.kvc_requests.placed(orders) if orders else {}
        # This step's part of the report (metrics): one record per batched compression.
        self.kvc_step_compressions: list[CompressionRecord] = []
        self.kvc_step_evict_mismatches = 0
        if not slots:
            return []
        run = CompressionRun(
            cache=self.kvc_cache, pool=get_worker_state().pool, ops=get_worker_state().ops, rank=self.kvc_tp_rank,
            block_cost=self.kvc_settings.block_cost, generator=self._kvc_random,
            flush=self._kvc_flush_deferred_metrics,
            record=None if self.kvc_recorded is None else functools.partial(diagnostics.record_inputs, self),
        )
        outcome = run_orders(run, orders, slots, self.kvc_stats)
        self.kvc_step_compressions = outcome.records
        self.kvc_step_evict_mismatches = int(outcome.mismatch)
        if outcome.mismatch:
            # The scheduler credited the pages it ordered; the report corrects it.
            logger.error("kvcompress: scheduler ordered %d pages evicted, the schedule freed %d",
                         outcome.pages_ordered, outcome.pages_freed)
        return outcome.request_ids

    def _kvc_flush_deferred_metrics(self, slots: list[int]) -> None:
        """Score the decode queries still pending for ``slots`` (before their metrics
        are read or their KVs evicted)."""
        deferred = self.kvc_deferred_metrics
        slots = [slot for slot in slots if deferred is not None and slot in deferred]
        if not slots:
            return
        cache = self.kvc_cache
        rows = np.asarray(slots, dtype=np.int64)
        tables, lens = cpu_attention.decode_tables(cache.block_size, cache.tables, rows, cache.host.head_lens[rows])
        num_layers = tables.shape[0]
        deferred.flush(
            get_worker_state().pool, slots,
            torch.from_numpy(tables).view(num_layers, len(slots), lens.shape[2], -1), torch.from_numpy(lens),
        )

    def _kvc_random(self) -> torch.Generator:
        """The random policy's generator, seeded once from the model's seed."""
        if self.kvc_generator is None:
            self.kvc_generator = torch.Generator(device=self.kvc_cache.device)
            self.kvc_generator.manual_seed(self.vllm_config.model_config.seed or 0)
        return self.kvc_generator

    def _kvc_make_report(self, compressed: list[str], with_pages_held: bool) -> WorkerReport:
        """Worker-side truth for the scheduler after this step's appends (every live
        request's pages only when the scheduler asked for them)."""
        cache = self.kvc_cache
        live = self.kvc_requests.live_slots
        held = None
        if with_pages_held and live:
            slots = list(live.values())
            pages = np.asarray(cache.pages_held_per_sequence(slots), np.int64)
            # Pages of prefix-cache groups are the cache's, not the request's.
            pages -= self.kvc_requests.shared_pages[slots] * cache.num_layers * cache.num_kv_heads
            held = dict(zip(live, pages.tolist()))
        elif with_pages_held:
            held = {}
        report = WorkerReport(
            free_pages=cache.allocator.num_free,
            pages_held=held,
            compressions=self.kvc_step_compressions,
            evict_mismatches=self.kvc_step_evict_mismatches,
        )
        if live:
            for request_id in compressed:
                if request_id in live:
                    report.head_lens[request_id] = cache.head_lens[live[request_id]].cpu().numpy().copy()
        stats = self.kvc_stats
        stats.max_pages_used = max(stats.max_pages_used, cache.allocator.num_used)
        return report

    def _kvc_attach_report(self, output):
        if self.kvc_cache is None or self.kvc_report is None or output is None:
            return output
        if not hasattr(output, "req_ids"):
            return output  # async wrappers do not occur: kvcompress turns async scheduling off
        # One rank: its report is the step's (no gather, no group lookups every step).
        reports = (self.kvc_report,) if self.kvc_tp_size == 1 else _gather_reports(self.kvc_report)
        self.kvc_report = None
        if reports is not None:  # this rank's output is the one vLLM reads
            output = with_report(output, reports)
        self.kvc_stats.step_seconds += time.perf_counter() - self._kvc_step_started
        return output

    def execute_model(self, *args, **kwargs):
        output = super().execute_model(*args, **kwargs)
        if self.kvc_step_decode_queries is not None:
            self._kvc_queue_step_decode_queries()
        if self.kvc_cache is not None and self.kvc_reconstructions:
            pending, self.kvc_reconstructions = self.kvc_reconstructions, []
            self.kvc_reconstruction.run(pending)
        if self.kvc_cache is not None and self.kvc_surprisal.pending:
            executed = self.execute_model_state
            if executed is None:  # nothing ran (vLLM returned early): nothing to score
                self.kvc_surprisal.pending.clear()
            else:
                self.kvc_surprisal.run(executed.hidden_states)
        return self._kvc_attach_report(output)

    def _kvc_queue_step_decode_queries(self) -> None:
        """A step with prompt rows ran: its decode rows' metric queries join the queue;
        if one of them is due, every row of the batch with pending queries is scored
        (as a decode step does, :class:`~kvcompress.ops.cpu_attention.DecodeStepMetrics`)."""
        recorded, self.kvc_step_decode_queries = self.kvc_step_decode_queries, None
        if not recorded.complete or self.kvc_deferred_metrics is None:
            return  # no forward ran (nothing written, nothing to score)
        if recorded.hand_to(self.kvc_deferred_metrics, self.kvc_decode_metric_power).size:
            self._kvc_flush_deferred_metrics(self.kvc_requests.rows.slots.tolist())

    def sample_tokens(self, *args, **kwargs):
        return self._kvc_attach_report(super().sample_tokens(*args, **kwargs))

    def _kvc_plan_step(self, scheduler_output) -> None:
        cache = self.kvc_cache
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        device = cache.device
        if scheduler_output.total_num_scheduled_tokens == num_reqs:
            # One token per row (every row of the batch is scheduled): a decode step's
            # shape, read without a dict lookup per row; each token sits at `computed`.
            num_new, query_start, query_start_list = self._kvc_one_token_shape(num_reqs)
            rows = self.kvc_requests.batch_rows(req_ids, computed, num_new, self._kvc_slot_for)
            positions_t = torch.from_numpy(computed).to(device)
            if self.kvc_decode_plan is not None and not self.kvc_prefix_fills and rows.past_prompts(computed):
                self._kvc_decode_on_kernel(rows, computed, positions_t, query_start_list)
                return
            plan = cache.append_one(rows.seq_slots, positions_t, host_slots=rows.slots)
        else:
            scheduled = scheduler_output.num_scheduled_tokens
            num_new = np.fromiter((scheduled[r] for r in req_ids), np.int64, num_reqs)
            rows = self.kvc_requests.batch_rows(req_ids, computed, num_new, self._kvc_slot_for)
            query_start = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(num_new, out=query_start[1:])
            positions = np.repeat(computed - query_start[:-1], num_new) + np.arange(query_start[-1])
            positions_t = torch.from_numpy(positions).to(device)
            plan = cache.append(rows.seq_slots, torch.from_numpy(num_new).to(device), positions_t)
        if self.kvc_prefix_step is not None:
            self._kvc_apply_prefix_cache(self.kvc_prefix_step)
        seq_slots = rows.seq_slots
        if rows.decode_only(computed, num_new):
            self._kvc_plan_decode_step(rows, computed, positions_t, plan, query_start)
            return
        tables, max_head_len = StepTables.for_rows(cache, seq_slots, computed + num_new)
        query_start_list = query_start.tolist()
        set_current_step(
            PerHeadStep(
                num_reqs=num_reqs,
                num_tokens=int(query_start[-1]),
                query_start_loc=query_start_list,
                query_positions=positions_t,
                tables=tables,
                head_lens=cache.head_lens[seq_slots],
                max_head_len=max_head_len,
                plan=plan,
                metrics=self._kvc_metric_queries(req_ids, computed, num_new, query_start, rows.slots),
                flat_query_start_loc=torch.from_numpy(
                    flat_query_starts(query_start_list, cache.num_kv_heads)).to(device),
            )
        )

    def _kvc_one_token_shape(self, num_reqs: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``(num_new, query_start, query_start as a list)`` of ``num_reqs`` rows of one
        token each (kept per size: read, never written)."""
        shape = self.kvc_one_token_shapes.get(num_reqs)
        if shape is None:
            query_start = np.arange(num_reqs + 1, dtype=np.int64)
            shape = (np.ones(num_reqs, np.int64), query_start, query_start.tolist())
            if len(self.kvc_one_token_shapes) >= 64:
                self.kvc_one_token_shapes.clear()
            self.kvc_one_token_shapes[num_reqs] = shape
        return shape

    def _kvc_decode_on_kernel(self, rows: BatchRows, computed: np.ndarray, positions_t, query_start: list[int]) -> None:
        """A decode-only step on vLLM's CPU kernel: the batch's plan, kept between steps,
        takes each head's new KV and gives every layer's kernel arrays
        (:class:`~kvcompress.ops.cpu_decode_plan.DecodeBatchPlan`)."""
        flagged = rows.metric_rows(computed, self.kvc_settings.decode_metric_stride)
        plan, kernel_decode = self.kvc_decode_plan.step(
            rows, rows.slots, computed, torch.from_numpy(flagged) if flagged.size else None,
            # Heads of never-compressed rows all hold the row's tokens.
            uniform=True if not rows.any_compresses else None,
        )
        self._kvc_defer_metrics(kernel_decode, rows, computed, flagged)
        if self.kvc_prefix_step is not None:
            self._kvc_apply_prefix_cache(self.kvc_prefix_step)
        self._kvc_publish_decode_step(rows, positions_t, plan, query_start, kernel_decode)

    def _kvc_defer_metrics(self, kernel_decode, rows: BatchRows, computed: np.ndarray, flagged: np.ndarray) -> None:
        """The step's metric queries go to the per-sequence queue (scored a few at once)."""
        metrics = kernel_decode[0].metrics if kernel_decode else None
        if metrics is not None and self.kvc_deferred_metrics is not None:
            metrics.defer(self.kvc_deferred_metrics, rows.slots, computed[flagged])

    def _kvc_apply_prefix_cache(self, step: PrefixCacheStep) -> None:
        """After this step's appends: the cache takes the blocks vLLM cached (their
        pages exist now), then this step's hits point at their groups (one may be a
        group just taken)."""
        groups, requests = self.kvc_prefix_groups, self.kvc_requests
        shared = requests.shared_pages
        for record in step.cached:
            slot = requests[record.request_id].seq_slot
            groups.register(slot, record.first_column, list(record.block_ids))
            shared[slot] = max(shared[slot], record.first_column + len(record.block_ids))
        for slot, hits in self.kvc_prefix_fills:
            self.kvc_cache.fill_prefix(slot, groups.pages_of(list(hits)))
        self.kvc_prefix_fills = []
        self.kvc_prefix_step = None

    def _kvc_slot_for(self, request_id: str, computed: int) -> int:
        """The request's sequence slot (a new, empty one at its first step)."""
        request = self.kvc_requests.get(request_id)
        if request is None:
            raise RuntimeError(
                f"kvcompress: request {request_id} was scheduled but the scheduler never "
                "sent how it is compressed (StepCompression.admitted)"
            )
        if request.seq_slot is None:
            hit_tokens = len(request.prefix_hits) * self.kvc_cache.block_size
            if computed != hit_tokens:
                raise RuntimeError(
                    f"kvcompress: request {request_id} starts with {computed} computed "
                    f"tokens but {hit_tokens} tokens of prefix-cache hits"
                )
            slot = self.kvc_cache.new_sequence()
            if request.prefix_hits:
                # Reserved now (appends go after them), filled after the appends.
                self.kvc_cache.reserve_prefix(slot, len(request.prefix_hits))
                self.kvc_prefix_fills.append((slot, request.prefix_hits))
            self.kvc_requests.place(request_id, slot, computed, self.requests[request_id].num_prompt_tokens)
        return request.seq_slot

    def _kvc_plan_decode_step(self, rows: BatchRows, computed, positions_t, plan, query_start) -> None:
        """Publish a decode-only step: on vLLM's CPU kernel with every layer's kernel
        tables built once (a step the kept plan does not serve); otherwise through the
        fixed-address ``DecodeBuffers`` (CUDA graphs replay them)."""
        flagged = rows.metric_rows(computed, self.kvc_settings.decode_metric_stride)
        kernel_decode = None
        if self.kvc_plan_kernel_decode:
            cache = self.kvc_cache
            kernel_decode = cpu_attention.plan_decode_step(
                get_worker_state().pool, cache.tables, cache.head_lens, rows.seq_slots, self.kvc_num_q_heads,
                torch.from_numpy(flagged) if flagged.size else None,
                uniform=True if not rows.any_compresses else None,
            )
            self._kvc_defer_metrics(kernel_decode, rows, computed, flagged)
        else:
            self._kvc_fill_decode_buffers(get_worker_state().decode_buffers, rows.seq_slots, positions_t, plan, flagged)
        self._kvc_publish_decode_step(rows, positions_t, plan, query_start.tolist(), kernel_decode)

    def _kvc_publish_decode_step(self, rows: BatchRows, positions_t, plan, query_start: list[int], kernel_decode) -> None:
        self.kvc_stats.decode_only_steps += 1
        num_rows = len(rows.req_ids)
        set_current_step(
            PerHeadStep(
                num_reqs=num_rows,
                num_tokens=num_rows,
                query_start_loc=query_start,
                query_positions=positions_t,
                tables=None,
                head_lens=None,
                max_head_len=get_worker_state().decode_buffers.max_head_len,
                plan=plan,
                decode_only=True,
                kernel_decode=kernel_decode,
                decode_metric_power=self.kvc_decode_metric_power,
            )
        )

    @staticmethod
    def _kvc_fill_decode_buffers(buffers, seq_slots, positions_t, plan, flagged: np.ndarray) -> None:
        buffers.fill(
            seq_slots.shape[0],
            seq_slots,
            positions_t,
            plan.write_pages,
            plan.write_offsets,
            seq_slots[torch.from_numpy(flagged).to(seq_slots.device)] if flagged.size else None,
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

    def _kvc_metric_queries(self, req_ids, computed, num_new, query_start, slots: np.ndarray) -> MetricQueries | None:
        """Which of this step's queries add to eviction metrics (compressing requests only).

        Prompt queries, by the request's policy: the last ``observation_window``
        prompt positions (or, in ``full`` mode, every prompt query; none for the
        position and random policies); decode queries: every ``decode_metric_stride``-th
        token past the prompt, added by the attention kernel or a metric pass of its own,
        or (vLLM's CPU kernel) recorded for the runner's queue of decode queries
        (``kvc_step_decode_queries``).
        A request whose policy reconstructs and whose prompt completes in this step is
        queued in ``kvc_reconstructions`` instead (scored after the step's forward).
        """
        settings = self.kvc_settings
        if not settings.compresses and not self.kvc_requests.any_compresses():
            return None
        prompt_rows = []
        decode_seqs = np.zeros(len(req_ids), dtype=bool)
        for index, request_id in enumerate(req_ids):
            if not self.kvc_requests.request_compresses(request_id):
                continue
            prompt_len = self.requests[request_id].num_prompt_tokens
            first, count = int(computed[index]), int(num_new[index])
            if first >= prompt_len:
                decode_seqs[index] = count == 1 and self._kvc_decode_metric_due(first)
                continue
            compression = self.kvc_requests[request_id].compression
            spec = compression.policy.metric
            if spec.reconstructs and first + count >= prompt_len:
                pending = self._kvc_pending_reconstruction(request_id, first + count, spec)
                if pending is not None:
                    self.kvc_reconstructions.append(pending)
            if spec.scores_surprisal:
                self._kvc_queue_surprisal(request_id, first, min(count, prompt_len - first), int(query_start[index]))
            if not spec.scores_prompt:
                continue  # position / random / reconstruction / surprisal policies: no prompt queries
            scoring_from = 0 if spec.queries == "full" else prompt_len - spec.observation_window
            lo = max(first, scoring_from)
            hi = min(first + count, prompt_len)
            if hi > lo:
                start = int(query_start[index]) - first
                done = hi == prompt_len
                words = self._kvc_word_starts(request_id) if done and spec.pool_words else None
                prompt_rows.append(PromptMetricRows(
                    index, start + lo, start + hi, done, spec, words,
                    protected_prefix=compression.budget.protected_prefix,
                    protected_window=compression.budget.protected_window,
                    end_position=hi,
                ))
        any_decode = bool(decode_seqs.any())
        if not prompt_rows and not any_decode:
            return None
        decode_queries = None
        if any_decode and self.kvc_deferred_metrics is not None:
            metric_rows = np.flatnonzero(decode_seqs)
            decode_queries = self.kvc_step_decode_queries = StepDecodeQueries(
                torch.from_numpy(query_start[metric_rows].astype(np.int64)), slots[metric_rows],
                computed[metric_rows], self.kvc_cache.num_layers,
            )
        pass_rows = any_decode and decode_queries is None
        return MetricQueries(
            prompt_rows=prompt_rows,
            decode_seqs=torch.from_numpy(decode_seqs).to(self.kvc_cache.device) if pass_rows else None,
            power=self.kvc_decode_metric_power,
            prompt_weight=1.0 / settings.decode_metric_stride,
            decode_queries=decode_queries,
            # The metric pass of a mixed step launches for these rows only.
            decode_seq_ids=np.flatnonzero(decode_seqs) if pass_rows else None,
        )

    def _kvc_queue_surprisal(self, request_id: str, first: int, count: int, row_start: int) -> None:
        """Score this step's prompt positions of a surprisal request after the forward
        (prompt embeddings have no next tokens to score: a warning, decode metrics only)."""
        token_ids = self.requests[request_id].prompt_token_ids
        if token_ids is None:
            if first == 0:
                logger.warning(
                    "kvcompress: request %s has prompt embeddings, which policy 'surprisal' cannot "
                    "score: its KVs are ranked by decode metrics only", request_id,
                )
            return
        seq_slot = self.kvc_requests[request_id].seq_slot
        self.kvc_surprisal.pending.append(SurprisalRows(request_id, seq_slot, token_ids, first, count, row_start))

    def _kvc_pending_reconstruction(self, request_id: str, num_cached: int, spec) -> PendingReconstruction | None:
        """The reconstruction of a request holding ``num_cached`` tokens' KVs after
        this step (its prompt, and its outputs when it resumes after a preemption);
        None, with a warning, for prompt embeddings (no tokens to repeat: its KVs
        keep the decode metrics only)."""
        state = self.requests[request_id]
        context = [*(state.prompt_token_ids or ()), *state.output_token_ids][:num_cached]
        if len(context) < num_cached:
            logger.warning(
                "kvcompress: request %s has prompt embeddings, which the kvzip reconstruction "
                "pass cannot repeat: its KVs are ranked without reconstruction scores", request_id,
            )
            return None
        words = self._kvc_word_starts(request_id) if spec.pool_words else None
        return PendingReconstruction(request_id, self.kvc_requests[request_id].seq_slot, context, spec, words)

    def _kvc_word_starts(self, request_id: str) -> torch.Tensor | None:
        """``[prompt_len]`` first position of each prompt token's word span (None
        without a tokenizer or token ids, e.g. prompt embeddings: token pooling only)."""
        if self.kvc_word_edges is None:
            self.kvc_word_edges = word_edges(self.vllm_config.model_config) or False
        token_ids = self.requests[request_id].prompt_token_ids
        if not self.kvc_word_edges or token_ids is None:
            return None
        starts = span_starts(token_ids, self.kvc_word_edges)
        return torch.from_numpy(starts).to(self.kvc_cache.device)

    def _kvc_decode_metric_due(self, position: int) -> bool:
        """Whether the decode query at ``position`` adds to the metrics
        (``decode_metric_stride``: every N-th token of a sequence)."""
        return position % self.kvc_settings.decode_metric_stride == 0

    def _dummy_run(self, *args, **kwargs):
        # Warm-up, profiling and graph-capture batches must not touch the pages of
        # real requests: no plan, and decode buffers holding only padding rows.
        set_current_step(None)
        state = get_worker_state()
        if self.kvc_cache is not None and state is not None and state.decode_buffers is not None:
            state.decode_buffers.fill(0)
        return super()._dummy_run(*args, **kwargs)
