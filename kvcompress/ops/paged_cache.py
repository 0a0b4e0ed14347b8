"""Per-sequence, per-(layer, KV head) page tables over one page pool.

The state every other op reads:

- ``tables``: a :class:`~kvcompress.ops.page_tables.ChunkedPageTables`, the physical
  page ids of every head in two levels sized by the pool; column ``i`` of head
  ``(s, l, h)`` holds KVs ``[i*b, (i+1)*b)`` of that head of sequence slot ``s``
  (``b`` = ``block_size``). ``tables.gather`` gives flat int32 ``[S, (L,) H, P]`` rows.
- ``head_lens``: ``[max_seqs, num_layers, num_kv_heads]`` int64, KVs held per head.
  Heads may differ once KVs are evicted; a head holds ``ceil(len / b)`` pages.
- ``slot_positions``: ``[num_rows, block_size]`` int32, the token position of the KV
  stored in each slot of a page's metadata row (RoPE and the causal mask use
  positions, not slot order).
- ``slot_metrics``: ``[num_rows, block_size]`` float32, the eviction metric of the KV
  stored in each slot (accumulated attention; 0 for a freshly written KV). It moves
  with the KV when MoveCache compacts a head.
- ``page_meta_row`` (``identity_rows``; else None: row = page id): ``[num_pages]`` int32,
  the row holding each page's positions and metrics (issue 61,
  docs/design-61-metadata-rows.md). Rows are carved from pages: row ``p * R + k`` is the
  ``k``-th of page ``p``'s ``R = rows_per_page`` (``slot_positions`` / ``slot_metrics``
  are then views of the pages' K / V bytes, given as ``metadata``). The
  ``identity_pages`` past the allocator's pages hold the identity rows: token block
  ``c``'s row (``identity_row0 + c``) holds positions ``c * b + j``; the pages of a
  sequence that never compresses (``new_sequence(compresses=False)``) point at their
  token block's row, since its heads keep every KV in position order (appends write the
  same values there), and so do the pages the prefix cache takes. A compressing
  sequence's own pages have rows of its own, packed into its ``row_pages`` (the k-th of
  its ``rows_used`` rows is row ``k % R`` of its ``k // R``-th row page): it holds
  ``ceil(own pages / R)`` pages more, re-packed whenever it lets pages go, the count the
  scheduler's ``PageAccounting(rows_per_page=R)`` keeps (``row_pages_for``).
- ``grant_pages`` (g): a never-compressing sequence's heads are counted as holding
  their pages in groups of g (stock vLLM's block over this page size: 2 on CPU), as the
  scheduler's ``PageAccounting(grant_pages=g)`` counts them (``counted_pages``): the
  pages a head's last group has not reached yet stay on the free stack but are reported
  held (:meth:`PerHeadPagedCache.spare_pages`, :meth:`PerHeadPagedCache.counted_free_pages`),
  so the scheduler never hands them to another request.
- ``page_shares``: ``[num_pages]`` int32, holders of each page beyond the first. A
  shared prefix (:meth:`PerHeadPagedCache.share_prefix`: the same uncompressed leading
  pages in several sequence slots, e.g. a prefix-cache hit) is held by every slot that
  has it; a page returns to the allocator only when its last holder lets go. Holders
  never write into or move a shared page: new KVs go past it, and compression keeps a
  shared prefix whole (protect it like sinks: ``sink_tokens >= pages * block_size``).

All updates are tensor ops on the cache's device, batched over sequences, layers
and heads. Sequences are addressed by a small integer "sequence slot" that the
owner (the vLLM model runner) maps to request ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.ops import dispatch
from kvcompress.ops.allocator import PageAllocator, add_references, drop_references
from kvcompress.ops.dispatch import KernelOps
from kvcompress.ops.kv_pool import KVPool
from kvcompress.ops.page_tables import ChunkedPageTables, fill_page_tables, page_columns

# Bytes each KV slot's eviction state takes: an int32 position and a float32 metric
# (``slot_positions``, ``slot_metrics``).
SLOT_METADATA_BYTES = 4 + 4

__all__ = ["AppendPlan", "ChunkedPageTables", "PerHeadPagedCache", "fill_page_tables", "identity_pages_for",
           "pages_for", "rows_per_page_for"]


def rows_per_page_for(head_dim: int, dtype_bytes: int) -> int:
    """Metadata rows (``block_size`` int32 positions in K's bytes, as many float32 metrics
    in V's) one page of ``block_size x head_dim`` elements of ``dtype_bytes`` holds."""
    if head_dim * dtype_bytes % 4:
        raise ValueError(f"a page row of {head_dim} x {dtype_bytes} bytes does not hold whole int32 words")
    return head_dim * dtype_bytes // 4


def identity_pages_for(max_pages_per_head: int, rows_per_page: int) -> int:
    """Pages the identity rows (one per token block of the longest head) take."""
    return -(-max_pages_per_head // rows_per_page)


def pages_for(lengths, block_size: int):
    """Pages needed to hold ``lengths`` KVs per head: ``ceil(lengths / block_size)``
    (a tensor or a numpy array, returned as the same)."""
    return (lengths + block_size - 1) // block_size


@dataclass(frozen=True)
class HostViews:
    """numpy views of a CPU cache's tables (same memory; tensors are only ever updated in
    place, never rebound), and the page each head writes into next.

    Attributes:
        last_pages: ``[max_seqs, L, H]`` int64 page id of each head's last page (garbage
            for empty heads): a decode step's write targets without a two-level lookup.
            Kept by every op that changes a head's pages.
    """

    head_lens: np.ndarray
    slot_positions: np.ndarray
    slot_metrics: np.ndarray
    last_pages: np.ndarray

    @classmethod
    def of(cls, cache: "PerHeadPagedCache") -> "HostViews":
        return cls(
            cache.head_lens.numpy(), cache.slot_positions.numpy(), cache.slot_metrics.numpy(),
            np.zeros(cache.head_lens.shape, np.int64),
        )

    def place(self, meta_slots: np.ndarray, positions: np.ndarray) -> None:
        """New KVs at flat metadata slots ``meta_slots`` (``row * block_size + offset``,
        :meth:`PerHeadPagedCache.meta_slots`): their positions (``positions``, broadcast
        to ``meta_slots``) recorded, their metrics zeroed."""
        self.slot_positions.reshape(-1)[meta_slots] = positions
        self.slot_metrics.reshape(-1)[meta_slots] = 0.0

    def refresh_last_pages(self, cache: "PerHeadPagedCache", slots: np.ndarray) -> None:
        """Re-read the last page of every head of ``slots`` (after a general append or a
        compression)."""
        columns = np.maximum(pages_for(self.head_lens[slots], cache.block_size) - 1, 0)
        self.last_pages[slots] = cache.tables.heads_lookup_host(slots, columns)


@dataclass
class AppendPlan:
    """Where the KVs of one step's new tokens go.

    Attributes:
        write_pages: ``[num_layers, num_tokens, num_kv_heads]`` int64 page ids.
        write_offsets: ``[num_layers, num_tokens, num_kv_heads]`` int64 slot in page.
    """

    write_pages: torch.Tensor
    write_offsets: torch.Tensor


class PerHeadPagedCache:
    """Page tables, per-head lengths and slot positions for up to ``max_seqs`` sequences."""

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        max_seqs: int,
        max_pages_per_head: int,
        device: torch.device | str = "cpu",
        ops: KernelOps | None = None,
        max_shared_pages_per_head: int = 0,
        identity_rows: bool = False,
        rows_per_page: int = 1,
        metadata: tuple[torch.Tensor, torch.Tensor] | None = None,
        grant_pages: int = 1,
    ) -> None:
        """``ops``: the engine's resolved ops, whose ``fill_page_tables`` :meth:`append`
        uses (None: the backend selected at each call). ``max_shared_pages_per_head``:
        the longest prefix of cached page groups a head may adopt
        (:meth:`reserve_prefix`; 0 without prefix caching). ``identity_rows``: metadata
        in rows carved from pages, ``rows_per_page`` a page (every op the pool runs must
        read rows: ``KernelBackend.meta_rows``; a CPU cache), never-compressing sequences
        on identity rows; ``metadata``: the ``(positions int32, metrics float32)``
        ``[(num_pages + identity_pages_for(max_pages_per_head, rows_per_page)) *
        rows_per_page, block_size]`` views of the pages' bytes (None: tensors of their
        own, e.g. in tests). ``grant_pages``: the group a never-compressing sequence's
        heads are counted in (see the module docstring)."""
        if grant_pages < 1:
            raise ValueError(f"grant_pages must be >= 1, got {grant_pages}")
        self.grant_pages = grant_pages
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_pages_per_head = max_pages_per_head
        self.device = torch.device(device)
        self.ops = ops
        self.allocator = PageAllocator(num_pages, self.device)
        self.tables = ChunkedPageTables(
            num_pages, max_seqs, num_layers, num_kv_heads, max_pages_per_head, self.device,
            shared_pages_per_head=max_shared_pages_per_head,
        )
        self.head_lens = torch.zeros(
            (max_seqs, num_layers, num_kv_heads), dtype=torch.int64, device=self.device
        )
        self.page_meta_row: torch.Tensor | None = None
        self.identity_rows = identity_rows
        if identity_rows:
            self._init_rows(rows_per_page, metadata)
        else:
            self.rows_per_page = 1
            self.slot_positions = torch.full((num_pages, block_size), -1, dtype=torch.int32, device=self.device)
            self.slot_metrics = torch.zeros((num_pages, block_size), dtype=torch.float32, device=self.device)
        # Whether each sequence slot may be compressed (new_sequence's ``compresses``).
        self._compresses = torch.ones(max_seqs, dtype=torch.bool, device=self.device)
        # [max_seqs, L] leading pages each layer's heads gave back (drop_leading_pages):
        # table column c of such a head holds token block c + dropped, whose identity row
        # that is (a sliding-window head of a never-compressing sequence).
        self._dropped_pages = torch.zeros((max_seqs, num_layers), dtype=torch.int64, device=self.device)
        self.page_shares = torch.zeros(num_pages, dtype=torch.int32, device=self.device)
        self._free_seq_slots = list(range(max_seqs - 1, -1, -1))
        # Open slots that never compress: the only ones with spare pages (spare_pages).
        self._plain_slots: set[int] = set()
        # numpy views sharing the CPU tensors' memory: a decode step's append is a few
        # dozen tiny index ops, ~1 us each in numpy against ~5-10 us each as torch ops.
        self.host: HostViews | None = HostViews.of(self) if self.device.type == "cpu" else None
        # Bumped by every method that changes a head's length or pages; a decode plan
        # kept between steps (``cpu_decode_plan.DecodeBatchPlan``) is valid while it holds.
        self.version = 0

    def _init_rows(self, rows_per_page: int, metadata: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Rows carved from pages (``identity_rows``): the identity pages' rows written, the
        per-sequence row pages empty."""
        if self.device.type != "cpu":
            raise ValueError("identity metadata rows are kept on the host (a CPU cache)")
        rows_per_page = int(rows_per_page)
        if rows_per_page < 1:
            raise ValueError(f"rows_per_page must be >= 1, got {rows_per_page}")
        self.rows_per_page = rows_per_page
        num_pages, block_size = self.allocator.num_pages, self.block_size
        self.identity_pages = identity_pages_for(self.max_pages_per_head, rows_per_page)
        self.identity_row0 = num_pages * rows_per_page
        num_rows = (num_pages + self.identity_pages) * rows_per_page
        if metadata is None:
            metadata = (torch.zeros((num_rows, block_size), dtype=torch.int32),
                        torch.zeros((num_rows, block_size), dtype=torch.float32))
        positions, metrics = metadata
        if positions.shape != (num_rows, block_size) or metrics.shape != (num_rows, block_size):
            raise ValueError(f"metadata rows must be [{num_rows}, {block_size}], got "
                             f"{tuple(positions.shape)} and {tuple(metrics.shape)}")
        if positions.dtype != torch.int32 or metrics.dtype != torch.float32:
            raise ValueError(f"metadata rows must be int32 / float32, got {positions.dtype} / {metrics.dtype}")
        self.slot_positions, self.slot_metrics = positions, metrics
        identity = slice(self.identity_row0, self.identity_row0 + self.max_pages_per_head)
        self.slot_positions[identity] = torch.arange(
            self.max_pages_per_head * block_size, dtype=torch.int32).view(-1, block_size)
        self.slot_metrics[identity] = 0.0
        self.page_meta_row = torch.full((num_pages,), self.identity_row0, dtype=torch.int32)
        # Per sequence slot: its row pages (the first ceil(rows_used / R) entries) and
        # the rows its own pages use, packed from row 0.
        max_row_pages = -(-self.num_layers * self.num_kv_heads * self.max_pages_per_head // rows_per_page)
        self.row_pages = torch.zeros((self.max_seqs, max_row_pages), dtype=torch.int64)
        self.rows_used = torch.zeros(self.max_seqs, dtype=torch.int64)
        # Columns below which a slot's new pages read identity rows (expect_identity_columns).
        self.identity_below = np.zeros(self.max_seqs, np.int64)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def row_pages_held(self, seq_slots) -> np.ndarray:
        """Metadata pages each of ``seq_slots`` (host ints) holds (0 without rows)."""
        slots = np.asarray(seq_slots, dtype=np.int64)
        if not self.identity_rows:
            return np.zeros(slots.shape, np.int64)
        return -(-self.rows_used.numpy()[slots] // self.rows_per_page)

    def meta_slots(self, pages: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Flat metadata slots (``row * b + offset``) of KV slots ``(pages, offsets)``
        (numpy, any shape; a CPU cache)."""
        rows = pages if self.page_meta_row is None else self.page_meta_row.numpy()[pages]
        return rows * self.block_size + offsets

    @staticmethod
    def metadata_bytes(
        num_pages: int, num_layers: int, num_kv_heads: int, block_size: int, max_seqs: int,
        max_pages_per_head: int, max_shared_pages_per_head: int = 0, identity_rows: bool = False,
        rows_per_page: int = 1,
    ) -> int:
        """Bytes of the tensors a cache of these dimensions allocates besides its pages: the
        two-level page tables (:meth:`ChunkedPageTables.nbytes_for`), head lengths (int64
        per sequence slot and head), the allocator's free stack (int64 per page), the
        page shares (int32 per page), and the slot positions and metrics (int32 +
        float32 per slot); with ``identity_rows`` those are carved from pages (the
        identity pages and each compressing sequence's row pages, out of the pool) and
        what is left is the page-to-row map (int32 per page), each slot's row-page list
        (int64 per possible row page), its rows used and dropped pages per layer. The
        engine takes them out of the KV memory budget."""
        heads = max_seqs * num_layers * num_kv_heads
        tables = ChunkedPageTables.nbytes_for(
            num_pages, max_seqs, num_layers, num_kv_heads, max_pages_per_head, max_shared_pages_per_head
        )
        if identity_rows:
            row_pages = -(-num_layers * num_kv_heads * max_pages_per_head // rows_per_page)
            rows = num_pages * 4 + max_seqs * (row_pages * 8 + 8 + num_layers * 8)
        else:
            rows = num_pages * block_size * SLOT_METADATA_BYTES
        return tables + heads * 8 + num_pages * (8 + 4) + rows

    def kv_pool(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> KVPool:
        """The pool the ops take: ``key_cache`` / ``value_cache`` ``[num_buffer_pages,
        block_size, head_dim]`` (views of the KV buffer) with this cache's slot
        positions and metrics (and its ``page_meta_row``)."""
        return KVPool(key_cache, value_cache, self.slot_positions, self.slot_metrics, self.page_meta_row)

    def new_sequence(self, compresses: bool = True) -> int:
        """Reserve an empty sequence slot; ``compresses``: whether the sequence may ever be
        compressed (False: its pages read the identity rows, and
        :func:`~kvcompress.ops.compress.compress_sequences` refuses it)."""
        if not self._free_seq_slots:
            raise RuntimeError(f"all {self.max_seqs} sequence slots are in use")
        slot = self._free_seq_slots.pop()
        self._compresses[slot] = compresses
        if not compresses:
            self._plain_slots.add(slot)
        self._dropped_pages[slot] = 0
        if self.identity_rows:
            self.rows_used[slot] = 0
            self.identity_below[slot] = 0
        return slot

    def metadata_by_page(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, metrics)`` ``[num_pages, b]``: each page's metadata read through
        its row (a copy with identity rows; dumps and tests)."""
        if self.page_meta_row is None:
            return self.slot_positions, self.slot_metrics
        rows = self.page_meta_row.to(torch.int64)
        return self.slot_positions[rows], self.slot_metrics[rows]

    def compresses(self, seq_slots) -> np.ndarray:
        """Whether each of ``seq_slots`` (host ints) was opened to be compressed."""
        return self._compresses.cpu().numpy()[np.asarray(seq_slots, dtype=np.int64)]

    def _map_rows(
        self, seq_slots: torch.Tensor, layers: torch.Tensor, pages: torch.Tensor, columns: torch.Tensor,
    ) -> None:
        """Rows of pages just placed at table ``columns`` of heads of ``seq_slots`` /
        ``layers`` (same shapes): the page's own row, or for a never-compressing sequence
        the identity row of its token block (the column past the layer's dropped pages)."""
        if not self.identity_rows or pages.numel() == 0:
            return
        self._map_rows_host(seq_slots.to(torch.int64).numpy(), layers.to(torch.int64).numpy(),
                            pages.to(torch.int64).numpy(), columns.to(torch.int64).numpy())

    def _map_rows_host(self, slots: np.ndarray, layers: np.ndarray, pages: np.ndarray, columns: np.ndarray) -> None:
        """:meth:`_map_rows` on numpy ``[K]`` int64 arrays (pages in table order per slot)."""
        rows = self._identity_rows_of(slots, layers, columns)
        compressing = self._compresses.numpy()[slots] & (columns >= self.identity_below[slots])
        if compressing.any():
            rows[compressing] = self._own_rows(slots[compressing])
        self.page_meta_row.numpy()[pages] = rows

    def _identity_rows_of(self, slots: np.ndarray, layers: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """Identity rows of table ``columns`` of heads of ``slots`` / ``layers`` (numpy, same
        shapes): their token blocks' (the column past the layer's dropped pages)."""
        return self.identity_row0 + columns + self._dropped_pages.numpy()[slots, layers]

    def _own_rows(self, slots: np.ndarray) -> np.ndarray:
        """Rows for new own pages of compressing ``slots`` (``[K]``, one entry per page, in
        order): each slot's next rows, its row pages grown from the allocator as needed."""
        order = np.argsort(slots, kind="stable")
        ordered = slots[order]
        owners, first, counts = np.unique(ordered, return_index=True, return_counts=True)
        per_page = self.rows_per_page
        used = self.rows_used.numpy()
        row_pages = self.row_pages.numpy()
        before = used[owners]
        have, need = -(-before // per_page), -(-(before + counts) // per_page)
        extra = need - have
        total = int(extra.sum())
        if total:
            taken = self.allocator.allocate(total).numpy()
            start = np.cumsum(extra) - extra
            column = np.repeat(have - start, extra) + np.arange(total)
            row_pages[np.repeat(owners, extra), column] = taken
        used[owners] = before + counts
        index = np.repeat(before, counts) + np.arange(ordered.shape[0]) - np.repeat(first, counts)
        rows = np.empty_like(slots)
        rows[order] = row_pages[ordered, index // per_page] * per_page + index % per_page
        return rows

    def _repack_rows(self, seq_slots) -> None:
        """Pack the own rows of compressing ``seq_slots`` (host ints) into their first
        ``ceil(own pages / R)`` row pages (in table order) and free the rest: after any
        change that took pages from them."""
        if not self.identity_rows:
            return
        per_page = self.rows_per_page
        meta_row = self.page_meta_row.numpy()
        row_pages, used = self.row_pages.numpy(), self.rows_used.numpy()
        compressing = self._compresses.numpy()
        for slot in np.unique(np.asarray(seq_slots, dtype=np.int64)).tolist():
            if not compressing[slot] or used[slot] == 0:
                continue
            held = pages_for(self.head_lens[slot], self.block_size)  # [L, H]
            tables = self.tables.gather(torch.tensor([slot]), max(1, int(held.max())))[0]
            in_use = torch.arange(tables.shape[-1]) < held.unsqueeze(-1)
            pages = tables[in_use].to(torch.int64).numpy()
            old_rows = meta_row[pages].astype(np.int64)
            own = old_rows < self.identity_row0
            pages, old_rows = pages[own], old_rows[own]
            count = pages.shape[0]
            index = np.arange(count)
            new_rows = row_pages[slot, index // per_page] * per_page + index % per_page
            moved = new_rows != old_rows
            if moved.any():
                source = torch.from_numpy(old_rows[moved])
                target = torch.from_numpy(new_rows[moved])
                self.slot_positions[target] = self.slot_positions[source]  # gathered first
                self.slot_metrics[target] = self.slot_metrics[source]
                meta_row[pages[moved]] = new_rows[moved]
            keep, had = -(-count // per_page), -(-int(used[slot]) // per_page)
            if had > keep:
                self.allocator.free(torch.from_numpy(row_pages[slot, keep:had].copy()))
            used[slot] = count

    def expect_identity_columns(self, slot: int, end_column: int) -> None:
        """``slot``'s pages at columns below ``end_column`` that are appended from now on
        read identity rows (the prefix cache takes them after this step's appends:
        :meth:`to_identity_rows`), as do those it holds there now, so that it never holds
        a row page for them that the scheduler no longer counts."""
        if not self.identity_rows:
            return
        self.identity_below[slot] = max(int(self.identity_below[slot]), end_column)
        # The pages it holds there already go now: the scheduler stopped counting their
        # rows when it shared the blocks, before this step's growth.
        held = int(pages_for(self.head_lens[slot].min(), self.block_size))
        self.to_identity_rows(slot, 0, min(end_column, held))

    def to_identity_rows(self, slot: int, first_column: int, end_column: int) -> None:
        """Columns ``[first_column, end_column)`` of ``slot``'s heads (full, uncompressed
        pages, e.g. blocks the prefix cache takes) read their token blocks' identity rows
        from now on; a compressing slot's rows are re-packed without them."""
        if not self.identity_rows or end_column <= first_column:
            return
        self.version += 1
        tables = self.tables.gather(torch.tensor([slot], device=self.device), end_column)[0]
        pages = tables[..., first_column:end_column].to(torch.int64).numpy()  # [L, H, n]
        layers = np.arange(self.num_layers).reshape(-1, 1, 1)
        columns = np.arange(first_column, end_column).reshape(1, 1, -1)
        self.page_meta_row.numpy()[pages] = self._identity_rows_of(np.int64(slot), layers, columns)
        self._repack_rows([slot])

    def page_tables_of(
        self, seq_slots: torch.Tensor, num_pages: int | None = None, layer: int | None = None,
    ) -> torch.Tensor:
        """Flat int32 page ids of the heads of ``seq_slots`` (``[S]``): ``[S, L, H,
        num_pages]`` (``[S, H, num_pages]`` of one ``layer``); ``num_pages`` defaults to
        ``max_pages_per_head``. Columns past a head's pages are garbage."""
        num_pages = self.max_pages_per_head if num_pages is None else num_pages
        return self.tables.gather(seq_slots.to(self.device, torch.int64), num_pages, layer)

    def flat_page_tables(self) -> torch.Tensor:
        """A flat int32 ``[max_seqs, L, H, max_pages_per_head]`` COPY of every slot's page
        ids (tests and dumps; writes to it are lost)."""
        return self.page_tables_of(torch.arange(self.max_seqs, device=self.device))

    def free_tail_pages(self, seq_slots: torch.Tensor, tables: torch.Tensor, new_lens: torch.Tensor) -> int:
        """Shrink the heads of ``seq_slots`` to ``new_lens`` (``[S, L, H]``) KVs: free
        their pages past ``ceil(new_len / b)`` (read from ``tables``, their flat
        ``[S, L, H, >= held pages]`` ids) and the chunks that held only those. Returns
        the number of pages freed."""
        self.version += 1
        old_pages = self.pages_held(seq_slots)
        new_pages = pages_for(new_lens, self.block_size)
        page_index = torch.arange(tables.shape[-1], device=self.device)
        freed = (page_index >= new_pages.unsqueeze(-1)) & (page_index < old_pages.unsqueeze(-1))
        pages_freed = drop_references(tables[freed], self.page_shares, self.allocator)
        self.tables.truncate(seq_slots, old_pages, new_pages)
        self.head_lens[seq_slots] = new_lens
        self._repack_rows(seq_slots.cpu().numpy())
        if self.host is not None:
            self.host.refresh_last_pages(self, seq_slots.numpy())
        return pages_freed

    def drop_leading_pages(self, seq_slots: torch.Tensor, drop_pages: torch.Tensor) -> int:
        """Give back the first ``drop_pages[s, l]`` pages of every head of layer ``l`` of
        sequence slot ``seq_slots[s]`` (``[S]`` int64, ``[S, L]`` int64): a sliding
        window has passed them. The head's other pages move to the front of its table
        (a head whose pages were shared gets chunks of its own), so its slots keep their
        order: KV ``i`` of the head is still its ``i``-th oldest (a window counted in slots
        back from the query stays right); positions and metrics stay with the pages.
        Returns the pages freed (a shared page is freed by its last holder)."""
        self.version += 1
        seq_slots = seq_slots.to(self.device, torch.int64)
        drop = drop_pages.to(self.device, torch.int64).unsqueeze(-1).expand(-1, -1, self.num_kv_heads)
        old_pages = self.pages_held(seq_slots)  # [S, L, H]
        if bool((drop > old_pages).any()) or bool((drop < 0).any()):
            raise ValueError("drop_leading_pages: a head would drop more pages than it holds")
        num_columns = int(old_pages.max()) if old_pages.numel() else 0
        if num_columns == 0 or not bool(drop.any()):
            return 0
        tables = self.tables.gather(seq_slots, num_columns).to(torch.int64)  # [S, L, H, P]
        column = torch.arange(num_columns, device=self.device)
        pages_freed = drop_references(tables[column < drop.unsqueeze(-1)], self.page_shares, self.allocator)
        moved = drop > 0
        # Rebuild the moved heads' rows: their chunks go, their kept pages get new ones.
        self.tables.truncate(seq_slots, torch.where(moved, old_pages, 0), torch.zeros_like(old_pages))
        kept_pages = (old_pages - drop)[moved]  # [M]
        kept = (column >= drop.unsqueeze(-1)) & (column < old_pages.unsqueeze(-1))
        heads = self.num_layers * self.num_kv_heads
        head_rows = seq_slots.view(-1, 1, 1) * heads + torch.arange(heads, device=self.device).view(
            1, self.num_layers, self.num_kv_heads)
        offsets = torch.zeros(kept_pages.numel() + 1, dtype=torch.int64, device=self.device)
        offsets[1:] = torch.cumsum(kept_pages, 0)
        fill = self.ops.fill_page_tables if self.ops is not None else dispatch.fill_page_tables
        self.tables.assign(head_rows[moved], torch.zeros_like(kept_pages), tables[moved][kept[moved]], offsets, fill)
        self.head_lens[seq_slots] -= drop * self.block_size
        self._dropped_pages[seq_slots] += drop[:, :, 0]
        self._repack_rows(seq_slots.cpu().numpy())
        if self.host is not None:
            self.host.refresh_last_pages(self, seq_slots.numpy())
        return pages_freed

    def pages_held(self, seq_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``[S, num_layers, num_kv_heads]`` pages held (all slots when ``None``)."""
        lens = self.head_lens if seq_slots is None else self.head_lens[seq_slots]
        return pages_for(lens, self.block_size)

    def pages_held_per_sequence(self, seq_slots: list[int]) -> list[int]:
        """Pages each of ``seq_slots`` holds over all its heads, its groups' spare pages
        (:meth:`spare_pages`) and its metadata pages (host ints)."""
        if self.host is not None:
            kv = pages_for(self.host.head_lens[seq_slots], self.block_size).sum(axis=(1, 2))
            return (kv + self.spare_pages(seq_slots) + self.row_pages_held(seq_slots)).tolist()
        slots = torch.tensor(seq_slots, dtype=torch.int64, device=self.device)
        kv = self.pages_held(slots).sum(dim=(1, 2)).cpu().numpy()
        return (kv + self.spare_pages(seq_slots) + self.row_pages_held(seq_slots)).tolist()

    def spare_pages(self, seq_slots) -> np.ndarray:
        """Pages each of ``seq_slots`` (host ints) is counted for beyond those its heads
        hold: the unreached pages of a never-compressing sequence's last groups of
        ``grant_pages``, ``g * ceil(p / g) - p`` a head (0 with groups of 1)."""
        slots = np.asarray(seq_slots, dtype=np.int64)
        if self.grant_pages == 1:
            return np.zeros(slots.shape, np.int64)
        return np.where(self._compresses.cpu().numpy()[slots], 0, self._group_spare(slots))

    def _group_spare(self, slots: np.ndarray) -> np.ndarray:
        """``[S]`` unreached pages of the last groups of ``grant_pages`` of every head of
        ``slots`` (``[S]`` int64), as if none compressed."""
        lens = self.host.head_lens[slots] if self.host is not None else self.head_lens.cpu().numpy()[slots]
        return (-pages_for(lens, self.block_size) % self.grant_pages).sum(axis=(1, 2))

    def counted_free_pages(self) -> int:
        """Free pages as the scheduler counts them: the free stack less every sequence's
        spare pages (:meth:`spare_pages`; read every step, so only the open slots that
        never compress are summed)."""
        free = self.allocator.num_free
        if self.grant_pages == 1 or not self._plain_slots:
            return free
        return free - int(self._group_spare(np.fromiter(self._plain_slots, np.int64, len(self._plain_slots))).sum())

    def release(self, seq_slots: torch.Tensor) -> int:
        """Let go of every page of the given sequence slots and return the slots.

        Returns the number of pages freed (a shared page is freed by its last holder).
        """
        seq_slots = seq_slots.to(self.device, torch.int64)
        if seq_slots.numel() == 0:
            return 0
        self.version += 1
        held = self.pages_held(seq_slots)  # [S, L, H]
        num_pages = int(held.max())
        pages = held.new_zeros(0)
        if num_pages:
            in_use = torch.arange(num_pages, device=self.device) < held.unsqueeze(-1)  # [S, L, H, P]
            pages = self.tables.gather(seq_slots, num_pages)[in_use]
            freed = drop_references(pages, self.page_shares, self.allocator)
            self.tables.truncate(seq_slots, held, torch.zeros_like(held))
        else:
            freed = 0
        self.head_lens[seq_slots] = 0
        if self.identity_rows:
            freed += self._release_row_pages(seq_slots.cpu().numpy())
        released = seq_slots.tolist()
        self._plain_slots.difference_update(released)
        self._free_seq_slots.extend(released)
        return freed

    def _release_row_pages(self, slots: np.ndarray) -> int:
        """Free every row page of ``slots``; returns how many."""
        held = self.row_pages_held(slots)
        if not held.any():
            return 0
        columns = np.arange(self.row_pages.shape[1])
        taken = self.row_pages.numpy()[slots][columns < held[:, None]]
        self.allocator.free(torch.from_numpy(taken))
        self.rows_used.numpy()[slots] = 0
        return int(taken.shape[0])

    def share_prefix(self, dst_slot: int, src_slot: int, num_pages: int) -> None:
        """Give the empty sequence slot ``dst_slot`` the first ``num_pages`` pages of every
        head of ``src_slot`` (``num_pages * block_size`` KVs per head), shared: one more
        holder per page, nothing copied but the page ids.

        Those pages must be full and uncompressed in ``src_slot`` (slot ``i`` of column
        ``j`` holds position ``j * block_size + i``), which is what a prefix-cache hit
        reuses; ``dst_slot`` then appends its own tokens after them.
        """
        if num_pages <= 0:
            return
        self.version += 1
        self._check_pages_per_head(num_pages)
        kvs = num_pages * self.block_size
        if int(self.head_lens[dst_slot].max()) != 0:
            raise ValueError(f"share_prefix: sequence slot {dst_slot} is not empty")
        if int(self.head_lens[src_slot].min()) < kvs:
            raise ValueError(f"share_prefix: a head of slot {src_slot} holds fewer than {kvs} KVs")
        self.to_identity_rows(src_slot, 0, num_pages)  # dst may outlive src's rows
        self.tables.share_prefix(self._head_rows(dst_slot), self._head_rows(src_slot), num_pages)
        pages = self.tables.gather(torch.tensor([src_slot], device=self.device), num_pages)
        add_references(pages, self.page_shares)
        self.head_lens[dst_slot] = kvs
        if self.host is not None:
            self.host.refresh_last_pages(self, np.array([dst_slot]))

    def _head_rows(self, slot: int) -> torch.Tensor:
        """``[L*H]`` rows of ``slot``'s heads in the flat page tables."""
        heads = self.num_layers * self.num_kv_heads
        return slot * heads + torch.arange(heads, device=self.device)

    def reserve_prefix(self, slot: int, num_pages: int) -> None:
        """Make the empty sequence slot ``slot`` start with ``num_pages`` pages per head
        (``num_pages * block_size`` KVs) whose page ids :meth:`fill_prefix` writes later,
        before anything reads them; appends go after them meanwhile. A prefix-cache hit
        reserves, the step's appends run, then the hit's page groups are filled in (a
        group may be one this very step's appends created)."""
        if num_pages <= 0:
            return
        self.version += 1
        self._check_pages_per_head(num_pages)
        if int(self.head_lens[slot].max()) != 0:
            raise ValueError(f"reserve_prefix: sequence slot {slot} is not empty")
        self.tables.reserve(self._head_rows(slot), num_pages)
        self.head_lens[slot] = num_pages * self.block_size

    def fill_prefix(self, slot: int, pages: torch.Tensor) -> None:
        """Point the first ``n`` columns of every head of ``slot`` (reserved by
        :meth:`reserve_prefix`) at ``pages`` (``[n, L, H]`` page ids: full, uncompressed
        blocks of the same tokens), one more holder each."""
        num_pages = pages.shape[0]
        if num_pages <= 0:
            return
        self.version += 1
        if int(self.head_lens[slot].min()) < num_pages * self.block_size:
            raise ValueError(f"fill_prefix: slot {slot} reserved fewer than {num_pages} pages")
        columns = pages.to(self.device).reshape(num_pages, -1).T  # [L*H, n]
        self.tables.write_columns(self._head_rows(slot), columns)
        add_references(columns, self.page_shares)
        if self.host is not None:
            self.host.refresh_last_pages(self, np.array([slot]))

    def append(
        self,
        seq_slots: torch.Tensor,
        num_new_tokens: torch.Tensor,
        positions: torch.Tensor,
    ) -> AppendPlan:
        """Grow every head of each sequence by its new tokens and place their KVs.

        Args:
            seq_slots: ``[S]`` int64 sequence slots, in batch order.
            num_new_tokens: ``[S]`` int64 tokens appended per sequence this step.
            positions: ``[T]`` token positions of the new tokens, ``T = sum(num_new_tokens)``,
                sequences concatenated in batch order.

        Returns:
            The physical (page, offset) of every new token's KV per (layer, head).
        """
        device = self.device
        seq_slots = seq_slots.to(device, torch.int64)
        num_new_tokens = num_new_tokens.to(device, torch.int64)
        if positions.numel() == seq_slots.numel() and bool((num_new_tokens == 1).all()):
            return self.append_one(seq_slots, positions)
        return self._append_tokens(seq_slots, num_new_tokens, positions)

    def _append_tokens(
        self, seq_slots: torch.Tensor, num_new_tokens: torch.Tensor, positions: torch.Tensor
    ) -> AppendPlan:
        """:meth:`append` for any token counts (``seq_slots`` / ``num_new_tokens`` int64 on
        the cache's device)."""
        self.version += 1
        device = self.device
        block_size = self.block_size
        old_lens = self.head_lens[seq_slots]  # [S, L, H]
        new_lens = old_lens + num_new_tokens.view(-1, 1, 1)
        old_pages = pages_for(old_lens, block_size)
        new_pages = pages_for(new_lens, block_size)
        self._check_pages_per_head(int(new_pages.max().item() if new_pages.numel() else 0))
        demand = (new_pages - old_pages).reshape(-1)  # [S*L*H]
        pages, offsets = self.allocator.allocate_for(demand)
        if pages.numel():
            num_heads_total = self.num_layers * self.num_kv_heads
            rows = (
                seq_slots.repeat_interleave(num_heads_total) * num_heads_total
                + torch.arange(num_heads_total, device=device).repeat(seq_slots.numel())
            )
            # CUDA extension's one-kernel fill where built, else the reference.
            fill = self.ops.fill_page_tables if self.ops is not None else dispatch.fill_page_tables
            self.tables.assign(rows, old_pages.reshape(-1), pages, offsets, fill)
            if self.page_meta_row is not None:
                head, column = page_columns(old_pages.reshape(-1), offsets, pages.numel())
                layer = rows[head] % num_heads_total // self.num_kv_heads
                self._map_rows(rows[head] // num_heads_total, layer, pages, column)
        self.head_lens[seq_slots] = new_lens
        if self.host is not None:
            self.host.refresh_last_pages(self, seq_slots.numpy())

        # Token t of sequence s lands at index old_len[s, l, h] + (t - start[s]).
        token_seq = torch.repeat_interleave(
            torch.arange(seq_slots.numel(), device=device), num_new_tokens
        )  # [T]
        starts = torch.cumsum(num_new_tokens, 0) - num_new_tokens
        token_index = torch.arange(token_seq.numel(), device=device) - starts[token_seq]
        head_index = old_lens[token_seq] + token_index.view(-1, 1, 1)  # [T, L, H]
        return self._place(
            seq_slots[token_seq], head_index // block_size, head_index % block_size, positions
        )

    def _check_pages_per_head(self, pages: int) -> None:
        if pages > self.max_pages_per_head:
            raise RuntimeError(
                f"a head would need more than {self.max_pages_per_head} pages "
                "(longer than max_model_len)"
            )

    def _place(
        self, token_slots: torch.Tensor, page_column: torch.Tensor, write_offsets: torch.Tensor,
        positions: torch.Tensor,
    ) -> AppendPlan:
        """Where each new token's KVs go, its slots' positions recorded and metrics zeroed.

        Args:
            token_slots: ``[T]`` sequence slot of each new token.
            page_column, write_offsets: ``[T, L, H]`` page index within the head and slot
                within the page of each (token, layer, head).
            positions: ``[T]`` the tokens' positions.
        """
        # One page id per (token, layer, head), read in place: no [T, L, H, P] gather.
        write_pages = self.tables.lookup(
            token_slots.view(-1, 1, 1),
            torch.arange(self.num_layers, device=self.device).view(1, -1, 1),
            torch.arange(self.num_kv_heads, device=self.device).view(1, 1, -1),
            page_column,
        )
        rows = write_pages if self.page_meta_row is None else self.page_meta_row[write_pages].long()
        self.slot_positions[rows, write_offsets] = (
            positions.to(self.device, torch.int32).view(-1, 1, 1).expand_as(write_pages)
        )
        self.slot_metrics[rows, write_offsets] = 0.0
        return AppendPlan(
            write_pages=write_pages.permute(1, 0, 2).contiguous(),
            write_offsets=write_offsets.permute(1, 0, 2).contiguous(),
        )

    def append_one(
        self, seq_slots: torch.Tensor, positions: torch.Tensor, host_slots: np.ndarray | None = None,
    ) -> AppendPlan:
        """:meth:`append` of ONE token per sequence (a decode step), in fewer ops: a head
        takes a new page only when its last one is full.

        Args:
            seq_slots: ``[S]`` int64 sequence slots, in batch order.
            positions: ``[S]`` the new tokens' positions.
            host_slots: the same slots as a numpy int64 array, if the caller has it
                (a CPU cache then skips a conversion).
        """
        self.version += 1
        if self.host is not None:
            slots = seq_slots.to(torch.int64).numpy() if host_slots is None else host_slots
            return self._append_one_host(slots, positions)
        block_size = self.block_size
        old_lens = self.head_lens.index_select(0, seq_slots)  # [S, L, H]
        page_column = old_lens // block_size
        write_offsets = old_lens - page_column * block_size
        starts_page = write_offsets == 0
        count = int(starts_page.sum())
        if count:
            columns = page_column[starts_page]
            self._check_pages_per_head(int(columns.max()) + 1)
            rows, layers, heads = starts_page.nonzero(as_tuple=True)
            new_pages = self.allocator.allocate(count)
            self.tables.assign_one(seq_slots[rows], layers, heads, columns, new_pages)
            self._map_rows(seq_slots[rows], layers, new_pages, columns)
        self.head_lens[seq_slots] = old_lens + 1
        return self._place(seq_slots, page_column, write_offsets, positions)

    def take_last_pages_host(
        self, slots: np.ndarray, layers: np.ndarray, heads: np.ndarray, columns: np.ndarray,
    ) -> np.ndarray:
        """A new page at column ``columns[k]`` of head ``(slots[k], layers[k], heads[k])``
        (each head's next column, its last page being full), taken from the allocator in
        the order given; it becomes that head's last page. CPU cache (numpy); ``[K]``
        int64 arrays. Returns the ``[K]`` page ids. (A decode append's part: the caller
        bumps :attr:`version` or keeps its own plan of these heads.)"""
        self._check_pages_per_head(int(columns.max()) + 1)
        pages = self.allocator.allocate(slots.shape[0]).numpy()
        self.tables.assign_one_host(slots, layers, heads, columns, pages)
        self.host.last_pages[slots, layers, heads] = pages
        if self.identity_rows:
            self._map_rows_host(slots, layers, pages, columns)
        return pages

    def _append_one_host(self, slots: np.ndarray, positions: torch.Tensor) -> AppendPlan:
        """:meth:`append_one` on a CPU cache through its numpy views (same result;
        ``slots`` ``[S]`` int64)."""
        host = self.host
        old_lens = host.head_lens[slots]  # [S, L, H]
        page_column, write_offsets = np.divmod(old_lens, self.block_size)
        write_pages = host.last_pages[slots]  # [S, L, H], a copy
        starts_page = write_offsets == 0
        count = int(np.count_nonzero(starts_page))
        if count:
            rows, layers, heads = np.nonzero(starts_page)
            write_pages[starts_page] = self.take_last_pages_host(
                slots[rows], layers, heads, page_column[starts_page],
            )
        host.head_lens[slots] = old_lens + 1
        host.place(self.meta_slots(write_pages, write_offsets), positions.numpy()[:, None, None])
        return AppendPlan(
            write_pages=torch.from_numpy(np.ascontiguousarray(write_pages.transpose(1, 0, 2))),
            write_offsets=torch.from_numpy(np.ascontiguousarray(write_offsets.transpose(1, 0, 2))),
        )
