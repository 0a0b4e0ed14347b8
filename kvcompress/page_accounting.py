"""Scheduler-side page accounting of the per-(layer, KV head) cache (no vLLM import).

vLLM's scheduler thinks in token blocks shared by all layers and heads; here a
request holds ``sum over (layer, head) of ceil(head_len / block_size)`` pages. The
scheduler asks ``pages_to_grow`` before admitting or extending a request and
``grow``/``release`` when it does. Everything is numpy over
``[requests, layers, kv_heads]``; page ids live only on the worker, which runs the
same arithmetic on the device (so both sides agree on counts without talking).
"""

from __future__ import annotations

import numpy as np


class PageAccounting:
    """Counts pages per request and in the pool.

    Attributes:
        head_lens: ``[max_requests, num_layers, num_kv_heads]`` int64 KVs per head.
        logical_lens: ``[max_requests]`` int64 tokens the request has slots for.
        room: ``[max_requests]`` int64 tokens every head of the request can still take
            without a new page (0 while a compression is pending).

    A decode step grows hundreds of requests by one token each, nearly always inside
    pages they hold: :meth:`fits_in_room` / :meth:`grow_in_room` grant that with two dict operations and
    no array op (``capacity``: the token count each request reaches before a head needs
    a page), and the arrays catch up in one vectorised update the next time anything
    reads them (:meth:`sync`, called by every other method).
    """

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        max_requests: int = 64,
    ) -> None:
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.num_free_pages = num_pages
        self.head_lens = np.zeros((max_requests, num_layers, num_kv_heads), np.int64)
        self.logical_lens = np.zeros(max_requests, np.int64)
        self.pages_held_per_row = np.zeros(max_requests, np.int64)
        self.room = np.zeros(max_requests, np.int64)
        self.pending = np.zeros(max_requests, bool)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(max_requests - 1, -1, -1))
        # request id -> logical_len + room (absent while pending): the fast path's bound.
        self.capacity: dict[str, int] = {}
        # request id -> logical tokens granted by grow_in_room, not yet in the arrays.
        self._deferred: dict[str, int] = {}

    @property
    def pages_per_token_block(self) -> int:
        """Pages one full token block costs when nothing is evicted."""
        return self.num_layers * self.num_kv_heads

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def _row(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._free_rows.pop()
            self._row_of[request_id] = row
        return row

    def _grow_rows(self) -> None:
        old = self.head_lens.shape[0]
        self.head_lens = np.concatenate([self.head_lens, np.zeros_like(self.head_lens)])
        self.logical_lens = np.concatenate([self.logical_lens, np.zeros(old, np.int64)])
        self.pages_held_per_row = np.concatenate(
            [self.pages_held_per_row, np.zeros(old, np.int64)]
        )
        self.room = np.concatenate([self.room, np.zeros(old, np.int64)])
        self.pending = np.concatenate([self.pending, np.zeros(old, bool)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _pages(self, lens: np.ndarray) -> np.ndarray:
        return (lens + self.block_size - 1) // self.block_size

    def _room(self, lens: np.ndarray) -> int:
        """Tokens every head of ``lens`` can take before one of them needs a page."""
        return int((self._pages(lens) * self.block_size - lens).min())

    def fits_in_room(self, request_id: str, target_tokens: int) -> bool:
        """Whether the request's heads take ``target_tokens`` logical tokens in the pages
        they hold (False also while a compression is pending or for a new request)."""
        capacity = self.capacity.get(request_id)
        return capacity is not None and target_tokens <= capacity

    def grow_in_room(self, request_id: str, target_tokens: int) -> None:
        """:meth:`grow` when :meth:`fits_in_room` said so: recorded now, applied to the
        arrays by the next :meth:`sync`."""
        deferred = self._deferred
        if target_tokens > deferred.get(request_id, 0):
            deferred[request_id] = target_tokens

    def sync(self) -> None:
        """Apply the growth :meth:`grow_in_room` recorded to the arrays."""
        deferred = self._deferred
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
        self.sync()
        row = self._row_of.get(request_id)
        return 0 if row is None else int(self.logical_lens[row])

    def pages_held(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        return 0 if row is None else int(self.pages_held_per_row[row])

    def head_lens_of(self, request_id: str) -> np.ndarray:
        """``[num_layers, num_kv_heads]`` copy of the request's per-head lengths."""
        self.sync()
        row = self._row_of.get(request_id)
        if row is None:
            return np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        return self.head_lens[row].copy()

    def pages_to_grow(self, request_id: str, target_tokens: int) -> int:
        """New pages needed for the request to have slots for ``target_tokens`` tokens."""
        self.sync()
        row = self._row_of.get(request_id)
        if row is None:
            per_head = -(-max(target_tokens, 0) // self.block_size)
            return per_head * self.pages_per_token_block
        growth = target_tokens - int(self.logical_lens[row])
        if growth <= int(self.room[row]):  # also growth <= 0
            return 0
        if self.pending[row]:
            return self._pending_growth_bound(growth)
        new_pages = int(self._pages(self.head_lens[row] + growth).sum())
        return new_pages - int(self.pages_held_per_row[row])

    def _pending_growth_bound(self, growth: int) -> int:
        # A head of unknown length needs at most ceil(growth / b) new pages.
        return self.pages_per_token_block * (-(-growth // self.block_size))

    def grow(self, request_id: str, target_tokens: int) -> int:
        """Extend every head to cover ``target_tokens`` logical tokens; returns pages taken."""
        self.sync()
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
            held = int(self.pages_held_per_row[row]) + self._pending_growth_bound(growth)
        else:
            held = int(self._pages(new_lens).sum())
        taken = held - int(self.pages_held_per_row[row])
        if taken > self.num_free_pages:
            raise RuntimeError(
                f"request {request_id} needs {taken} pages, only "
                f"{self.num_free_pages} free (caller skipped pages_to_grow)"
            )
        self.head_lens[row] = new_lens
        self.logical_lens[row] = target_tokens
        self.pages_held_per_row[row] = held
        self.room[row] = 0 if self.pending[row] else self._room(new_lens)
        self._set_capacity(request_id, row)
        self.num_free_pages -= taken
        return taken

    def is_pending(self, request_id: str) -> bool:
        row = self._row_of.get(request_id)
        return row is not None and bool(self.pending[row])

    def mark_compressed(self, request_id: str, evict_blocks: int) -> None:
        """A compression that frees exactly ``evict_blocks`` pages runs this step."""
        self.sync()
        row = self._row_of[request_id]
        if self.pending[row]:
            raise RuntimeError(f"request {request_id} is already being compressed")
        if evict_blocks > int(self.pages_held_per_row[row]):
            raise ValueError(f"cannot evict {evict_blocks} pages from request {request_id}")
        self.pages_held_per_row[row] -= evict_blocks
        self.num_free_pages += evict_blocks
        self.pending[row] = True
        self.room[row] = 0
        self.capacity.pop(request_id, None)

    def adopt(self, request_id: str, head_lens: np.ndarray) -> int:
        """Take the worker's per-head lengths after a compression; returns the pages
        the upper-bound charge over-counted (given back to the free pool)."""
        self.sync()
        row = self._row_of.get(request_id)
        if row is None:
            return 0
        held = int(self._pages(np.asarray(head_lens, np.int64)).sum())
        surplus = int(self.pages_held_per_row[row]) - held
        self.head_lens[row] = head_lens
        self.pages_held_per_row[row] = held
        self.pending[row] = False
        self.room[row] = self._room(self.head_lens[row])
        self._set_capacity(request_id, row)
        self.num_free_pages += surplus
        return surplus

    def pending_request_ids(self) -> list[str]:
        if not self.pending.any():  # every step; compressions are rare
            return []
        return [r for r, row in self._row_of.items() if self.pending[row]]

    def set_head_lens(self, request_id: str, head_lens: np.ndarray) -> int:
        """Shrink heads after eviction; returns pages freed."""
        self.sync()
        row = self._row_of[request_id]
        if np.any(head_lens > self.head_lens[row]):
            raise ValueError("set_head_lens can only shrink heads")
        held = int(self._pages(head_lens).sum())
        freed = int(self.pages_held_per_row[row]) - held
        self.head_lens[row] = head_lens
        self.pages_held_per_row[row] = held
        self.room[row] = 0 if self.pending[row] else self._room(self.head_lens[row])
        self._set_capacity(request_id, row)
        self.num_free_pages += freed
        return freed

    def release(self, request_id: str) -> int:
        """Forget the request; returns pages freed."""
        self.sync()
        self.capacity.pop(request_id, None)
        row = self._row_of.pop(request_id, None)
        if row is None:
            return 0
        freed = int(self.pages_held_per_row[row])
        self.head_lens[row] = 0
        self.logical_lens[row] = 0
        self.pages_held_per_row[row] = 0
        self.room[row] = 0
        self.pending[row] = False
        self._free_rows.append(row)
        self.num_free_pages += freed
        return freed

    def request_ids(self) -> list[str]:
        return list(self._row_of)

    def pages_held_by_request(self) -> dict[str, int]:
        """Pages held by every request (one array read, not one per request)."""
        row_of = self._row_of
        rows = np.fromiter(row_of.values(), np.int64, len(row_of))
        return dict(zip(row_of, self.pages_held_per_row[rows].tolist()))

    def check_consistent(self) -> None:
        """Recount held pages from head lengths (vectorised) and compare."""
        self.sync()
        for request_id, row in self._row_of.items():
            expected = None if self.pending[row] else int(self.logical_lens[row] + self.room[row])
            if self.capacity.get(request_id) != expected:
                raise AssertionError(f"capacity of {request_id} drifted from its room")
        rows = np.fromiter(self._row_of.values(), np.int64, len(self._row_of))
        recount = self._pages(self.head_lens[rows]).sum(axis=(1, 2))
        exact = ~self.pending[rows]
        if not np.array_equal(recount[exact], self.pages_held_per_row[rows][exact]):
            raise AssertionError("per-request page counts drifted from head lengths")
        lens = self.head_lens[rows]
        room = (self._pages(lens) * self.block_size - lens).min(axis=(1, 2))
        if not np.array_equal(np.where(exact, room, 0), self.room[rows]):
            raise AssertionError("per-request room drifted from head lengths")
        held = int(self.pages_held_per_row[rows].sum())
        if self.num_pages - held != self.num_free_pages:
            raise AssertionError(
                f"free pages {self.num_free_pages} != pool {self.num_pages} - held {held}"
            )
