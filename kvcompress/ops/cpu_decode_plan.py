"""A decode batch's plan for vLLM's CPU kernel, kept between steps and advanced in place.

While the same rows decode (no admission, finish, preemption, compression or prefix
fill in between) a step changes every head the same way: one KV at its end, so its
length +1, its write slot +1, and a new page where the last one is full. Building the
plan from the cache each step (:func:`kvcompress.ops.cpu_attention.plan_decode_step`
after :meth:`~kvcompress.ops.paged_cache.PerHeadPagedCache.append_one`) takes a few
dozen small numpy calls. Right after a forward pass has flushed the CPU caches each of
those costs 10-30 us instead of 1-3 (measured in the engine at 256 rows), so host time
follows the number of calls more than their size. :class:`DecodeBatchPlan` keeps the
arrays the kernel and the KV writes read (``[L, B, H]`` write pages, offsets and flat
``page * b + offset`` slots; the kernel's ``[L, H * B, P]`` tables and ``[L, H, B]``
lengths, head-major: :func:`~kvcompress.ops.cpu_attention.kernel_sequence_order`) and
advances them with about seven array calls a step (four adds, three scatters, new pages
only when some head's last page is full),
writing the cache's own state (head lengths, tables, last pages, slot positions and
metrics) exactly as ``append_one`` would. It rebuilds from the cache when the rows
changed (another ``rows_key``) or anything else changed the cache
(``PerHeadPagedCache.version``), and re-gathers its tables when the longest head needs
a new column.

Page ids are taken from the allocator in the same order as ``append_one`` takes them
(row, then layer, then head), so both paths leave identical caches;
``tests/test_cpu_decode_plan.py`` checks that, and the plan, against the rebuild.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcompress.ops.cpu_attention import (
    KernelDecodeLayer,
    kernel_sequence_order,
    lens_agree_across_layers,
    set_decode_work,
    unplanned_decode_layers,
)
from kvcompress.ops.kv_pool import KVPool
from kvcompress.ops.page_tables import decode_tables
from kvcompress.ops.paged_cache import AppendPlan, PerHeadPagedCache


class DecodeBatchPlan:
    """The kernel plan of one decode batch composition, advanced one token per step.

    Args:
        cache: the CPU :class:`PerHeadPagedCache` (numpy host views).
        pool: the kernel-layout pool the attention reads.
        num_q_heads: query heads of the model.
        query_dtype: the queries' dtype (None: the pages'; FP8 pages need it given).
    """

    def __init__(self, cache: PerHeadPagedCache, pool: KVPool, num_q_heads: int,
                 query_dtype: torch.dtype | None = None) -> None:
        if cache.host is None:
            raise ValueError("DecodeBatchPlan needs a CPU cache (numpy host views)")
        self.cache = cache
        self.pool = pool
        self.num_q_heads = num_q_heads
        self.query_dtype = query_dtype
        self._rows_key: object | None = None
        self._version = -1
        # [L, H, B] int32 KVs held per head after the last step, head-major: the kernel's
        # lengths (kernel_sequence_order), read row-major through transposed views.
        self._lens = np.zeros((0, 0, 0), np.int32)
        self._offsets = np.zeros((0, 0, 0), np.int32)  # [L, B, H] its last KV's offset in its page
        self._write_pages = np.zeros((0, 0, 0), np.int64)  # [L, B, H] page of the last KV
        # [L, B, H] int64 flat slot (page * block_size + offset) of the last KV: in
        # slot_positions / slot_metrics, and vLLM's KV write op's targets (int64 only).
        self._write_slots = np.zeros((0, 0, 0), np.int64)
        self._meta_slots = np.zeros((0, 0, 0), np.int64)  # where their positions go
        self._tables = np.zeros((0, 0, 0), np.int32)  # [L, H * B, P], head-major
        self._uniform = True
        # Steps every head can still take in its last page before one needs a new page.
        self._room = 0
        self._plan: AppendPlan | None = None  # torch views of the write arrays
        self._layers: list[KernelDecodeLayer] = []  # torch views of tables and lengths
        self.rebuilds = 0  # for tests and stats: full rebuilds since construction

    def step(
        self, rows_key: object, slots: np.ndarray, positions: np.ndarray,
        metric_rows: torch.Tensor | None = None, uniform: bool | None = None,
    ) -> tuple[AppendPlan, list[KernelDecodeLayer]]:
        """Append one KV per head of every row (at ``positions``) and plan the step.

        Args:
            rows_key: identifies the batch composition (compared by identity: the same
                object for as long as the same rows decode in the same order).
            slots: ``[B]`` int64 sequence slots of the rows.
            positions: ``[B]`` int64 positions of the rows' new tokens.
            metric_rows: ``[M]`` rows whose decode query adds to the metrics, or None.
            uniform: True when every head of a row holds as many KVs in every layer
                (never-compressed rows); None: checked when the plan is rebuilt (a
                decode step adds one KV to every head, so it cannot change).

        Returns:
            Where each new KV goes (``[L, B, H]`` pages and offsets, as ``append_one``;
            the offsets int32) and every layer's :class:`KernelDecodeLayer`. Both are
            this object's: valid until the next step.
        """
        if rows_key is self._rows_key and self.cache.version == self._version:
            self._advance(slots, positions)
        else:
            self._rebuild(rows_key, slots, positions, uniform)
        set_decode_work(
            self._layers, self.pool, self._tables_t, self._lens, self.num_q_heads, metric_rows, self._uniform,
            self.query_dtype,
        )
        return self._plan, self._layers

    def _rebuild(self, rows_key: object, slots: np.ndarray, positions: np.ndarray, uniform: bool | None) -> None:
        cache = self.cache
        block_size = cache.block_size
        appended = cache.append_one(torch.from_numpy(slots), torch.from_numpy(positions), host_slots=slots)
        self._write_pages = appended.write_pages.numpy()
        offsets = appended.write_offsets.numpy()
        tables, lens = decode_tables(block_size, cache.tables, slots, cache.host.head_lens[slots])
        self._write_slots = self._write_pages * block_size + offsets
        self._meta_slots = cache.meta_slots(self._write_pages, offsets)
        self._offsets = offsets.astype(np.int32)
        self._uniform = lens_agree_across_layers(lens) if uniform is None else uniform
        self._room = block_size - 1 - int(offsets.max())
        self._plan = AppendPlan(appended.write_pages, torch.from_numpy(self._offsets))
        self._tables, self._lens = kernel_sequence_order(tables, lens)
        self._set_tables()
        self._rows_key = rows_key
        self._version = cache.version
        self.rebuilds += 1

    def _set_tables(self) -> None:
        """The layers' views of the kernel's tables and lengths (``_tables``, ``_lens``)."""
        self._tables_t = torch.from_numpy(self._tables)
        num_layers = self._tables.shape[0]
        self._layers = unplanned_decode_layers(
            self.pool, self._tables_t, torch.from_numpy(self._lens).view(num_layers, -1),
            write_slots=torch.from_numpy(self._write_slots).view(num_layers, -1),
        )

    def _advance(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """One KV more per head: in place, the cache's state written as ``append_one``'s."""
        host = self.cache.host
        self._lens += 1
        self._offsets += 1
        self._write_slots += 1
        self._meta_slots += 1
        if self._room > 0:
            self._room -= 1
        else:
            offsets = self._offsets
            starts_page = offsets == self.cache.block_size
            if starts_page.any():
                self._take_pages(slots, starts_page)
            self._room = self.cache.block_size - 1 - int(offsets.max())
        host.head_lens[slots] = self._lens.transpose(2, 0, 1)
        host.place(self._meta_slots, positions[None, :, None])

    def _take_pages(self, slots: np.ndarray, starts_page: np.ndarray) -> None:
        """New pages for the heads whose last page is full (``starts_page [L, B, H]``),
        taken in ``append_one``'s order (row, layer, head)."""
        cache = self.cache
        block_size = cache.block_size
        rows, layers, heads = np.nonzero(starts_page.transpose(1, 0, 2))
        lens = self._lens
        columns = (lens[layers, heads, rows].astype(np.int64) - 1) // block_size
        pages = cache.take_last_pages_host(slots[rows], layers, heads, columns)
        self._write_pages[layers, rows, heads] = pages
        self._offsets[layers, rows, heads] = 0
        self._write_slots[layers, rows, heads] = pages * block_size
        self._meta_slots[layers, rows, heads] = cache.meta_slots(pages, 0)
        if int(columns.max()) >= self._tables.shape[2]:  # the longest head grew a column
            tables, row_lens = decode_tables(block_size, cache.tables, slots, lens.transpose(2, 0, 1))
            self._tables = kernel_sequence_order(tables, row_lens)[0]
            self._set_tables()
        else:
            num_rows = lens.shape[2]
            self._tables[layers, heads * num_rows + rows, columns] = pages
