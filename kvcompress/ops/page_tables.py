"""The cache's page tables: two levels sized by the pool (:class:`ChunkedPageTables`)
and the allocator's table scatter, PyTorch reference (the CUDA op is
``torch.ops.kvcompress.allocate_pages``; :mod:`kvcompress.ops.dispatch` picks).

Its own module so that both :mod:`kvcompress.ops.paged_cache` (the caller) and
:mod:`kvcompress.ops.dispatch` (the backend choice) import it without importing each
other both ways.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from kvcompress.ops.allocator import PageAllocator, add_references, drop_references


def page_columns(first_column: torch.Tensor, offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``total`` pages handed out by ``PageAllocator.allocate_for`` go: ``([total]
    requester, [total] table column)``, requester ``r``'s pages
    ``offsets[r]:offsets[r + 1]`` at its columns ``first_column[r]...``."""
    demand = offsets[1:] - offsets[:-1]
    requester = torch.repeat_interleave(
        torch.arange(demand.numel(), device=offsets.device), demand, output_size=total
    )
    column = first_column[requester] + torch.arange(total, device=offsets.device) - offsets[requester]
    return requester, column


def fill_page_tables(
    page_tables: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
    first_column: torch.Tensor, rows: torch.Tensor,
) -> None:
    """Hand freshly allocated pages to their requesters' page tables (reference).

    Args:
        page_tables: contiguous int32 or int64 ``[..., P]``, addressed as ``[num_rows, P]``
            (the cache's first-level ``[max_seqs, L, H, P / C]`` chunk tables:
            ``row = seq_slot * L * H + layer * H + head``).
        pages: ``[offsets[-1]]`` int64 page (chunk) ids, requester ``r`` owns
            ``pages[offsets[r]:offsets[r + 1]]``.
        offsets: ``[R + 1]`` int64 exclusive prefix sum of the demands.
        first_column: ``[R]`` int64 first new column of each requester (its old page count).
        rows: ``[R]`` int64 page-table row of each requester.

    Requester ``r`` gets ``page_tables[rows[r], first_column[r] + j] = pages[offsets[r] + j]``.
    """
    requester, column = page_columns(first_column, offsets, pages.numel())
    table = page_tables.view(-1, page_tables.shape[-1])
    table[rows[requester], column] = pages.to(table.dtype)


def chunk_pages_for(max_pages_per_head: int) -> int:
    """Pages per chunk for heads of up to ``max_pages_per_head`` pages: the power of two
    nearest ``sqrt(P)``, which makes the two levels about equal at the longest heads."""
    if max_pages_per_head <= 1:
        return 1
    return 1 << round(math.log2(math.sqrt(max_pages_per_head)))


