"""The runner's per-step data model, read by the attention backend.

The model runner (``runner.py``) plans each step and publishes it with
``set_current_step``; the attention backend's metadata builder hands it to every
layer. ``WorkerCacheState`` is the worker's page pool, set once when the KV cache is
built. Decode-only steps read the fixed-address ``DecodeBuffers`` instead of a
``PerHeadStep``'s tables, so a CUDA graph can replay them.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from functools import cached_property
from typing import Callable

import numpy as np
import torch

from kvcompress.ops import AppendPlan, KernelOps, KVPool, MetricSink, PerHeadPagedCache, resolve_ops
from kvcompress.ops.cpu_attention import KernelDecodeLayer
from kvcompress.ops.decode_by_slot import graph_partition_size
from kvcompress.ops.decode_metrics import StepDecodeQueries
from kvcompress.ops.expected_attention import RopeFrequencies
from kvcompress.ops.kv_pool import QueryLayout
from kvcompress.ops.page_tables import ChunkedPageTables
from kvcompress.ops.paged_cache import pages_for
from kvcompress.policies import MetricSpec


@dataclass
class DecodeBuffers:
    """Fixed-address inputs of decode-only steps, so a CUDA graph can replay them.

    The runner refills them before each decode-only step; the attention of such a
    step reads only these, the cache's own per-slot tensors and fixed integers
    (``kvcompress.ops.decode_by_slot``). Rows past the batch (vLLM pads a graph's
    batch) point at ``pad_slot``, whose heads are empty, and write their KVs into
    ``scratch_page``, which is never allocated.

    Attributes:
        seq_slots: ``[max_rows]`` int32 sequence slot of each query row.
        query_positions: ``[max_rows]`` int64 token position of each query row.
        write_pages, write_offsets: ``[num_layers, max_rows, num_kv_heads]`` int64
            slot of each row's new KV.
        metric_slots: ``[num_slots]`` int8, slots whose decode query adds to the
            eviction metrics this step.
        row_index: ``[max_rows]`` int32 ``arange`` (kernel row -> query row).
        pad_slot, scratch_page: see above.
        max_head_len: fixed bound of every head length (tokens), sizes the grid.
        block_size: tokens per page (partition sizes are whole pages,
            :meth:`partition_size_for`).
        metric_power: decode metric power of the server policy (1 or 2).
    """

    seq_slots: torch.Tensor
    query_positions: torch.Tensor
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    metric_slots: torch.Tensor
    row_index: torch.Tensor
    pad_slot: int
    scratch_page: int
    max_head_len: int
    block_size: int
    metric_power: int

    @classmethod
    def allocate(
        cls, *, num_layers: int, num_kv_heads: int, max_rows: int, num_slots: int,
        pad_slot: int, scratch_page: int, max_head_len: int, block_size: int,
        metric_power: int, device: torch.device,
    ) -> "DecodeBuffers":
        shape = (num_layers, max_rows, num_kv_heads)
        buffers = cls(
            seq_slots=torch.empty(max_rows, dtype=torch.int32, device=device),
            query_positions=torch.empty(max_rows, dtype=torch.int64, device=device),
            write_pages=torch.empty(shape, dtype=torch.int64, device=device),
            write_offsets=torch.empty(shape, dtype=torch.int64, device=device),
            metric_slots=torch.zeros(num_slots, dtype=torch.int8, device=device),
            row_index=torch.arange(max_rows, dtype=torch.int32, device=device),
            pad_slot=pad_slot,
            scratch_page=scratch_page,
            max_head_len=max_head_len,
            block_size=block_size,
            metric_power=metric_power,
        )
        buffers.fill(0)
        return buffers

    def partition_size_for(self, rows: int, num_kv_heads: int) -> int:
        """Keys per decode partition for a batch of ``rows`` (fixed per captured graph):
        :func:`kvcompress.ops.decode_by_slot.graph_partition_size`."""
        return graph_partition_size(self.max_head_len, self.block_size, rows * num_kv_heads)

    @property
    def max_rows(self) -> int:
        return self.seq_slots.shape[0]

    @staticmethod
    def nbytes_for(num_layers: int, num_kv_heads: int, max_rows: int, num_slots: int) -> int:
        """Bytes that :meth:`allocate` takes for these dimensions."""
        return max_rows * (4 + 8 + 4) + 2 * num_layers * max_rows * num_kv_heads * 8 + num_slots

    def fill(
        self,
        num_rows: int,
        seq_slots: torch.Tensor | None = None,
        query_positions: torch.Tensor | None = None,
        write_pages: torch.Tensor | None = None,
        write_offsets: torch.Tensor | None = None,
        metric_slot_ids: torch.Tensor | None = None,
    ) -> None:
        """Rows ``[0, num_rows)`` from the step (``seq_slots [n]``, ``query_positions
        [n]``, ``write_pages / write_offsets [L, n, H]``); the rest padding.
        ``metric_slot_ids``: slots whose queries add to the metrics (None: none)."""
        if num_rows > self.max_rows:
            raise RuntimeError(
                f"kvcompress: a decode step of {num_rows} rows exceeds the {self.max_rows} "
                "rows of the decode buffers"
            )
        if num_rows:
            self.seq_slots[:num_rows].copy_(seq_slots)
            self.query_positions[:num_rows].copy_(query_positions)
            self.write_pages[:, :num_rows].copy_(write_pages)
            self.write_offsets[:, :num_rows].copy_(write_offsets)
        self.seq_slots[num_rows:].fill_(self.pad_slot)
        self.query_positions[num_rows:].fill_(0)
        self.write_pages[:, num_rows:].fill_(self.scratch_page)
        self.write_offsets[:, num_rows:].fill_(0)
        self.metric_slots.zero_()
        if metric_slot_ids is not None and metric_slot_ids.numel():
            self.metric_slots[metric_slot_ids] = 1


@dataclass
class WorkerCacheState:
    """The worker's page pool and tables.

    Attributes:
        cache: page tables / head lengths / slot positions / allocator.
        layer_index: attention layer name -> layer index in the page tables.
        decode_buffers: fixed-address inputs of decode-only steps.
        pool: the ops' view of the KV buffer: K / V ``[num_buffer_pages, block_size,
            head_dim]`` (the allocator's pages plus the scratch page) with the cache's
            slot positions and metrics (``cache.kv_pool(key_cache, value_cache)``).
        ops: the kernels, backends resolved once for the pool's device
            (``kvcompress.ops.dispatch.resolve_ops``; resolved here when None).
        rope: the model's RoPE frequencies (the ``kvc-ea`` policy's estimate), None
            when it has no rotary embedding vLLM's base class describes.

    ``key_cache`` / ``value_cache`` (init only): instead of ``pool``, the two views of
    the KV buffer; the pool is built from them.
    """

    cache: PerHeadPagedCache
    layer_index: dict[str, int]
    decode_buffers: DecodeBuffers | None = None
    pool: KVPool | None = None
    ops: KernelOps | None = None
    rope: RopeFrequencies | None = None
    key_cache: InitVar[torch.Tensor | None] = None
    value_cache: InitVar[torch.Tensor | None] = None

    def __post_init__(self, key_cache: torch.Tensor | None, value_cache: torch.Tensor | None) -> None:
        if (key_cache is None) != (value_cache is None) or (key_cache is None) == (self.pool is None):
            raise TypeError("WorkerCacheState: give either pool or both key_cache and value_cache")
        if self.pool is None:
            self.pool = self.cache.kv_pool(key_cache, value_cache)
        if self.ops is None:
            self.ops = resolve_ops(self.pool.device)


@dataclass
class PromptMetricRows:
    """Prompt queries of one sequence that score its keys this step.

    Attributes:
        seq_index: the sequence's index in the batch.
        row_start, row_end: query rows ``[row_start, row_end)`` (window or full mode).
        prompt_done: this chunk ends the prompt, so the prompt metrics are final and
            get pooled.
        spec: the request's policy metric (power, skip_nearest, pooling).
        word_starts: ``[prompt_len]`` int64, the first position of each prompt
            position's word span, when the prompt is done and the spec pools over
            words (``kvcompress.ops.word_spans``); else None.
        protected_prefix, protected_window: the request's KVs never evicted at the
            start and the end of every head (``kvc-ea`` re-ranks only the others).
        end_position: the position after the rows' last query (the prompt's length
            when ``prompt_done``), known on the host.
        at_prompt_end: the scoring kind's hook the attention backend calls in each
            layer once ``prompt_done`` rows' metrics are scored and pooled
            (``ScoringKindGlue.prompt_scored``); None: nothing more.
    """

    seq_index: int
    row_start: int
    row_end: int
    prompt_done: bool
    spec: MetricSpec
    word_starts: torch.Tensor | None = None
    protected_prefix: int = 0
    protected_window: int = 0
    end_position: int = 0
    at_prompt_end: Callable[[PromptScored], None] | None = None


@dataclass(frozen=True)
class PromptScored:
    """One layer's prompt metrics of a sequence, scored and pooled (what a scoring
    kind's ``prompt_scored`` hook reads).

    Attributes:
        state: the worker's pool (``pool.slot_metrics``, ``pool.key_cache``, ``rope``).
        rows: the prompt rows that finished the prompt.
        query: ``[rows, num_q_heads, head_size]`` their queries in this layer.
        positions: ``[rows]`` int64 their positions.
        tables: ``[H, pages]`` the sequence's page tables in this layer.
        lens: ``[H]`` its tokens per head in this layer.
        scale: the attention's softmax scale.
    """

    state: WorkerCacheState
    rows: PromptMetricRows
    query: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    scale: float


@dataclass
class MetricQueries:
    """Queries of one step that add to the eviction metrics.

    Attributes:
        prompt_rows: per sequence whose prompt queries score keys this step.
        decode_seqs: ``[num_reqs]`` bool, sequences whose decode query adds its
            attention to the metrics (continual compression), or None.
        power: decode metric power, 2 (L2, squared attention) or 1 (L1).
        prompt_weight: factor on prompt queries' scores (1 / the decode metric stride:
            decode queries add every stride-th token, so both estimate per-query sums
            on one scale).
        decode_queries: where the decode metric queries wait for a pass shared with
            later ones (vLLM's CPU kernel): each layer records the rows'
            queries here instead (``decode_seqs`` is then None), and the runner hands
            them to its queue after the forward.
        decode_seq_ids: ``[K]`` int64 numpy, the sequences set in ``decode_seqs``, on
            the host (the runner knows them): the decode metric pass then launches for
            those rows only (:attr:`PerHeadStep.decode_metric_sink`); None: for every
            decode row.
    """

    prompt_rows: list[PromptMetricRows]
    decode_seqs: torch.Tensor | None
    power: int
    prompt_weight: float = 1.0
    decode_queries: StepDecodeQueries | None = None
    decode_seq_ids: np.ndarray | None = None


@dataclass(frozen=True)
class StepTables:
    """A step's per-head page tables, read in place from the cache: each layer gathers
    its own ``[S, H, P]`` rows when it runs (one layer's worth alive at a time), never
    ``[S, L, H, P]`` for every layer at once (4.3 GB for 256 rows of Llama-3.1-8B at
    128K context, int64).

    Attributes:
        page_tables: the cache's two-level tables (not a copy).
        seq_slots: ``[S]`` int64 sequence slot of each batch row.
        num_pages: a host bound of the pages any row's head holds (from the requests'
            token counts: eviction only shortens heads), so no device read.
    """

    page_tables: ChunkedPageTables
    seq_slots: torch.Tensor
    num_pages: int

    @classmethod
    def for_rows(cls, cache: PerHeadPagedCache, seq_slots: torch.Tensor, token_counts) -> tuple["StepTables", int]:
        """The tables of batch rows in sequence slots ``seq_slots`` (``[S]`` int64 on the
        cache's device) whose requests hold ``token_counts`` tokens each (numpy, after
        this step), and the longest head: exact on a CPU cache (read in place), else the
        host bound ``max(token_counts)``."""
        if cache.host is not None:
            max_head_len = int(cache.host.head_lens[seq_slots.numpy()].max())
        else:
            max_head_len = int(token_counts.max())
        num_pages = max(1, pages_for(max_head_len, cache.block_size))
        return cls(cache.tables, seq_slots, num_pages), max_head_len

    def layer(self, layer: int) -> torch.Tensor:
        """``[S, H, num_pages]`` int32 page ids of layer ``layer``'s heads, batch order
        (it allocates :meth:`layer_nbytes`)."""
        return self.page_tables.gather(self.seq_slots, self.num_pages, layer)

    @staticmethod
    def layer_nbytes(num_seqs: int, num_kv_heads: int, num_pages: int, chunk_pages: int) -> int:
        """Bytes :meth:`layer` allocates for ``num_seqs`` rows of ``num_pages`` pages
        (``ChunkedPageTables.gather``: int32 chunk ids, as int64, then whole int32 chunks
        of ``chunk_pages`` page ids)."""
        columns = max(1, -(-num_pages // chunk_pages))
        return num_seqs * num_kv_heads * columns * (4 + 8 + 4 * chunk_pages)


@dataclass
class PerHeadStep:
    """One forward step, planned by the runner.

    Attributes:
        num_reqs: sequences in the batch (batch order).
        num_tokens: new tokens in the batch.
        query_start_loc: ``num_reqs + 1`` Python ints.
        query_positions: ``[num_tokens]`` int64 token positions.
        tables: the rows' page tables, gathered layer by layer (None for a decode-only
            step).
        head_lens: ``[num_reqs, num_layers, num_kv_heads]`` int64 (after this step's
            KVs; None for a decode-only step).
        max_head_len: a host upper bound of ``head_lens`` (sizes GPU decode grids
            without a sync).
        plan: where each new KV is written.
        metrics: which queries add to the eviction metrics (None: none).
        decode_only: every row is one generated token: attention reads the
            ``DecodeBuffers`` (filled by the runner) instead of the fields above.
        kernel_decode: for a decode-only step on vLLM's CPU kernel, every layer's rows
            in the kernel's terms, built once for the step (None otherwise); attention
            then reads these and ``plan``, not the ``DecodeBuffers``.
        decode_metric_power: the decode metric pass's power for ``kernel_decode`` rows
            (their ``metric_rows``).
        flat_query_start_loc: ``[num_kv_heads * num_reqs + 1]`` int32 on the cache's
            device, the flattened kernels' sequence starts
            (:func:`kvcompress.ops.flattened.flat_query_starts`; the same for every
            layer, copied once per step); None for a decode-only step.
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: list[int]
    query_positions: torch.Tensor
    tables: StepTables | None
    head_lens: torch.Tensor | None
    max_head_len: int
    plan: AppendPlan
    metrics: MetricQueries | None = None
    decode_only: bool = False
    kernel_decode: list[KernelDecodeLayer] | None = None
    decode_metric_power: int = 2
    flat_query_start_loc: torch.Tensor | None = None

    @cached_property
    def query_layout(self) -> QueryLayout:
        """How ``query_start_loc`` falls into sequences, scanned once for every layer's
        ``PagedBatch``."""
        return QueryLayout.of(self.query_start_loc)

    @cached_property
    def decode_metric_sink(self) -> MetricSink | None:
        """The decode queries that add to the metrics this step, as every layer's
        attention takes them (made once per step); None when none does. With the
        runner's host ids (``metrics.decode_seq_ids``) the sink carries the rows, so
        the metric pass launches for those rows only."""
        metrics = self.metrics
        if metrics is None or metrics.decode_seqs is None:
            return None
        if metrics.decode_seq_ids is None:
            return MetricSink(metrics.decode_seqs, metrics.power)
        return MetricSink.of_decode_rows(
            metrics.decode_seq_ids, self.query_start_loc, metrics.power, metrics.decode_seqs.device,
            selected=metrics.decode_seqs,
        )


@dataclass
class ReconstructionStep:
    """One chunk of a request's reconstruction pass (``kvzip`` scoring), run by the
    runner outside vLLM's batch: its scoring tokens attend over the request's cached
    KVs and themselves (``kvcompress.ops.reconstruction``); nothing is written to the
    cache.

    Attributes:
        tables: the request's page tables (one row).
        head_lens: ``[num_layers, num_kv_heads]`` KVs each head holds.
        scores: ``[num_layers, num_kv_heads, P * b]`` float32, logical slot order: the
            largest probability a scoring query gave each KV so far (raised in place
            by every chunk).
    """

    tables: StepTables
    head_lens: torch.Tensor
    scores: torch.Tensor


_worker_state: WorkerCacheState | None = None
_current_step: PerHeadStep | None = None


def set_worker_state(state: WorkerCacheState | None) -> None:
    global _worker_state
    _worker_state = state


def get_worker_state() -> WorkerCacheState | None:
    return _worker_state


def set_current_step(step: PerHeadStep | None) -> None:
    global _current_step
    _current_step = step


def current_step() -> PerHeadStep | None:
    return _current_step
