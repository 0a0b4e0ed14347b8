"""The narrow arguments of the attention and MoveCache ops (reference, Triton, CUDA).

Instead of a dozen positional tensors, every op takes:

- :class:`KVPool`: the page pool all layers share (K, V, and each slot's token
  position and eviction metric);
- :class:`PagedBatch` (``paged_attention``): one layer's tables for the sequences of a
  batch and where their queries are; or :class:`SlotBatch` (``paged_decode_by_slot``):
  decode rows over the tables of every sequence slot;
- :class:`MetricSink` (optional): which decode queries add their attention to the pool's
  ``slot_metrics``, and with what power.

The CUDA ops (``csrc/``) keep their flat schemas; :meth:`KVPool.tensors` gives the pool's
tensors under those schema argument names. Plain holders: nothing is copied or checked
(but :meth:`MetricSink.of_decode_rows`, which puts host-made rows on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


FP8_PAGE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Page dtypes of ``--kv-cache-dtype fp8*`` (unit scales): the kernels that read them
cast each loaded value to the query's dtype, exactly (both formats fit in fp16 / bf16)."""


def as_indexable(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` itself, or for FP8 pages the same memory as ``uint8`` (any strides):
    torch's gather / scatter kernels lack float8 on some devices and versions
    (``index_select``, ``index``, ``index_put``), so FP8 pages move as bytes and are
    viewed back (:func:`gather_pages`, :func:`scatter_pages`)."""
    return cache.view(torch.uint8) if cache.dtype in FP8_PAGE_DTYPES else cache


def gather_pages(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` (indexing dim 0) in ``cache``'s dtype (``index_select`` for a 1-D
    index, as the callers used before FP8 pages)."""
    source = as_indexable(cache)
    gathered = source.index_select(0, index) if index.dim() == 1 else source[index]
    return gathered.view(cache.dtype)


def scatter_pages(cache: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    """``cache[index] = values``, cast to ``cache``'s dtype; into FP8 pages saturating at
    the format's largest finite value, as vLLM's own FP8 cache writes (a plain cast
    would make NaN of e4m3's overflow), rounding to nearest as vLLM's CUDA writer does.
    (vLLM's CPU writer rounds toward zero: where its kernel takes FP8 pages it writes
    them, :mod:`kvcompress.ops.cpu_attention`.)"""
    if cache.dtype in FP8_PAGE_DTYPES:
        limit = torch.finfo(cache.dtype).max
        values = values.float().clamp(-limit, limit)
    as_indexable(cache)[index] = as_indexable(values.to(cache.dtype))


@dataclass(frozen=True, eq=False)
class KVPool:
    """The per-(layer, KV head) page pool: page ``n`` holds ``block_size`` KVs of one head.

    Attributes:
        key_cache, value_cache: ``[num_pages, block_size, head_dim]``, the cache dtype;
            may be strided views (the engine's are ``buffer[0]`` / ``buffer[1]`` of a
            ``[2, N, b, D]`` buffer; ``pool[:, 0]`` / ``pool[:, 1]`` of a ``[N, 2, b, D]``
            one work too), the head dim contiguous.
        slot_positions: ``[num_pages, block_size]`` int32, token position of the KV in
            each slot (RoPE and the causal mask read it, not the slot order).
        slot_metrics: ``[num_pages, block_size]`` float32, eviction metric of the KV in
            each slot (accumulated attention); moves with the KV.

        page_meta_row: optional ``[num_pages]`` int32, the row of ``slot_positions`` /
            ``slot_metrics`` (then ``[num_rows, block_size]``) that holds page ``n``'s
            positions and metrics; pages may share a row (e.g. rows of identity positions
            for heads that are never compressed). None: row ``n`` (one row per page).
            Every op reads the metadata through it (:meth:`meta_index`,
            :meth:`meta_tables`); backends without it are not chosen for such a pool
            (:attr:`~kvcompress.ops.backend.KernelBackend.meta_rows`).

    ``slot_positions`` / ``slot_metrics`` may have fewer pages than the K / V views:
    the runner's scratch page (written by padding rows, never read) is past them.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_positions: torch.Tensor
    slot_metrics: torch.Tensor
    page_meta_row: torch.Tensor | None = None

    def meta_index(self, pages: torch.Tensor) -> torch.Tensor:
        """Rows of ``slot_positions`` / ``slot_metrics`` holding ``pages``' metadata (any
        shape; int64 out when rows are mapped, else ``pages`` itself)."""
        if self.page_meta_row is None:
            return pages
        return self.page_meta_row.index_select(0, pages.reshape(-1).long()).view(pages.shape).long()

    def meta_tables(self, block_tables: torch.Tensor) -> torch.Tensor:
        """``block_tables`` with every page id replaced by its metadata row (the tables
        the metric ops take with ``slot_metrics``). Entries past a head's pages may hold
        any id of the pool (they map to some row and are never read)."""
        if self.page_meta_row is None:
            return block_tables
        return self.meta_index(block_tables.clamp(0, self.page_meta_row.shape[0] - 1))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The four tensors by field name (the CUDA ops' schema argument names), K / V
        narrowed to the pages that have slot positions: the CUDA bindings require equal
        page counts, and the scratch page past them is never read or moved by an op.
        Not for a pool with ``page_meta_row`` (the CUDA kernels index rows by page)."""
        if self.page_meta_row is not None:
            raise ValueError("the CUDA ops read slot metadata by page id: not for a pool with page_meta_row")
        pages = self.slot_positions.shape[0]
        return {
            "key_cache": self.key_cache.narrow(0, 0, pages),
            "value_cache": self.value_cache.narrow(0, 0, pages),
            "slot_positions": self.slot_positions,
            "slot_metrics": self.slot_metrics,
        }

    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return self.key_cache.shape[1]

    @property
    def device(self) -> torch.device:
        """Where the pool lives (the ops' backends are chosen for it)."""
        return self.key_cache.device


@dataclass(frozen=True, eq=False)
class QueryLayout:
    """How a batch's query rows fall into sequences, worked out from its starts in one
    scan: every layer of a step shares one (``PerHeadStep.query_layout``), so no layer
    call loops over the rows in Python (1,024 rows x 32 layers: ~33K iterations per
    step otherwise, on the host's critical path of eager attention).

    Attributes:
        query_start_loc: the ``S + 1`` starts it describes (the same list object).
        decode_only: every sequence has exactly one query row.
        longest_chunk: the most query rows of one sequence (0 without sequences).
    """

    query_start_loc: list[int]
    decode_only: bool
    longest_chunk: int

    @classmethod
    def of(cls, query_start_loc: list[int]) -> "QueryLayout":
        """The layout of starts ``query_start_loc`` (``S + 1`` Python ints)."""
        rows = np.diff(np.asarray(query_start_loc, dtype=np.int64))
        return cls(query_start_loc, bool((rows == 1).all()), int(rows.max()) if rows.size else 0)


@dataclass(frozen=True, eq=False)
class PagedBatch:
    """One layer of a batch, for ``paged_attention``.

    Attributes:
        block_tables: ``[S, num_kv_heads, P]`` int64 page ids of this layer (entries
            past a head's pages are never read).
        head_lens: ``[S, num_kv_heads]`` int64 KVs held per head.
        query_start_loc: ``S + 1`` Python ints: sequence ``s`` owns query rows
            ``[query_start_loc[s], query_start_loc[s + 1])`` (a tensor is read to the
            host once, here).
        query_positions: ``[T]`` int64 token position of each query row.
        max_head_len: optional upper bound of the decode rows' head lengths, known on
            the host: the GPU decode sizes its partition grid without reading
            ``head_lens`` (the reference ignores it).
        flat_query_start_loc: optional ``[H * S + 1]`` int32 on the query's device: the
            head-major starts of the flattened kernels' sequences
            (:func:`kvcompress.ops.flattened.flat_query_starts`), the same for every
            layer of a step, so the runner copies them to the device once per step;
            None: the flattened kernels copy them at each call (on CUDA a copy from
            pageable host memory waits for the stream: a sync per layer).
        layout: :class:`QueryLayout` of ``query_start_loc``, shared by a step's layers
            (made here when None, or when it describes another list of starts).
        sliding_window: this layer's window ``W`` (tokens), or None (full attention): a
            query at position ``p`` sees the KVs at positions ``p - W < k <= p`` (itself
            and the ``W - 1`` before it, vLLM's convention). Backends that do not
            implement it (:attr:`~kvcompress.ops.backend.KernelBackend.sliding_window`)
            hand the call to one that does.
    """

    block_tables: torch.Tensor
    head_lens: torch.Tensor
    query_start_loc: list[int]
    query_positions: torch.Tensor
    max_head_len: int | None = None
    flat_query_start_loc: torch.Tensor | None = None
    layout: QueryLayout | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.query_start_loc, torch.Tensor):
            object.__setattr__(self, "query_start_loc", self.query_start_loc.tolist())
        # Identity, not equality: comparing would scan the rows again.
        if self.layout is None or self.layout.query_start_loc is not self.query_start_loc:
            object.__setattr__(self, "layout", QueryLayout.of(self.query_start_loc))

    def decode_only(self) -> bool:
        """Every sequence has exactly one query row."""
        return self.layout.decode_only


@dataclass(frozen=True, eq=False)
class SlotBatch:
    """Decode rows over the tables of ALL sequence slots, for ``paged_decode_by_slot``
    (the CUDA-graph path: nothing here is read on the host).

    Attributes:
        block_tables: ``[num_slots, num_kv_heads, P]`` page ids of one layer for every
            sequence slot; with ``chunks``, ``[num_slots, num_kv_heads, ceil(P / C)]``
            chunk ids (e.g. ``PerHeadPagedCache.tables.chunk_tables[:, layer]``).
        head_lens: ``[num_slots, num_kv_heads]`` KVs held per head.
        seq_slots: ``[B]`` int32, query row ``b`` is the decode query of slot
            ``seq_slots[b]`` (distinct for real rows; padding rows may share an empty slot).
        query_positions: ``[B]`` token position of each row.
        max_head_len: fixed upper bound of every head length (tokens), sizes the grid
            (None: the tables' width ``P * block_size``; the reference ignores it).
        row_index: optional ``[B]`` int32 ``arange`` (kernel row -> query row), kept at a
            fixed address for graph capture (made per call when None).
        chunks: optional ``[num_chunks, C]`` page ids of the second level
            (:class:`~kvcompress.ops.page_tables.ChunkedPageTables`): column ``i`` of a head
            is ``chunks[block_tables[s, h, i // C], i % C]``. None: ``block_tables`` holds
            page ids.
        sliding_window: as :attr:`PagedBatch.sliding_window`.
    """

    block_tables: torch.Tensor
    head_lens: torch.Tensor
    seq_slots: torch.Tensor
    query_positions: torch.Tensor
    max_head_len: int | None = None
    row_index: torch.Tensor | None = None
    chunks: torch.Tensor | None = None
    sliding_window: int | None = None

    @property
    def max_pages(self) -> int:
        """Columns (pages) a head's table can address."""
        width = self.block_tables.shape[2]
        return width if self.chunks is None else width * self.chunks.shape[1]

    def gathered(self, block_size: int) -> PagedBatch:
        """The rows as a :class:`PagedBatch` of one-query sequences: their tables gathered
        from the slot tables, only the pages some row holds (the slot tables are
        ``max_model_len`` wide). Reads the longest head on the host."""
        rows = self.seq_slots.to(torch.int64)
        lens = self.head_lens[rows]  # [B, H]
        num_pages = max(1, -(-int(lens.max()) // block_size)) if rows.numel() else 1
        if self.chunks is None:
            tables = self.block_tables[rows, :, :num_pages]
        else:
            chunk_pages = self.chunks.shape[1]
            ids = self.block_tables[rows, :, : -(-num_pages // chunk_pages)].to(torch.int64)
            tables = self.chunks[ids].flatten(-2)[..., :num_pages]
        return PagedBatch(tables, lens, list(range(rows.numel() + 1)), self.query_positions[: rows.numel()],
                          sliding_window=self.sliding_window)


@dataclass(frozen=True, eq=False)
class MetricSink:
    """Decode queries that add ``sum over the query group of prob ** power`` into
    ``KVPool.slot_metrics`` at the held slots they see (continual compression; nothing
    is zeroed).

    Attributes:
        selected: which decode queries add: ``[S]`` bool over a ``PagedBatch``'s
            sequences, or ``[num_slots]`` int8 / bool over the sequence slots of a
            ``SlotBatch``.
        power: 2 (L2, the paper's squared attention) or 1 (L1).
        rows: optional ``[2, K]`` int32 (sequence, query row) of the selected decode
            queries of a ``PagedBatch``, on the query's device, known on the host where
            the sink was made (:meth:`of_decode_rows`): a metric pass of its own
            (:func:`kvcompress.ops.triton_attention.decode_metrics_triton`) launches for
            these rows only. None: for every decode row (the unselected add nothing).
    """

    selected: torch.Tensor
    power: int = 2
    rows: torch.Tensor | None = None

    @classmethod
    def of_decode_rows(
        cls, seqs, query_start_loc: list[int], power: int, device: torch.device,
        selected: torch.Tensor | None = None,
    ) -> "MetricSink":
        """The sink of the decode queries of sequences ``seqs`` (host ints, each with
        one query row) of a ``PagedBatch`` with starts ``query_start_loc``, with
        :attr:`rows`. Made on the host and copied to ``device`` once (on CUDA from
        pinned memory, so the copy does not wait for the stream): a step's layers share
        it. ``selected``: the same sequences' ``[S]`` flags when already on ``device``."""
        seq_ids = torch.as_tensor(seqs, dtype=torch.int64).reshape(-1)
        starts = torch.as_tensor(query_start_loc, dtype=torch.int64)
        rows = torch.stack([seq_ids, starts[seq_ids]]).to(torch.int32)
        if selected is None:
            flags = torch.zeros(starts.numel() - 1, dtype=torch.bool)
            flags[seq_ids] = True
            selected = host_to_device(flags, torch.device(device))
        return cls(selected, power, host_to_device(rows, torch.device(device)))


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor made on the host (a step's plan), on ``device``. On CUDA through pinned
    memory and a non-blocking copy: a copy from pageable memory waits for the stream
    (measured on an H200 with ``torch.cuda.set_sync_debug_mode``)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