class ChunkedPageTables:
    """Page ids of every (sequence slot, layer, KV head), in two levels sized by the pool.

    A flat ``[max_seqs, L, H, P_max]`` table would take ``max_num_seqs x max_model_len``
    entries per head whatever the pool holds (8.6 GB int32 for Llama-3.1-8B at 128K and
    1024 sequences). Here a head's page ids live in chunks of ``C`` (``chunk_pages``):

    - ``chunk_tables``: ``[max_seqs, L, H, ceil(P_max / C)]`` int32 chunk ids;
    - ``chunks``: ``[num_chunks, C]`` int32 page ids. Column ``i`` of head ``(s, l, h)``
      is ``chunks[chunk_tables[s, l, h, i // C], i % C]``.

    A head holding ``p`` pages holds ``ceil(p / C)`` chunks, so all heads together hold
    at most ``ceil(num_pages / C) + max_seqs * L * H`` chunks: the second level is sized
    by the pool. Chunk 0 is never handed out (unused entries read it; every entry is
    always a valid page id). Entries past a head's pages are garbage that no kernel
    reads (``head_lens`` bounds every read).
    """

    def __init__(
        self, num_pages: int, max_seqs: int, num_layers: int, num_kv_heads: int,
        max_pages_per_head: int, device: torch.device, shared_pages_per_head: int = 0,
    ) -> None:
        """``shared_pages_per_head``: leading pages a head may hold that other heads hold
        too, written by :meth:`reserve` / :meth:`write_columns` (prefix-cache hits): their
        ids are copies, so the second level gets ``ceil(shared / C)`` more chunks per head."""
        self.chunk_pages = chunk_pages_for(max_pages_per_head)
        self.max_pages_per_head = max_pages_per_head
        self.shape = (max_seqs, num_layers, num_kv_heads)
        columns = -(-max_pages_per_head // self.chunk_pages)
        self.chunk_tables = torch.zeros((*self.shape, columns), dtype=torch.int32, device=device)
        num_chunks = self.num_chunks_for(
            num_pages, max_seqs * num_layers * num_kv_heads, self.chunk_pages, shared_pages_per_head
        )
        if max(num_pages, num_chunks) >= 2**31:
            raise ValueError(f"{num_pages} pages / {num_chunks} chunks: page tables hold int32 ids")
        self.chunks = torch.zeros((num_chunks, self.chunk_pages), dtype=torch.int32, device=device)
        # Chunk ids 1..num_chunks-1 (the allocator hands out 0..n-1; +1 on the way out).
        self.chunk_allocator = PageAllocator(num_chunks - 1, device)
        # Holders of each chunk beyond the first (full chunks of a shared prefix).
        self.chunk_shares = torch.zeros(num_chunks, dtype=torch.int32, device=device)

    @staticmethod
    def num_chunks_for(num_pages: int, num_heads: int, chunk_pages: int, shared_pages_per_head: int = 0) -> int:
        """Chunks for a pool of ``num_pages`` pages and ``num_heads`` (slot, layer, head)
        rows: one partial chunk per head plus the pool's pages in full chunks, the
        chunks of copied shared prefixes, and the null chunk."""
        shared = num_heads * -(-shared_pages_per_head // chunk_pages)
        return 2 + num_heads + num_pages // chunk_pages + shared

    @classmethod
    def nbytes_for(
        cls, num_pages: int, max_seqs: int, num_layers: int, num_kv_heads: int, max_pages_per_head: int,
        shared_pages_per_head: int = 0,
    ) -> int:
        """Bytes :meth:`__init__` allocates for these dimensions (both levels and the
        chunk allocator's int64 free stack)."""
        chunk_pages = chunk_pages_for(max_pages_per_head)
        heads = max_seqs * num_layers * num_kv_heads
        num_chunks = cls.num_chunks_for(num_pages, heads, chunk_pages, shared_pages_per_head)
        return heads * -(-max_pages_per_head // chunk_pages) * 4 + num_chunks * (chunk_pages * 4 + 8 + 4) - 8

    @property
    def flat_chunk_tables(self) -> torch.Tensor:
        """``[max_seqs * L * H, columns]``: row ``(s * L + l) * H + h``."""
        return self.chunk_tables.view(-1, self.chunk_tables.shape[-1])

    def gather(self, seq_slots: torch.Tensor, num_pages: int, layer: int | None = None) -> torch.Tensor:
        """Page ids of the first ``num_pages`` columns of the heads of ``seq_slots``
        (``[S]`` int64): ``[S, L, H, num_pages]`` int32, or ``[S, H, num_pages]`` of
        one ``layer``. Columns past a head's pages are garbage (valid page ids)."""
        columns = max(1, -(-num_pages // self.chunk_pages))
        if layer is None:
            ids = self.chunk_tables[seq_slots, :, :, :columns]
        else:
            ids = self.chunk_tables[seq_slots, layer, :, :columns]
        pages = self.chunks[ids.to(torch.int64)]  # [..., columns, C]
        return pages.flatten(-2)[..., :num_pages]

    def gather_host(self, rows: np.ndarray, num_pages: int) -> np.ndarray:
        """:meth:`gather` of all layers on a CPU table through numpy (``rows`` int64)."""
        columns = max(1, -(-num_pages // self.chunk_pages))
        # np.take along axis 0: a third of fancy indexing's time here.
        ids = np.take(self.chunk_tables.numpy(), rows, axis=0)[..., :columns]
        pages = np.take(self.chunks.numpy(), ids, axis=0)
        return pages.reshape(*pages.shape[:-2], -1)[..., :num_pages]

    def lookup(self, slots, layers, heads, columns) -> torch.Tensor:
        """int64 page ids at broadcast index tensors ``(slots, layers, heads, columns)``."""
        chunk = self.chunk_tables[slots, layers, heads, columns // self.chunk_pages].to(torch.int64)
        return self.chunks[chunk, columns % self.chunk_pages].to(torch.int64)

    def assign(
        self, rows: torch.Tensor, first_column: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
        fill: Callable[..., None] = fill_page_tables,
    ) -> None:
        """Give head row ``rows[r]`` (of :attr:`flat_chunk_tables`) the pages
        ``pages[offsets[r]:offsets[r + 1]]`` at columns ``first_column[r]...`` (its old
        page count onwards), taking new chunks where a head's pages cross into one.

        ``fill``: the first-level fill (:func:`fill_page_tables` or the engine's op).
        """
        chunk_pages = self.chunk_pages
        demand = offsets[1:] - offsets[:-1]
        old_chunks = (first_column + chunk_pages - 1) // chunk_pages
        new_chunks = (first_column + demand + chunk_pages - 1) // chunk_pages
        chunk_ids, chunk_offsets = self.chunk_allocator.allocate_for(new_chunks - old_chunks)
        if chunk_ids.numel():
            fill(self.flat_chunk_tables, chunk_ids + 1, chunk_offsets, old_chunks, rows)
        total = pages.numel()
        if total == 0:
            return
        requester, column = page_columns(first_column, offsets, total)
        chunk = self.flat_chunk_tables[rows[requester], column // chunk_pages].to(torch.int64)
        self.chunks.view(-1)[chunk * chunk_pages + column % chunk_pages] = pages.to(torch.int32)

    def assign_one(self, slots, layers, heads, columns, pages: torch.Tensor) -> None:
        """One new page per listed head (``[K]`` index tensors; ``columns`` = the head's
        old page count), a new chunk where the page starts one."""
        chunk_pages = self.chunk_pages
        starts_chunk = columns % chunk_pages == 0
        count = int(starts_chunk.sum())
        if count:
            ids = (self.chunk_allocator.allocate(count) + 1).to(torch.int32)
            self.chunk_tables[
                slots[starts_chunk], layers[starts_chunk], heads[starts_chunk],
                columns[starts_chunk] // chunk_pages,
            ] = ids
        chunk = self.chunk_tables[slots, layers, heads, columns // chunk_pages].to(torch.int64)
        self.chunks[chunk, columns % chunk_pages] = pages.to(torch.int32)

    def assign_one_host(self, slots, layers, heads, columns, pages: np.ndarray) -> None:
        """:meth:`assign_one` on a CPU table through numpy (``[K]`` int64 arrays)."""
        chunk_pages = self.chunk_pages
        chunk_tables, chunks = self.chunk_tables.numpy(), self.chunks.numpy()
        starts_chunk = columns % chunk_pages == 0
        count = int(np.count_nonzero(starts_chunk))
        if count:
            chunk_tables[
                slots[starts_chunk], layers[starts_chunk], heads[starts_chunk],
                columns[starts_chunk] // chunk_pages,
            ] = self.chunk_allocator.allocate(count).numpy() + 1
        chunk = chunk_tables[slots, layers, heads, columns // chunk_pages]
        chunks[chunk, columns % chunk_pages] = pages

    def truncate(self, seq_slots: torch.Tensor, old_pages: torch.Tensor, new_pages: torch.Tensor) -> None:
        """Return the chunks of heads shrunk from ``old_pages`` to ``new_pages`` pages
        (``[S, L, H]`` each, for ``seq_slots`` ``[S]``) that no longer hold a page."""
        chunk_pages = self.chunk_pages
        old_chunks = (old_pages + chunk_pages - 1) // chunk_pages
        new_chunks = (new_pages + chunk_pages - 1) // chunk_pages
        if not bool((new_chunks < old_chunks).any()):
            return
        columns = int(old_chunks.max())
        index = torch.arange(columns, device=old_pages.device)
        freed = (index >= new_chunks.unsqueeze(-1)) & (index < old_chunks.unsqueeze(-1))
        ids = self.chunk_tables[seq_slots, :, :, :columns][freed].to(torch.int64)
        self._drop_chunks(ids)

    def _drop_chunks(self, ids: torch.Tensor) -> None:
        """Let go of chunks (ids as in the tables: allocator id + 1, hence the shares of
        table ids 1.. against the allocator's 0..)."""
        drop_references(ids - 1, self.chunk_shares[1:], self.chunk_allocator)

    def share_prefix(self, dst_rows: torch.Tensor, src_rows: torch.Tensor, num_pages: int) -> None:
        """Give head rows ``dst_rows`` (``[R]``, empty heads) the first ``num_pages`` page
        ids of head rows ``src_rows``: full chunks are shared (one more holder each), the
        partial chunk at the end is copied into a new chunk of the destination (which
        appends into it). A head that shares a prefix therefore holds at most one chunk
        more than its own pages need, and the shared full chunks are counted once."""
        chunk_pages = self.chunk_pages
        full, rest = divmod(num_pages, chunk_pages)
        table = self.flat_chunk_tables
        if full:
            shared = table[src_rows, :full]
            table[dst_rows, :full] = shared
            add_references(shared, self.chunk_shares)
        if rest:
            copies = self.chunk_allocator.allocate(dst_rows.numel()) + 1
            originals = table[src_rows, full].to(torch.int64)
            table[dst_rows, full] = copies.to(torch.int32)
            self.chunks[copies, :rest] = self.chunks[originals, :rest]

    def reserve(self, rows: torch.Tensor, num_pages: int) -> None:
        """Take the chunks of the first ``num_pages`` columns of head rows ``rows``
        (``[R]``, empty heads); their page ids are written later (:meth:`write_columns`)
        and read as page 0 until then."""
        chunks_per_row = -(-num_pages // self.chunk_pages)
        demand = torch.full((rows.numel(),), chunks_per_row, dtype=torch.int64, device=rows.device)
        chunk_ids, offsets = self.chunk_allocator.allocate_for(demand)
        self.chunks[chunk_ids + 1] = 0
        fill_page_tables(self.flat_chunk_tables, chunk_ids + 1, offsets, torch.zeros_like(rows), rows)

    def write_columns(self, rows: torch.Tensor, pages: torch.Tensor) -> None:
        """Write page ids ``pages`` (``[R, n]``) into the first ``n`` columns of head rows
        ``rows`` (``[R]``), whose chunks are held (:meth:`reserve`)."""
        num_pages = pages.shape[-1]
        column = torch.arange(num_pages, device=rows.device)
        chunk = self.flat_chunk_tables[rows.view(-1, 1), column // self.chunk_pages].to(torch.int64)
        self.chunks.view(-1)[chunk * self.chunk_pages + column % self.chunk_pages] = pages.to(torch.int32)

    def heads_lookup_host(self, slots: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """Page ids at column ``columns[s, l, h]`` of every head of sequence slots
        ``slots`` (``[S]``), on a CPU table through numpy: ``[S, L, H]``."""
        chunk_pages = self.chunk_pages
        num_seqs, num_layers, num_kv_heads = columns.shape
        head_rows = slots.reshape(-1, 1, 1) * (num_layers * num_kv_heads) + np.arange(
            num_layers * num_kv_heads
        ).reshape(num_layers, num_kv_heads)
        # Flat takes: half the time of broadcast fancy indexing over [S, L, H].
        chunk = np.take(
            self.chunk_tables.numpy().reshape(-1),
            head_rows * self.chunk_tables.shape[-1] + columns // chunk_pages,
        )
        return np.take(self.chunks.numpy().reshape(-1), chunk * chunk_pages + columns % chunk_pages)


def decode_tables(
    block_size: int, page_tables: ChunkedPageTables | torch.Tensor, rows: np.ndarray, row_lens: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's arrays of a decode step: ``([L, B * H, P] int32 page ids,
    [L, B, H] int32 KVs held)``, C order (layer ``l``'s kernel sequences are rows ``l``;
    sequence ``b * H + h`` is row ``b``'s head ``h``), ``P`` the pages of the longest head.

    Args:
        rows: ``[B]`` int64 sequence slots of the batch rows.
        row_lens: ``[B, L, H]`` KVs held per head of each row (after this step's KVs).
    """
    num_rows, num_layers, num_kv_heads = row_lens.shape
    if num_rows == 0:
        raise ValueError("decode_tables: a decode step has at least one row")
    if int(row_lens.min()) < 1:
        raise RuntimeError("kvcompress: a decode row has a head with no KV (its own KV was not appended)")
    num_pages = -(-int(row_lens.max()) // block_size)
    # numpy over the CPU tables: a dozen tiny ops, ~1 us each (torch: ~5-10 us each).
    if isinstance(page_tables, torch.Tensor):
        row_tables = page_tables.numpy()[rows, :, :, :num_pages]
    else:
        row_tables = page_tables.gather_host(rows, num_pages)
    tables = np.ascontiguousarray(row_tables.transpose(1, 0, 2, 3), dtype=np.int32)
    lens = np.ascontiguousarray(row_lens.transpose(1, 0, 2), dtype=np.int32)
    return tables.reshape(num_layers, num_rows * num_kv_heads, num_pages), lens
