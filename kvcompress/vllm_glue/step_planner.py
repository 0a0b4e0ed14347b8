"""Plans each step of the per-head runner: grows every scheduled request's heads by its
scheduled tokens, fills this step's prefix-cache hits, and publishes the step the
attention backend reads (``step.set_current_step``).

Three paths: a decode-only step on vLLM's CPU kernel (the batch's plan kept between
steps, ``DecodeBatchPlan``), another decode-only step (the fixed-address
``DecodeBuffers`` a CUDA graph replays), and a step with prompt rows (the rows' tables
gathered, its metric queries chosen by ``metric_queries.py``). The decode metrics'
owner (``ops/decode_metrics.DecodeMetrics``) gets each step's decode queries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcompress.config import KVCompressConfig
from kvcompress.contract import PrefixCacheStep, StepCompression
from kvcompress.batch_rows import BatchRows
from kvcompress.ops import PerHeadPagedCache
from kvcompress.ops import cpu_attention
from kvcompress.ops.cpu_decode_plan import DecodeBatchPlan
from kvcompress.ops.decode_metrics import DecodeMetrics, DeferredDecodeQueries
from kvcompress.ops.flattened import flat_query_starts
from kvcompress.ops.prefix_groups import PrefixGroups
from kvcompress.vllm_glue.metric_queries import MetricQuerySelector
from kvcompress.vllm_glue.step import PerHeadStep, StepTables, WorkerCacheState, set_current_step
from kvcompress.worker_compression import WorkerStats
from kvcompress.worker_requests import WorkerRequests

# One-token batch shapes kept at most (one per batch size seen).
_MAX_ONE_TOKEN_SHAPES = 64


@dataclass
class StepPlanner:
    """The step plans of one page pool.

    ``state``: the worker's pool (``cache`` is ``state.cache``); ``query_dtype``: the
    model's (its queries'; FP8 pages hold another); ``requests``: its live requests; ``stats``: the
    worker's counters (decode-only steps); ``num_q_heads``: query heads of this rank
    (vLLM's CPU kernel's plan); ``prefix_groups``: the page groups of vLLM's cached
    blocks (None: prefix caching off); ``metric_queries``: chooses the metric queries of
    steps with prompt rows.

    On vLLM's CPU kernel (``plan_kernel_decode``) decode steps get their tables in its
    terms once per step, the plan kept while the same rows decode (``decode_plan``), and
    their metric queries wait per sequence in ``decode_metrics.queue`` to be scored
    several at once (``diagnostics.defer_decode_metrics`` may swap it)."""

    state: WorkerCacheState
    query_dtype: torch.dtype
    requests: WorkerRequests
    settings: KVCompressConfig
    stats: WorkerStats
    num_q_heads: int
    prefix_groups: PrefixGroups | None
    metric_queries: MetricQuerySelector
    # The model has sliding-window layers, whose heads drop their pages behind the
    # window: a never-compressed row's heads then differ between layers.
    window_layers: bool = False
    plan_kernel_decode: bool = field(init=False)
    decode_metrics: DecodeMetrics = field(init=False)
    decode_plan: DecodeBatchPlan | None = field(init=False, default=None)
    prefix_step: PrefixCacheStep | None = field(init=False, default=None)
    # Hit requests of this step: (sequence slot, hit block ids), filled after appends.
    prefix_fills: list[tuple[int, tuple[int, ...]]] = field(init=False, default_factory=list)
    # num_reqs -> (ones, arange(num_reqs + 1), its list): a one-token step's shape.
    one_token_shapes: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = field(init=False, default_factory=dict)
    # The step published last (None: none, or a dummy run's).
    current: PerHeadStep | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        state = self.state
        self.plan_kernel_decode = bool(state.ops.kernel_page_layout) and cpu_attention.supports_pool(
            self.query_dtype, state.pool)
        self.decode_metrics = DecodeMetrics(
            self.cache, state.pool, self.metric_power,
            DeferredDecodeQueries() if self.plan_kernel_decode else None,
        )
        if self.plan_kernel_decode and self.cache.host is not None:
            self.decode_plan = DecodeBatchPlan(self.cache, state.pool, self.num_q_heads, self.query_dtype)

    @property
    def cache(self) -> PerHeadPagedCache:
        return self.state.cache

    @property
    def metric_power(self) -> int:
        """The server policy's decode metric power (1 or 2)."""
        return self.metric_queries.metric_power

    def publish(self, step: PerHeadStep | None) -> None:
        """The step the attention backend reads from now on."""
        self.current = step
        set_current_step(step)

    def release(self, request_ids) -> list[str]:
        """Forget the live ones of ``request_ids``, their slots' pages and pending decode
        queries; returns their ids."""
        gone, slots = self.requests.release(request_ids)
        if slots:
            self.cache.release(torch.tensor(slots, dtype=torch.int64))
            self.decode_metrics.drop(slots)
        return gone

    def admit(self, step: StepCompression, slots_changed: bool) -> None:
        """The scheduler's new requests and prefix-cache changes of this step (before
        vLLM updates its batch); ``slots_changed``: requests left, so the batch's rows go."""
        self.decode_metrics.start_step()
        prefix_step = self.prefix_step = step.prefix_cache
        if prefix_step is not None:
            # Before this step's cached blocks: vLLM may reuse an evicted block id.
            self.prefix_groups.drop(prefix_step.uncached)
        for request_id, compression in step.admitted.items():
            hits = () if prefix_step is None else prefix_step.hits.get(request_id, ())
            self.requests.admit(request_id, compression, hits)
        if slots_changed or step.admitted:
            self.requests.drop_rows()  # slots changed hands

    def plan(self, input_batch, scheduler_output, vllm_requests) -> None:
        """Grow the scheduled rows' heads and publish the step (vLLM's ``input_batch``
        after ``_update_states``; ``vllm_requests``: its request states by id)."""
        cache = self.cache
        num_reqs = input_batch.num_reqs
        req_ids = input_batch.req_ids[:num_reqs]
        computed = input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        device = cache.device
        slot_for = functools.partial(self._slot_for, vllm_requests)  # places a request at its first step
        if scheduler_output.total_num_scheduled_tokens == num_reqs:
            # One token per row (every row of the batch is scheduled): a decode step's
            # shape, read without a dict lookup per row; each token sits at `computed`.
            num_new, query_start, query_start_list = self._one_token_shape(num_reqs)
            rows = self.requests.batch_rows(req_ids, computed, num_new, slot_for)
            positions_t = torch.from_numpy(computed).to(device)
            if self.decode_plan is not None and not self.prefix_fills and rows.past_prompts(computed):
                self._decode_on_kernel(rows, computed, positions_t, query_start_list)
                return
            plan = cache.append_one(rows.seq_slots, positions_t, host_slots=rows.slots)
        else:
            scheduled = scheduler_output.num_scheduled_tokens
            num_new = np.fromiter((scheduled[r] for r in req_ids), np.int64, num_reqs)
            rows = self.requests.batch_rows(req_ids, computed, num_new, slot_for)
            query_start = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(num_new, out=query_start[1:])
            positions = np.repeat(computed - query_start[:-1], num_new) + np.arange(query_start[-1])
            positions_t = torch.from_numpy(positions).to(device)
            self._expect_taken_blocks()
            plan = cache.append(rows.seq_slots, torch.from_numpy(num_new).to(device), positions_t)
        self._apply_prefix_cache()
        if rows.decode_only(computed, num_new):
            self._plan_decode_step(rows, computed, positions_t, plan, query_start)
            return
        self._plan_mixed_step(rows, vllm_requests, computed, num_new, positions_t, plan, query_start)

    def _plan_mixed_step(self, rows: BatchRows, vllm_requests, computed: np.ndarray, num_new: np.ndarray,
                         positions_t: torch.Tensor, plan, query_start: np.ndarray) -> None:
        """Publish a step with prompt rows: the rows' tables gathered, its metric queries."""
        cache = self.cache
        tables, max_head_len = StepTables.for_rows(cache, rows.seq_slots, computed + num_new)
        query_start_list = query_start.tolist()
        metrics = self.metric_queries.select(
            vllm_requests, rows.req_ids, computed, num_new, query_start, rows.slots,
            queue_decode=self.decode_metrics.queue is not None,
        )
        if metrics is not None and metrics.decode_queries is not None:
            self.decode_metrics.record_step(metrics.decode_queries)
        self.publish(PerHeadStep(
            num_reqs=len(rows.req_ids),
            num_tokens=int(query_start[-1]),
            query_start_loc=query_start_list,
            query_positions=positions_t,
            tables=tables,
            head_lens=cache.head_lens[rows.seq_slots],
            max_head_len=max_head_len,
            plan=plan,
            metrics=metrics,
            flat_query_start_loc=torch.from_numpy(
                flat_query_starts(query_start_list, cache.num_kv_heads)).to(cache.device),
        ))

    def _one_token_shape(self, num_reqs: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``(num_new, query_start, query_start as a list)`` of ``num_reqs`` rows of one
        token each (kept per size: read, never written)."""
        shape = self.one_token_shapes.get(num_reqs)
        if shape is None:
            query_start = np.arange(num_reqs + 1, dtype=np.int64)
            shape = (np.ones(num_reqs, np.int64), query_start, query_start.tolist())
            if len(self.one_token_shapes) >= _MAX_ONE_TOKEN_SHAPES:
                self.one_token_shapes.clear()
            self.one_token_shapes[num_reqs] = shape
        return shape

    def _uniform_heads(self, rows: BatchRows) -> bool | None:
        """True when every head of every row holds the row's tokens (never-compressed
        rows of a model without sliding windows): one kernel work split serves every
        layer; None: the plan compares the layers' lengths."""
        return True if not (rows.any_compresses or self.window_layers) else None

    def _decode_on_kernel(self, rows: BatchRows, computed: np.ndarray, positions_t, query_start: list[int]) -> None:
        """A decode-only step on vLLM's CPU kernel: the batch's plan, kept between steps,
        takes each head's new KV and gives every layer's kernel arrays
        (:class:`~kvcompress.ops.cpu_decode_plan.DecodeBatchPlan`)."""
        flagged = rows.metric_rows(computed, self.settings.decode_metric_stride)
        plan, kernel_decode = self.decode_plan.step(
            rows, rows.slots, computed, torch.from_numpy(flagged) if flagged.size else None,
            uniform=self._uniform_heads(rows),
        )
        self._record_kernel_metrics(kernel_decode, rows, computed, flagged)
        self._apply_prefix_cache()
        self._publish_decode_step(rows, positions_t, plan, query_start, kernel_decode)

    def _record_kernel_metrics(self, kernel_decode, rows: BatchRows, computed: np.ndarray,
                               flagged: np.ndarray) -> None:
        """The step's metric queries go to the per-sequence queue (scored a few at once)."""
        step_metrics = kernel_decode[0].metrics if kernel_decode else None
        self.decode_metrics.record_kernel_step(step_metrics, rows.slots, computed[flagged])

    def _expect_taken_blocks(self) -> None:
        """Before this step's appends: the blocks the prefix cache takes after them read
        identity rows from the start (their pages never take metadata rows)."""
        step = self.prefix_step
        if step is None:
            return
        for record in step.cached:
            slot = self.requests[record.request_id].seq_slot
            if slot is not None:
                self.cache.expect_identity_columns(slot, record.first_column + len(record.block_ids))

    def _apply_prefix_cache(self) -> None:
        """After this step's appends: the cache takes the blocks vLLM cached (their
        pages exist now), then this step's hits point at their groups (one may be a
        group just taken)."""
        step = self.prefix_step
        if step is None:
            return
        groups, requests = self.prefix_groups, self.requests
        shared = requests.shared_pages
        for record in step.cached:
            slot = requests[record.request_id].seq_slot
            groups.register(slot, record.first_column, list(record.block_ids))
            shared[slot] = max(shared[slot], record.first_column + len(record.block_ids))
        for slot, hits in self.prefix_fills:
            self.cache.fill_prefix(slot, groups.pages_of(list(hits)))
        self.prefix_fills = []
        self.prefix_step = None

    def _slot_for(self, vllm_requests, request_id: str, computed: int) -> int:
        """The request's sequence slot (a new, empty one at its first step)."""
        request = self.requests.get(request_id)
        if request is None:
            raise RuntimeError(
                f"kvcompress: request {request_id} was scheduled but the scheduler never "
                "sent how it is compressed (StepCompression.admitted)"
            )
        if request.seq_slot is None:
            hit_tokens = len(request.prefix_hits) * self.cache.block_size
            if computed != hit_tokens:
                raise RuntimeError(
                    f"kvcompress: request {request_id} starts with {computed} computed "
                    f"tokens but {hit_tokens} tokens of prefix-cache hits"
                )
            slot = self.cache.new_sequence(compresses=request.compression.compresses)
            if request.prefix_hits:
                # Reserved now (appends go after them), filled after the appends.
                self.cache.reserve_prefix(slot, len(request.prefix_hits))
                self.prefix_fills.append((slot, request.prefix_hits))
            self.requests.place(request_id, slot, computed, vllm_requests[request_id].num_prompt_tokens)
        return request.seq_slot

    def _plan_decode_step(self, rows: BatchRows, computed, positions_t, plan, query_start) -> None:
        """Publish a decode-only step: on vLLM's CPU kernel with every layer's kernel
        tables built once (a step the kept plan does not serve); otherwise through the
        fixed-address ``DecodeBuffers`` (CUDA graphs replay them)."""
        flagged = rows.metric_rows(computed, self.settings.decode_metric_stride)
        kernel_decode = None
        if self.plan_kernel_decode:
            cache = self.cache
            kernel_decode = cpu_attention.plan_decode_step(
                self.state.pool, cache.tables, cache.head_lens, rows.seq_slots, self.num_q_heads,
                torch.from_numpy(flagged) if flagged.size else None,
                uniform=self._uniform_heads(rows), query_dtype=self.query_dtype,
            )
            self._record_kernel_metrics(kernel_decode, rows, computed, flagged)
        else:
            seq_slots = rows.seq_slots
            self.state.decode_buffers.fill(
                seq_slots.shape[0], seq_slots, positions_t, plan.write_pages, plan.write_offsets,
                seq_slots[torch.from_numpy(flagged).to(seq_slots.device)] if flagged.size else None,
            )
        self._publish_decode_step(rows, positions_t, plan, query_start.tolist(), kernel_decode)

    def _publish_decode_step(self, rows: BatchRows, positions_t, plan, query_start: list[int], kernel_decode) -> None:
        self.stats.decode_only_steps += 1
        num_rows = len(rows.req_ids)
        self.publish(PerHeadStep(
            num_reqs=num_rows,
            num_tokens=num_rows,
            query_start_loc=query_start,
            query_positions=positions_t,
            tables=None,
            head_lens=None,
            max_head_len=self.state.decode_buffers.max_head_len,
            plan=plan,
            decode_only=True,
            kernel_decode=kernel_decode,
            decode_metric_power=self.metric_power,
        ))

    def after_forward(self) -> None:
        """After the forward: a step with prompt rows hands its decode rows' metric
        queries to the queue (``DecodeMetrics.after_forward``)."""
        rows = self.requests.rows
        self.decode_metrics.after_forward(None if rows is None else rows.slots)
