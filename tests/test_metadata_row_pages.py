"""Slot metadata in row pages (issue 61 step 3, docs/design-61-metadata-rows.md): a
compressing sequence's positions and metrics live in rows carved from pages it holds
(``ceil(own pages / rows_per_page)`` of them, packed), a never-compressing one reads shared
identity rows and holds none.

Oracles: the same operations on a cache without rows (every page its own row), which
must read the same positions and metrics in every head's logical order; the scheduler's
``PageAccounting(rows_per_page=)`` driven through the same operations, which must count
the free pages the worker's allocator has; and a brute-force recount of every page in
use (KV pages, row pages: disjoint, together exactly the allocator's used pages).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.ops import PagedBatch
from kvcompress.ops.compress import compress_sequences, gather_logical
from kvcompress.ops.paged_cache import PerHeadPagedCache, identity_pages_for, pages_for, rows_per_page_for
from kvcompress.ops.prefix_groups import PrefixGroups
from kvcompress.ops.reference_attention import reference_paged_attention
from kvcompress.page_accounting import PageAccounting, row_pages_for

BLOCK, LAYERS, HEADS, DIM, PAGES, MAX_PAGES, SEQS = 4, 2, 2, 8, 220, 12, 5


def test_rows_per_page_and_identity_pages():
    assert rows_per_page_for(64, 4) == 64 and rows_per_page_for(64, 2) == 32 and rows_per_page_for(128, 1) == 32
    with pytest.raises(ValueError, match="int32"):
        rows_per_page_for(3, 2)
    assert identity_pages_for(68, 64) == 2 and identity_pages_for(64, 64) == 1
    assert row_pages_for(np.array([0, 1, 64, 65]), 64).tolist() == [0, 1, 1, 2]


class Mirror:
    """One cache without rows, one with, and the scheduler's accounting, driven alike."""

    def __init__(self, rows_per_page: int, host_path: bool, seed: int, grant_pages: int = 1) -> None:
        self.rng = np.random.default_rng(seed)
        self.per_page = rows_per_page
        self.grant = grant_pages
        self.plain = PerHeadPagedCache(PAGES, LAYERS, HEADS, BLOCK, SEQS, MAX_PAGES, max_shared_pages_per_head=MAX_PAGES)
        self.rows = PerHeadPagedCache(PAGES, LAYERS, HEADS, BLOCK, SEQS, MAX_PAGES, max_shared_pages_per_head=MAX_PAGES,
                                      identity_rows=True, rows_per_page=rows_per_page, grant_pages=grant_pages)
        if not host_path:
            self.plain.host = self.rows.host = None
        buffer = torch.zeros(PAGES, 2, BLOCK, DIM)
        self.pools = [c.kv_pool(buffer[:, 0].clone(), buffer[:, 1].clone()) for c in (self.plain, self.rows)]
        self.accounting = PageAccounting(PAGES, LAYERS, HEADS, BLOCK, max_requests=SEQS, rows_per_page=rows_per_page,
                                         grant_pages=grant_pages)
        self.groups = [PrefixGroups(self.plain), PrefixGroups(self.rows)]
        self.live: dict[str, dict] = {}  # request id -> {slot, compresses, len, frozen}
        self.next_id = 0
        self.next_block = 0
        self.cached: list[int] = []

    # -- operations ------------------------------------------------------------------

    def open(self, compresses: bool, tokens: int) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        slots = [c.new_sequence(compresses=compresses) for c in (self.plain, self.rows)]
        assert slots[0] == slots[1]
        self.accounting.note_compresses(request_id, compresses)
        self.live[request_id] = {"slot": slots[0], "compresses": compresses, "len": 0, "frozen": False, "shared": 0}
        self.grow(request_id, tokens)

    def grow(self, request_id: str, tokens: int) -> None:
        state = self.live[request_id]
        start = state["len"]
        positions = torch.arange(start, start + tokens)
        self.accounting.grow(request_id, start + tokens)
        slot = torch.tensor([state["slot"]])
        for cache, pool in zip((self.plain, self.rows), self.pools):
            plan = cache.append(slot, torch.tensor([tokens]), positions)
            # Metrics a function of (slot, layer, head, position): equal in both caches.
            layer = torch.arange(LAYERS).view(-1, 1, 1)
            head = torch.arange(HEADS).view(1, 1, -1)
            value = ((state["slot"] * 7 + layer * 5 + head * 3 + positions.view(1, -1, 1)) * 0.6180339) % 1.0
            rows = pool.meta_index(plan.write_pages)
            cache.slot_metrics[rows, plan.write_offsets] = value.float().expand_as(rows)
        state["len"] = start + tokens

    def compress(self, request_id: str, evict: int) -> None:
        state = self.live[request_id]
        slot = torch.tensor([state["slot"]])
        results = [
            compress_sequences(cache, pool, slot, torch.tensor([evict]), torch.tensor([state["len"]]), 2, 1)
            for cache, pool in zip((self.plain, self.rows), self.pools)
        ]
        assert torch.equal(results[0].new_head_lens, results[1].new_head_lens)
        assert results[0].pages_freed == results[1].pages_freed
        self.accounting.mark_compressed(request_id, results[1].pages_freed)
        assert self.accounting.adopt(request_id, self.rows.head_lens[state["slot"]].numpy()) == 0

    def drop_window(self, request_id: str, pages: int) -> None:
        state = self.live[request_id]
        for cache in (self.plain, self.rows):
            cache.drop_leading_pages(torch.tensor([state["slot"]]), torch.tensor([[pages, 0]]))
        self.accounting.set_head_lens(request_id, self.rows.head_lens[state["slot"]].numpy())

    def take_blocks(self, request_id: str, count: int) -> None:
        """The prefix cache takes the request's first ``count`` blocks (uncompressed)."""
        state = self.live[request_id]
        block_ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        for groups in self.groups:
            groups.register(state["slot"], 0, block_ids)
        self.accounting.share_blocks(request_id, count)
        self.accounting.cache_groups(count)
        self.cached.extend(block_ids)
        state["frozen"] = True
        state["shared"] = count

    def chunk_taken(self, request_id: str, tokens: int) -> None:
        """A prompt chunk whose full blocks the prefix cache takes in the same step, in the
        engine's order: the scheduler shares them and grows the request, the worker
        expects them (``expect_identity_columns``), appends, then registers them; the
        worker never holds more pages than the scheduler counted."""
        state = self.live[request_id]
        count = (state["len"] + tokens) // BLOCK
        block_ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        self.accounting.share_blocks(request_id, count)
        self.accounting.cache_groups(count)
        for cache in (self.plain, self.rows):
            cache.expect_identity_columns(state["slot"], count)
        self.grow(request_id, tokens)
        assert self.rows.allocator.num_used <= self.accounting.num_used_pages
        for groups in self.groups:
            groups.register(state["slot"], 0, block_ids)
        self.cached.extend(block_ids)
        state["frozen"] = True
        state["shared"] = count

    def release(self, request_id: str) -> None:
        state = self.live.pop(request_id)
        for cache in (self.plain, self.rows):
            cache.release(torch.tensor([state["slot"]]))
        self.accounting.release(request_id)

    def uncache(self) -> None:
        for groups in self.groups:
            groups.drop(self.cached)
        self.accounting.uncache_groups(len(self.cached))
        self.cached = []

    # -- checks ----------------------------------------------------------------------

    def check(self) -> None:
        plain, rows = self.plain, self.rows
        self.accounting.check_consistent()
        live_slots = [s["slot"] for s in self.live.values()]
        # Never-compressing heads are counted in whole groups of grant pages: the pages a
        # last group has not reached stay free on the worker but counted held (a loop here).
        spare = 0
        for state in self.live.values():
            if not state["compresses"]:
                for pages in pages_for(rows.head_lens[state["slot"]], BLOCK).reshape(-1).tolist():
                    spare += -(-pages // self.grant) * self.grant - pages
        assert rows.allocator.num_free - spare == rows.counted_free_pages() == int(self.accounting.free_pages[0])
        row_pages = rows.row_pages_held(live_slots) if live_slots else np.zeros(0, np.int64)
        assert plain.allocator.num_free == rows.allocator.num_free + int(row_pages.sum())
        # What the worker reports: pages past the prefix-cache groups (worker_compression.step_report).
        shared = np.array([s["shared"] for s in self.live.values()], np.int64) * LAYERS * HEADS
        reported = np.asarray(rows.pages_held_per_sequence(live_slots), np.int64) - shared
        assert reported.tolist() == [int(self.accounting.pages_held_by_request()[r]) for r in self.live]
        meta_row = rows.page_meta_row.numpy()
        kv_pages, all_row_pages = set(), []
        for (request_id, state), held_rows in zip(self.live.items(), row_pages.tolist()):
            slot = torch.tensor([state["slot"]])
            want = gather_logical(plain, slot, pool=self.pools[0])
            got = gather_logical(rows, slot, pool=self.pools[1])
            lens = rows.head_lens[state["slot"]]
            assert torch.equal(lens, plain.head_lens[state["slot"]])
            held = torch.arange(want[1].shape[-1]) < lens.unsqueeze(-1)
            assert torch.equal(got[1][0][held], want[1][0][held]), request_id
            if state["compresses"]:  # (the prefix cache's blocks read identity rows: no metrics)
                scored = held & (torch.arange(held.shape[-1]) >= state["shared"] * BLOCK)
                assert torch.equal(got[0][0][scored], want[0][0][scored]), request_id
            pages = got[2][0][pages_for(lens, BLOCK).unsqueeze(-1) > torch.arange(got[2].shape[-1])].long().numpy()
            kv_pages.update(pages.tolist())
            own = meta_row[pages] < rows.identity_row0
            if not state["compresses"]:
                assert not own.any() and held_rows == 0
                continue
            assert held_rows == row_pages_for(int(own.sum()), self.per_page)
            slot_row_pages = rows.row_pages[state["slot"], :held_rows].numpy()
            all_row_pages.extend(slot_row_pages.tolist())
            assert set((meta_row[pages[own]] // self.per_page).tolist()) <= set(slot_row_pages.tolist())
            assert len(set(meta_row[pages[own]].tolist())) == int(own.sum())  # one row each
        for groups in self.groups[1:]:
            for group in groups.pages.values():
                kv_pages.update(group.reshape(-1).long().tolist())
        assert len(set(all_row_pages)) == len(all_row_pages) and not kv_pages & set(all_row_pages)
        assert len(kv_pages) + len(all_row_pages) == rows.allocator.num_used


@pytest.mark.parametrize("rows_per_page", [1, 3, 8])
@pytest.mark.parametrize("host_path", [True, False])
@pytest.mark.parametrize("seed, grant_pages", [(0, 1), (1, 1), (2, 2), (3, 2)])
def test_row_pages_follow_every_change_and_both_sides_count_them(rows_per_page, host_path, seed, grant_pages):
    """Also with never-compressing requests counted in pairs of pages (grant_pages 2, the
    CPU engine's: issue 61 step 4) on both sides."""
    mirror = Mirror(rows_per_page, host_path, seed, grant_pages)
    rng = mirror.rng
    ops = {"open": 0, "decode": 0, "chunk": 0, "compress": 0, "drop": 0, "take": 0, "release": 0,
           "chunk_taken": 0}
    for _ in range(160):
        live = list(mirror.live)
        choice = rng.choice(["open", "decode", "chunk", "compress", "drop", "take", "release"],
                            p=[0.14, 0.3, 0.12, 0.16, 0.1, 0.06, 0.12])
        if choice == "open" and len(live) < SEQS - 1:
            need = 8 * LAYERS * HEADS + 8
            if mirror.accounting.num_free_pages > need:
                compresses = bool(rng.random() < 0.6)
                if compresses and rng.random() < 0.3:  # its prompt's blocks cached as it is prefilled
                    mirror.open(compresses, int(rng.integers(1, 4)))
                    mirror.chunk_taken(f"r{mirror.next_id - 1}", int(rng.integers(6, 14)))
                    ops["chunk_taken"] += 1
                else:
                    mirror.open(compresses, int(rng.integers(1, 20)))
        elif not live:
            continue
        else:
            request_id = live[int(rng.integers(len(live)))]
            state = mirror.live[request_id]
            heads = mirror.rows.head_lens[state["slot"]]
            room = mirror.accounting.num_free_pages
            if choice in ("decode", "chunk"):
                tokens = 1 if choice == "decode" else int(rng.integers(2, 9))
                if state["len"] + tokens > MAX_PAGES * BLOCK - BLOCK or room < 3 * LAYERS * HEADS:
                    continue
                mirror.grow(request_id, tokens)
            elif choice == "compress":
                if not state["compresses"] or state["frozen"] or int(heads.min()) < 3 * BLOCK:
                    continue
                mirror.compress(request_id, int(rng.integers(1, 6)))
            elif choice == "drop":
                if state["frozen"] or int(heads[0].min()) < 2 * BLOCK + 1:
                    continue
                mirror.drop_window(request_id, 1)
            elif choice == "take":
                full = int(heads.min()) // BLOCK
                if state["frozen"] or mirror.rows._dropped_pages[state["slot"]].any() or full < 1:
                    continue
                if int(heads.max()) != state["len"]:  # compressed: no longer its token blocks
                    continue
                mirror.take_blocks(request_id, int(rng.integers(1, full + 1)))
            else:
                mirror.release(request_id)
        ops[choice] += 1
        mirror.check()
    for request_id in list(mirror.live):
        mirror.release(request_id)
        mirror.check()
    mirror.uncache()
    mirror.check()
    assert mirror.rows.allocator.num_free == PAGES == mirror.plain.allocator.num_free
    assert min(ops.values()) > 0, ops  # every operation ran


def test_never_compressing_sequences_hold_no_row_pages_and_read_identity_rows():
    cache = PerHeadPagedCache(64, LAYERS, HEADS, BLOCK, 3, MAX_PAGES, identity_rows=True, rows_per_page=4)
    assert cache.slot_positions.shape == ((64 + 3) * 4, BLOCK)  # the identity rows in 3 pages past the pool
    slot = cache.new_sequence(compresses=False)
    cache.append(torch.tensor([slot]), torch.tensor([10]), torch.arange(10))
    for position in range(10, 14):
        cache.append(torch.tensor([slot]), torch.tensor([1]), torch.tensor([position]))
    assert cache.row_pages_held([slot]).tolist() == [0]
    assert cache.allocator.num_used == LAYERS * HEADS * 4  # 14 tokens: 4 pages a head, nothing else
    tables = cache.flat_page_tables()[slot].long()
    rows = cache.page_meta_row[tables[..., :4]]
    assert torch.equal(rows, cache.identity_row0 + torch.arange(4).expand(LAYERS, HEADS, 4))


def test_attention_on_row_pages_equals_the_plain_cache():
    """The reference attention (positions mask, window by position) reads the same KVs
    whether metadata lives in row pages or one row per page."""
    gen = torch.Generator().manual_seed(3)
    caches = [PerHeadPagedCache(96, LAYERS, HEADS, BLOCK, 4, MAX_PAGES, identity_rows=rows, rows_per_page=3)
              for rows in (False, True)]
    compresses = [True, False, True]
    lengths = torch.tensor([13, 9, 22])
    key, value = torch.randn(96, BLOCK, DIM, generator=gen), torch.randn(96, BLOCK, DIM, generator=gen)
    pools = []
    for cache in caches:
        slots = torch.tensor([cache.new_sequence(compresses=c) for c in compresses])
        cache.append(slots, lengths, torch.cat([torch.arange(int(n)) for n in lengths]))
        pools.append(cache.kv_pool(key.clone(), value.clone()))
    query = torch.randn(3, 2 * HEADS, DIM, generator=gen)
    outputs = []
    for cache, pool in zip(caches, pools):
        # The same logical KVs: copy the plain cache's K / V to the rows cache's pages.
        tables = cache.page_tables_of(slots, MAX_PAGES, layer=1).long()
        outputs.append((tables, pool))
    (plain_tables, plain_pool), (row_tables, row_pool) = outputs
    held = pages_for(caches[0].head_lens[slots, 1], BLOCK)
    for s in range(3):
        for h in range(HEADS):
            n = int(held[s, h])
            row_pool.key_cache[row_tables[s, h, :n]] = plain_pool.key_cache[plain_tables[s, h, :n]].clone()
            row_pool.value_cache[row_tables[s, h, :n]] = plain_pool.value_cache[plain_tables[s, h, :n]].clone()
    got = []
    for cache, (tables, pool) in zip(caches, outputs):
        batch = PagedBatch(tables, cache.head_lens[slots, 1], list(range(4)), (lengths - 1).long(), sliding_window=6)
        got.append(reference_paged_attention(query, pool, batch, 0.3))
    assert torch.equal(got[0], got[1])
