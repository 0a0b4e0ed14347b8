"""Scheduler-side page accounting of the per-(layer, KV head) cache (no vLLM import).

vLLM's scheduler thinks in token blocks shared by all layers and heads; here a
request holds ``sum over (layer, head) of ceil(head_len / block_size)`` pages. The
scheduler asks ``pages_to_grow`` before admitting or extending a request and
``grow``/``release`` when it does. Everything is numpy over
``[requests, layers, kv_heads]``; page ids live only on the worker, which runs the
same arithmetic on the device (so both sides agree on counts without talking).

With tensor parallelism (``num_ranks`` T > 1) the KV heads are split over T ranks,
rank r holding heads ``[r*H_r, (r+1)*H_r)`` of every layer in its own pool of
``num_pages`` pages: the T pools are separate resources, so pages are counted per
rank (``pages_held_per_row[:, r]``, ``free_pages[r]``) and a request fits only when
every rank has the pages its heads there need (:meth:`shortfall`). With T = 1 every
per-rank array has one column and the counts are those of the single pool.

With prefix caching a cached token block is a *page group*: its ``L x H`` pages (``L x
H_r`` on each rank) belong to the prefix cache, counted once (:meth:`cache_groups`)
however many requests hold it; a request's first ``shared_blocks`` token blocks are
such groups (hits, or its own blocks the cache took) and only its pages past them
are its own.

With ``rows_per_page`` (the CPU engine's cache, docs/design-61-metadata-rows.md), a
request that compresses (:meth:`PageAccounting.note_compresses`) also holds the pages its
own pages' slot positions and metrics are carved from: ``ceil(own / rows_per_page)`` per
rank (:func:`row_pages_for`), which the worker's cache keeps packed by the same formula;
a request that never compresses holds none (its pages read shared identity rows).

With ``grant_pages`` g > 1 (the CPU engine: stock vLLM's 128-token block over 64-token
pages), a request that never compresses is counted as holding each head's pages g at a time,
``g * ceil(ceil(len / b) / g)`` (:func:`counted_pages`): its admission and preemption then
happen when stock vLLM's would, a request that never compresses costing what it costs
there. The worker's cache counts the same (``PerHeadPagedCache(grant_pages=)``): the pages
a head's group has not reached yet stay on its free stack but are reported as held.
"""

from __future__ import annotations

import numpy as np


def row_pages_for(own_pages, rows_per_page: int | None):
    """Metadata pages a compressing request holds for ``own_pages`` pages of its own (an
    int or an int64 array, per rank): ``ceil(own / rows_per_page)``; 0 without rows."""
    if rows_per_page is None:
        return own_pages * 0
    return -(-own_pages // rows_per_page)


def counted_pages(pages, grant_pages: int, compresses=True):
    """Pages a head holding ``pages`` pages is counted for (ints or int64 arrays): as many
    for a request that ``compresses`` (broadcast against ``pages``), else rounded up to
    whole groups of ``grant_pages``."""
    if grant_pages == 1:
        return pages
    grouped = -(-pages // grant_pages) * grant_pages
    return np.where(compresses, pages, grouped)


def live_sequence_limit(num_pages: int, pages_per_token_block: int, max_num_seqs: int) -> int:
    """Sequences that may hold pages at once in a pool of ``num_pages`` pages (one TP
    rank's), ``pages_per_token_block`` (``L x H`` of that rank) pages per token block:
    ``max_num_seqs``, or fewer where the pool cannot give that many sequences one page
    per (layer, KV head) each.

    A sequence that has run a step owns at least one page in every head, the page of
    its newest KV (prefix-cache hits are whole blocks before it), so more live
    sequences than ``num_pages // (L x H)`` cannot exist in practice; the engine sizes
    its per-sequence tables (page tables, head lengths) for this many and the scheduler
    admits no more (``KVCompressScheduler``), so the bound holds even where heads are
    compressed to nothing. Never below 1.
    """
    return max(1, min(max_num_seqs, num_pages // max(1, pages_per_token_block)))


def cache_sequence_slots(num_pages: int, pages_per_token_block: int, max_num_seqs: int) -> int:
    """Sequence slots of a per-head cache over that pool: the :func:`live_sequence_limit`
    sequences and the padding rows' empty slot (one more)."""
    return live_sequence_limit(num_pages, pages_per_token_block, max_num_seqs) + 1


class PageAccounting:
    """Counts pages per request and in the pool.

    Attributes:
        head_lens: ``[max_requests, num_layers, num_kv_heads]`` int64 KVs per head
            (``num_kv_heads`` over all ranks, rank-major).
        pages_held_per_row: ``[max_requests, num_ranks]`` int64 pages each request's
            heads hold in each rank's pool.
        free_pages: ``[num_ranks]`` int64 free pages of each rank's pool.
        logical_lens: ``[max_requests]`` int64 tokens the request has slots for.
        room: ``[max_requests]`` int64 tokens every head of the request can still take
            without a new page (0 while a compression is pending).

    A decode step grows hundreds of requests by one token each, nearly always inside
    pages they hold: :meth:`fits_in_room` / :meth:`grow_in_room` grant that with two dict operations and
    no array op (``capacity``: the token count each request reaches before a head needs
    a page), and the arrays catch up in one vectorised update the next time anything
    reads them (:meth:`sync`, called by every other method; a request's own page count
    and length need it only when that request has growth pending, so a waiting request
    refused every step costs no sync).
    """

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        max_requests: int = 64,
        num_ranks: int = 1,
        compressible_layers: tuple[int, ...] | None = None,
        layer_windows: tuple[int | None, ...] | None = None,
        rows_per_page: int | None = None,
        grant_pages: int = 1,
    ) -> None:
        """``layer_windows``: each layer's sliding window (tokens; None: full attention),
        whose heads :meth:`drop_behind_windows` shortens (None: no windowed layer).
        ``rows_per_page``: metadata rows a page holds, when compressing requests pay for
        theirs in pages (:func:`row_pages_for`; None: no such pages). ``grant_pages``:
        the group a never-compressing request's heads are counted in (:func:`counted_pages`)."""
        if grant_pages < 1:
            raise ValueError(f"grant_pages must be >= 1, got {grant_pages}")
        if num_ranks < 1 or num_kv_heads % num_ranks:
            raise ValueError(
                f"{num_kv_heads} KV heads cannot be split evenly over {num_ranks} ranks"
            )
        # The layers a compression may shrink (None: all); the others (sliding-window
        # layers) keep every KV, and budgets count only these.
        self.compressible_layers = (
            np.arange(num_layers) if compressible_layers is None else np.asarray(compressible_layers, np.int64)
        )
        windows = [0 if w is None else int(w) for w in (layer_windows or [None] * num_layers)]
        if len(windows) != num_layers or min(windows, default=0) < 0:
            raise ValueError(f"need one window (or None) per layer ({num_layers}), got {layer_windows}")
        self.windows = np.asarray(windows, np.int64)  # [L], 0: full attention
        self.window_layers = np.flatnonzero(self.windows)
        self.num_pages = num_pages  # of each rank's pool
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_ranks = num_ranks
        self.heads_per_rank = num_kv_heads // num_ranks
        self.block_size = block_size
        self.rows_per_page = rows_per_page
        self.grant_pages = grant_pages
        self.free_pages = np.full(num_ranks, num_pages, np.int64)
        self.head_lens = np.zeros((max_requests, num_layers, num_kv_heads), np.int64)
        self.logical_lens = np.zeros(max_requests, np.int64)
        self.pages_held_per_row = np.zeros((max_requests, num_ranks), np.int64)
        self.room = np.zeros(max_requests, np.int64)
        self.pending = np.zeros(max_requests, bool)
        self.num_pending = 0  # pending.sum(), kept as a Python int (read every step)
        self.shared_blocks = np.zeros(max_requests, np.int64)
        # Whether each request compresses (rows_per_page: it then holds metadata pages).
        self.compresses = np.zeros(max_requests, bool)
        self._compressing_ids: set[str] = set()
        # [max_requests, L] leading token blocks each layer's heads gave back (windows only).
        self.dropped_blocks = np.zeros((max_requests, num_layers), np.int64)
        self.cached_groups = 0
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(max_requests - 1, -1, -1))
        # request id -> logical_len + room (absent while pending): the fast path's bound.
        self.capacity: dict[str, int] = {}
        # request id -> logical tokens granted by grow_in_room, not yet in the arrays
        # (the KV manager's decode fast path writes it directly, as grow_in_room does).
        self.deferred_growth: dict[str, int] = {}
        # Bumped by every change to head lengths other than growth (admission, compression,
        # release): readers that may lag decode growth but no other change watch it.
        self.changes = 0

    @property
    def pages_per_token_block(self) -> int:
        """Pages one full token block costs when nothing is evicted (all ranks)."""
        return self.num_layers * self.num_kv_heads

    @property
    def pages_per_token_block_per_rank(self) -> int:
        """The same in one rank's pool."""
        return self.num_layers * self.heads_per_rank

    @property
    def num_free_pages(self) -> int:
        """Free pages over every rank's pool (the one pool's when T = 1)."""
        return int(self.free_pages.sum())

    @property
    def total_pages(self) -> int:
        return self.num_pages * self.num_ranks

    @property
    def num_used_pages(self) -> int:
        return self.total_pages - self.num_free_pages

    def _per_rank(self, pages: np.ndarray) -> np.ndarray:
        """``[..., L, H]`` pages per head -> ``[..., T]`` summed per rank."""
        lead = pages.shape[:-2]
        split = pages.reshape(*lead, self.num_layers, self.num_ranks, self.heads_per_rank)
        return split.sum(axis=(-3, -1))

    def _row(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._free_rows.pop()
            self._row_of[request_id] = row
            self.compresses[row] = self.compresses_of(request_id)
        return row

    def _grow_rows(self) -> None:
        old = self.head_lens.shape[0]
        self.head_lens = np.concatenate([self.head_lens, np.zeros_like(self.head_lens)])
        self.logical_lens = np.concatenate([self.logical_lens, np.zeros(old, np.int64)])
        self.pages_held_per_row = np.concatenate(
            [self.pages_held_per_row, np.zeros_like(self.pages_held_per_row)]
        )
        self.room = np.concatenate([self.room, np.zeros(old, np.int64)])
        self.pending = np.concatenate([self.pending, np.zeros(old, bool)])
        self.shared_blocks = np.concatenate([self.shared_blocks, np.zeros(old, np.int64)])
        self.compresses = np.concatenate([self.compresses, np.zeros(old, bool)])
        self.dropped_blocks = np.concatenate([self.dropped_blocks, np.zeros_like(self.dropped_blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _pages(self, lens: np.ndarray, compresses: np.ndarray | bool) -> np.ndarray:
        """Pages heads ``lens`` (``[..., L, H]``) of requests that ``compresses``
        (``[...]``) are counted for (:func:`counted_pages`)."""
        pages = (lens + self.block_size - 1) // self.block_size
        return counted_pages(pages, self.grant_pages, np.asarray(compresses)[..., None, None])

    def _held(self, lens: np.ndarray, shared: np.ndarray | int, compresses: np.ndarray | bool) -> np.ndarray:
        """``[..., T]`` pages of heads ``lens`` (``[..., L, H]``) past their first
        ``shared`` (``[...]``) pages, which are prefix-cache page groups, and for
        ``compresses`` (``[...]``) requests the metadata pages of those."""
        own = self._own(lens, shared, compresses)
        return own + self._row_pages(own, compresses)

    def _own(self, lens: np.ndarray, shared: np.ndarray | int, compresses: np.ndarray | bool) -> np.ndarray:
        """``[..., T]`` pages of heads ``lens`` past their ``shared`` first ones (no
        metadata pages)."""
        shared = np.asarray(shared, np.int64)[..., None, None]
        return self._per_rank(np.maximum(self._pages(lens, compresses) - shared, 0))

    def _row_pages(self, own: np.ndarray, compresses: np.ndarray | bool) -> np.ndarray:
        """Metadata pages of ``own`` (``[..., T]``) pages of requests that ``compresses``."""
        if self.rows_per_page is None:
            return np.zeros_like(own)
        return np.where(np.asarray(compresses)[..., None], row_pages_for(own, self.rows_per_page), 0)

    def note_compresses(self, request_id: str, compresses: bool) -> None:
        """Whether the request compresses (before it holds pages: with ``rows_per_page``
        its metadata pages depend on it)."""
        if compresses:
            self._compressing_ids.add(request_id)
        else:
            self._compressing_ids.discard(request_id)
        row = self._row_of.get(request_id)
        if row is not None and bool(self.compresses[row]) != compresses:
            if self.pages_held_per_row[row].any():
                raise RuntimeError(f"request {request_id} changed whether it compresses while holding pages")
            self.compresses[row] = compresses

    def compresses_of(self, request_id: str) -> bool:
        """Whether the request compresses (:meth:`note_compresses`)."""
        return request_id in self._compressing_ids

    def _room(self, lens: np.ndarray, compresses: bool) -> int:
        """Tokens every head of ``lens`` can take before one of them needs a page."""
        return int((self._pages(lens, compresses) * self.block_size - lens).min())

    def fits_in_room(self, request_id: str, target_tokens: int) -> bool:
        """Whether the request's heads take ``target_tokens`` logical tokens in the pages
        they hold (False also while a compression is pending or for a new request)."""
        capacity = self.capacity.get(request_id)
        return capacity is not None and target_tokens <= capacity

    def grow_in_room(self, request_id: str, target_tokens: int) -> None:
        """:meth:`grow` when :meth:`fits_in_room` said so: recorded now, applied to the
        arrays by the next :meth:`sync`."""
        deferred = self.deferred_growth
        if target_tokens > deferred.get(request_id, 0):
            deferred[request_id] = target_tokens

    def sync(self) -> None:
        """Apply the growth :meth:`grow_in_room` recorded to the arrays."""
        deferred = self.deferred_growth
        if not deferred:
            return
        row_of = self._row_of
        rows = np.fromiter((row_of[r] for r in deferred), np.int64, len(deferred))
        targets = np.fromiter(deferred.values(), np.int64, len(deferred))
        deferred.clear()
        growth = np.maximum(targets - self.logical_lens[rows], 0)
        self.head_lens[rows] += growth[:, None, None]
        self.logical_lens[rows] += growth
        self.room[rows] -= growth

    def _set_capacity(self, request_id: str, row: int) -> None:
        if self.pending[row]:
            self.capacity.pop(request_id, None)
        else:
            self.capacity[request_id] = int(self.logical_lens[row] + self.room[row])

    def logical_len(self, request_id: str) -> int:
        if request_id in self.deferred_growth:
            self.sync()
        row = self._row_of.get(request_id)
        return 0 if row is None else int(self.logical_lens[row])

    def pages_held(self, request_id: str) -> int:
        """Pages the request's heads hold, over all ranks."""
        row = self._row_of.get(request_id)
        return 0 if row is None else int(self.pages_held_per_row[row].sum())

    def head_lens_of(self, request_id: str) -> np.ndarray:
        """``[num_layers, num_kv_heads]`` copy of the request's per-head lengths."""
        self.sync()
        row = self._row_of.get(request_id)
        if row is None:
            return np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        return self.head_lens[row].copy()

    def pages_to_grow(self, request_id: str, target_tokens: int) -> int:
        """New pages needed, over all ranks, for the request to have slots for
        ``target_tokens`` tokens."""
        return int(self.pages_to_grow_per_rank(request_id, target_tokens).sum())

    def pages_to_grow_per_rank(self, request_id: str, target_tokens: int) -> np.ndarray:
        """``[num_ranks]`` new pages each rank's pool gives for ``target_tokens`` tokens."""
        row = self._row_of.get(request_id)
        if row is None:
            needed = self._pages_per_rank_from_nothing(target_tokens, self.compresses_of(request_id))
            return np.full(self.num_ranks, needed, np.int64)
        if request_id in self.deferred_growth:  # other rows' growth changes no page count
            self.sync()
        growth = target_tokens - int(self.logical_lens[row])
        if growth <= int(self.room[row]):  # also growth <= 0
            return np.zeros(self.num_ranks, np.int64)
        if self.pending[row]:
            return self._pending_growth_bound(growth)
        new_pages = self._held(self.head_lens[row] + growth, self.shared_blocks[row], self.compresses[row])
        return new_pages - self.pages_held_per_row[row]

    def shortfall(self, request_id: str, target_tokens: int, reserve_per_rank: int = 0) -> int:
        """Pages missing on the rank shortest of them for the request to reach
        ``target_tokens`` tokens with ``reserve_per_rank`` pages left free on every
        rank; <= 0: it fits (T = 1: needed + reserve - free)."""
        if self.num_ranks == 1 and request_id not in self._row_of:
            # A waiting request (vLLM asks for one every step while it waits): ints only.
            needed = self._pages_per_rank_from_nothing(target_tokens, self.compresses_of(request_id))
            return needed + reserve_per_rank - int(self.free_pages[0])
        needed = self.pages_to_grow_per_rank(request_id, target_tokens)
        return int((needed + reserve_per_rank - self.free_pages).max())

    def whole_sequence_shortfall(
        self, request_id: str, full_tokens: int, in_flight_tokens: int, reserve_per_rank: int = 0
    ) -> int:
        """:meth:`shortfall` for vLLM's admission gate (``scheduler_reserve_full_isl``:
        the whole sequence must fit before its first chunk is scheduled), counted as
        stock vLLM counts it (``SlidingWindowSpec.max_admission_blocks_per_request``): a
        sliding-window head at most ``ceil((W - 1 + in_flight_tokens) / b) + 1`` pages
        (vLLM's ``max_in_flight_tokens``; +1: the window's first token need not start a
        page), since it gives back its pages behind the window as each step begins
        (:meth:`drop_behind_windows`) and so never holds more under chunked prefill;
        every other head the whole sequence. In pages of ``b`` tokens this is at most
        stock's count in its larger blocks."""
        if not self.window_layers.size:
            return self.shortfall(request_id, full_tokens, reserve_per_rank)
        row = self._row_of.get(request_id)
        if row is not None and self.pending[row]:
            return self.shortfall(request_id, full_tokens, reserve_per_rank)
        if row is None:
            lens = np.zeros((self.num_layers, self.num_kv_heads), np.int64)
            held = np.zeros(self.num_ranks, np.int64)
            growth, shared, compresses = max(full_tokens, 0), 0, self.compresses_of(request_id)
        else:
            self.sync()
            lens, held = self.head_lens[row], self.pages_held_per_row[row]
            growth = max(full_tokens - int(self.logical_lens[row]), 0)
            shared, compresses = self.shared_blocks[row], self.compresses[row]
        peak = lens + growth  # a new array
        layers = self.window_layers
        b = self.block_size
        cap = (b * (-(-(self.windows[layers] - 1 + in_flight_tokens) // b) + 1))[:, None]  # whole pages
        peak[layers] = np.maximum(lens[layers], np.minimum(peak[layers], cap))
        needed = self._held(peak, shared, compresses) - held
        return int((needed + reserve_per_rank - self.free_pages).max())

    def _pages_per_rank_from_nothing(self, target_tokens: int, compresses: bool = False) -> int:
        """Pages each rank's pool gives a request holding none for ``target_tokens``."""
        per_head = int(counted_pages(-(-max(target_tokens, 0) // self.block_size), self.grant_pages, compresses))
        pages = per_head * self.pages_per_token_block_per_rank
        return pages + (row_pages_for(pages, self.rows_per_page) if compresses else 0)

    def _pending_growth_bound(self, growth: int) -> np.ndarray:
        # A head of unknown length needs at most ceil(growth / b) new pages, and k new
        # own pages at most ceil(k / rows_per_page) metadata pages (only compressing
        # requests are ever pending).
        pages = self.pages_per_token_block_per_rank * (-(-growth // self.block_size))
        return np.full(self.num_ranks, pages + row_pages_for(pages, self.rows_per_page), np.int64)

    def grow(self, request_id: str, target_tokens: int) -> int:
        """Extend every head to cover ``target_tokens`` logical tokens; returns pages taken."""
        self.sync()
        is_new = request_id not in self._row_of
        self.changes += is_new
        row = self._row(request_id)
        growth = target_tokens - int(self.logical_lens[row])
        if growth <= 0:
            return 0
        if growth <= int(self.room[row]):  # every head fits in the pages it holds
            self.head_lens[row] += growth
            self.logical_lens[row] = target_tokens
            self.room[row] -= growth
            self._set_capacity(request_id, row)
            return 0
        new_lens = self.head_lens[row] + growth
        if self.pending[row]:
            held = self.pages_held_per_row[row] + self._pending_growth_bound(growth)
        else:
            held = self._held(new_lens, self.shared_blocks[row], self.compresses[row])
        taken = held - self.pages_held_per_row[row]
        if (taken > self.free_pages).any():
            if is_new:  # refused before it held anything: no row
                del self._row_of[request_id]
                self._free_rows.append(row)
            raise RuntimeError(
                f"request {request_id} needs {taken.tolist()} pages per rank, only "
                f"{self.free_pages.tolist()} free (caller skipped pages_to_grow)"
            )
        self.head_lens[row] = new_lens
        self.logical_lens[row] = target_tokens
        self.pages_held_per_row[row] = held
        self.room[row] = 0 if self.pending[row] else self._room(new_lens, self.compresses[row])
        self._set_capacity(request_id, row)
        self.free_pages -= taken
        return int(taken.sum())

    def is_pending(self, request_id: str) -> bool:
        row = self._row_of.get(request_id)
        return row is not None and bool(self.pending[row])

    def mark_compressed(self, request_id: str, evict_blocks) -> None:
        """A compression that frees exactly ``evict_blocks`` pages runs this step: an
        int (T = 1) or one count per rank (with ``rows_per_page``, the metadata pages
        its own pages then no longer need go too)."""
        self.sync()
        row = self._row_of[request_id]
        if self.pending[row]:
            raise RuntimeError(f"request {request_id} is already being compressed")
        evict = np.asarray(evict_blocks, np.int64).reshape(-1)
        if evict.shape != (self.num_ranks,):
            raise ValueError(f"need one page count per rank ({self.num_ranks}), got {evict_blocks}")
        own = self._own(self.head_lens[row], self.shared_blocks[row], True)  # pages, not groups
        if (evict > own).any() or (evict < 0).any():
            raise ValueError(f"cannot evict {evict_blocks} pages from request {request_id}")
        freed = self.pages_held_per_row[row] - (own - evict + self._row_pages(own - evict, self.compresses[row]))
        self.pages_held_per_row[row] -= freed
        self.free_pages += freed
        self.changes += 1
        self.pending[row] = True
        self.num_pending += 1
        self.room[row] = 0
        self.capacity.pop(request_id, None)

    def adopt(self, request_id: str, head_lens: np.ndarray) -> int:
        """Take the worker's per-head lengths after a compression; returns the pages
        the upper-bound charge over-counted (given back to the free pool)."""
        self.sync()
        row = self._row_of.get(request_id)
        if row is None:
            return 0
        held = self._held(np.asarray(head_lens, np.int64), self.shared_blocks[row], self.compresses[row])
        surplus = self.pages_held_per_row[row] - held
        self.changes += 1
        self.head_lens[row] = head_lens
        self.pages_held_per_row[row] = held
        self.num_pending -= int(self.pending[row])
        self.pending[row] = False
        self.room[row] = self._room(self.head_lens[row], self.compresses[row])
        self._set_capacity(request_id, row)
        self.free_pages += surplus
        return int(surplus.sum())

    def pending_request_ids(self) -> list[str]:
        if not self.num_pending:  # every step; compressions are rare
            return []
        return [r for r, row in self._row_of.items() if self.pending[row]]

    def set_head_lens(self, request_id: str, head_lens: np.ndarray) -> int:
        """Shrink heads after eviction; returns pages freed."""
        self.sync()
        row = self._row_of[request_id]
        if np.any(head_lens > self.head_lens[row]):
            raise ValueError("set_head_lens can only shrink heads")
        held = self._held(head_lens, self.shared_blocks[row], self.compresses[row])
        freed = self.pages_held_per_row[row] - held
        self.changes += 1
        self.head_lens[row] = head_lens
        self.pages_held_per_row[row] = held
        self.room[row] = 0 if self.pending[row] else self._room(self.head_lens[row], self.compresses[row])
        self._set_capacity(request_id, row)
        self.free_pages += freed
        return int(freed.sum())

    def drop_behind_windows(self) -> dict[str, np.ndarray]:
        """Give back the leading pages of every sliding-window head that no later query
        of its request sees; returns request id -> ``[num_layers]`` int64 pages each head
        of that layer drops from its front now (0 on other layers), for the requests
        that drop any (the worker's order: ``StepCompression.window_drops``).

        Called as a step starts, before any request grows: a request's next query is at
        its logical length ``q`` (every token with a slot is computed), and it and every
        later one see positions ``>= q - W + 1`` only, so token blocks below that are
        dropped whole. Requests holding prefix-cache page groups, or with a compression
        pending, drop nothing (their columns must keep mapping to token blocks)."""
        if not self.window_layers.size or not self._row_of:
            return {}
        self.sync()
        rows = np.fromiter(self._row_of.values(), np.int64, len(self._row_of))
        layers = self.window_layers
        first_seen = self.logical_lens[rows, None] - self.windows[layers] + 1  # [R, Lw]
        due = np.maximum(first_seen, 0) // self.block_size
        drop = due - self.dropped_blocks[rows[:, None], layers]
        drop[self.pending[rows] | (self.shared_blocks[rows] > 0)] = 0
        dropping = np.flatnonzero((drop > 0).any(axis=1))
        if not dropping.size:
            return {}
        ids = list(self._row_of)
        drops = {}
        for index in dropping.tolist():
            row = int(rows[index])
            by_layer = np.zeros(self.num_layers, np.int64)
            by_layer[layers] = np.maximum(drop[index], 0)
            self.dropped_blocks[row] += by_layer
            self.head_lens[row] -= by_layer[:, None] * self.block_size
            # Every rank's heads of those layers, and the metadata pages they needed.
            held = self._held(self.head_lens[row], self.shared_blocks[row], self.compresses[row])
            freed = self.pages_held_per_row[row] - held
            self.pages_held_per_row[row] = held
            self.free_pages += freed
            # Pages counted in groups: a shorter head may reach its next group sooner.
            self.room[row] = self._room(self.head_lens[row], self.compresses[row])
            self._set_capacity(ids[index], row)
            drops[ids[index]] = by_layer
        self.changes += 1
        return drops

    def release(self, request_id: str) -> int:
        """Forget the request; returns pages freed (over all ranks)."""
        return int(self.release_by_rank(request_id).sum())

    def release_by_rank(self, request_id: str) -> np.ndarray:
        """Forget the request; returns ``[num_ranks]`` pages freed in each rank's pool."""
        self.sync()
        self.capacity.pop(request_id, None)
        self._compressing_ids.discard(request_id)
        row = self._row_of.pop(request_id, None)
        if row is None:
            return np.zeros(self.num_ranks, np.int64)
        freed = self.pages_held_per_row[row].copy()
        self.changes += 1
        self.head_lens[row] = 0
        self.logical_lens[row] = 0
        self.pages_held_per_row[row] = 0
        self.room[row] = 0
        self.num_pending -= int(self.pending[row])
        self.pending[row] = False
        self.shared_blocks[row] = 0
        self.dropped_blocks[row] = 0
        self.compresses[row] = False
        self._free_rows.append(row)
        self.free_pages += freed
        return freed

    def share_blocks(self, request_id: str, num_blocks: int) -> None:
        """The request's first ``num_blocks`` token blocks are prefix-cache page groups
        from now on (blocks it hit, or its own blocks the cache took): their pages stop
        counting as the request's (never fewer than before)."""
        if num_blocks <= self.shared_blocks_of(request_id):
            return
        self.sync()
        row = self._row(request_id)
        old = int(self.shared_blocks[row])
        self.shared_blocks[row] = num_blocks
        if self.pending[row]:  # an upper bound is held: adopt recounts the metadata pages
            moved = self._per_rank(np.clip(self._pages(self.head_lens[row], True), old, num_blocks) - old)
        else:  # the pages and the metadata pages they needed
            moved = self.pages_held_per_row[row] - self._held(self.head_lens[row], num_blocks, self.compresses[row])
        self.pages_held_per_row[row] -= moved
        self.free_pages += moved

    def shared_blocks_of(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        return 0 if row is None else int(self.shared_blocks[row])

    def cache_groups(self, count: int) -> None:
        """The prefix cache took ``count`` page groups (``L x H_r`` pages on each rank)."""
        self.cached_groups += count
        self.free_pages -= count * self.pages_per_token_block_per_rank

    def uncache_groups(self, count: int) -> None:
        """The prefix cache let go of ``count`` page groups nobody else holds."""
        if count > self.cached_groups:
            raise RuntimeError(f"uncaching {count} page groups, {self.cached_groups} cached")
        self.cached_groups -= count
        self.free_pages += count * self.pages_per_token_block_per_rank

    def holds(self, request_id: str) -> bool:
        """Whether the request holds pages (has a row)."""
        return request_id in self._row_of

    def request_ids(self) -> list[str]:
        return list(self._row_of)

    def pages_held_by_request(self, rank: int | None = None) -> dict[str, int]:
        """Pages held by every request in ``rank``'s pool (None: over all ranks; one
        array read, not one per request)."""
        row_of = self._row_of
        rows = np.fromiter(row_of.values(), np.int64, len(row_of))
        held = self.pages_held_per_row[rows]
        held = held.sum(axis=1) if rank is None else held[:, rank]
        return dict(zip(row_of, held.tolist()))

    def check_consistent(self) -> None:
        """Recount held pages from head lengths (vectorised) and compare."""
        self.sync()
        if self.num_pending != int(self.pending.sum()):
            raise AssertionError(f"{self.num_pending} compressions counted pending, {int(self.pending.sum())} marked")
        for request_id, row in self._row_of.items():
            expected = None if self.pending[row] else int(self.logical_lens[row] + self.room[row])
            if self.capacity.get(request_id) != expected:
                raise AssertionError(f"capacity of {request_id} drifted from its room")
        rows = np.fromiter(self._row_of.values(), np.int64, len(self._row_of))
        recount = self._held(self.head_lens[rows], self.shared_blocks[rows], self.compresses[rows])  # [rows, T]
        exact = ~self.pending[rows]
        if not np.array_equal(recount[exact], self.pages_held_per_row[rows][exact]):
            raise AssertionError("per-request page counts drifted from head lengths")
        lens = self.head_lens[rows]
        room = (self._pages(lens, self.compresses[rows]) * self.block_size - lens).min(axis=(1, 2))
        if not np.array_equal(np.where(exact, room, 0), self.room[rows]):
            raise AssertionError("per-request room drifted from head lengths")
        windowed = self.window_layers
        if windowed.size:  # never compressed: each holds its positions past the dropped blocks
            expected_lens = (self.logical_lens[rows, None] - self.dropped_blocks[rows][:, windowed] * self.block_size)
            if not np.array_equal(lens[:, windowed][exact], np.broadcast_to(
                    expected_lens[:, :, None], lens[:, windowed].shape)[exact]):
                raise AssertionError("sliding-window head lengths drifted from logical length - dropped blocks")
        held = self.pages_held_per_row[rows].sum(axis=0)
        cached = self.cached_groups * self.pages_per_token_block_per_rank
        if not np.array_equal(self.num_pages - held - cached, self.free_pages):
            raise AssertionError(
                f"free pages {self.free_pages.tolist()} != pool {self.num_pages} - held "
                f"{held.tolist()} (per rank) - {cached} in cached page groups"
            )
