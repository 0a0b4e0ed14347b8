"""Shared prefix pages in the per-head cache (issue 17's worker side, without vLLM).

``PerHeadPagedCache.share_prefix`` gives a sequence slot the leading pages of another
one (what a prefix-cache hit reuses); every holder appends, compresses (keeping the
shared prefix whole, like sinks) and is released on its own. Oracle: a brute-force
model that recounts, after every operation of random interleavings, which pages and
chunks the live sequences' tables reference, and the KV each logical slot of a
shared prefix must hold (written once by the sequence that computed it).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from kvcompress.ops.compress import compress_sequences
from kvcompress.ops.paged_cache import PerHeadPagedCache, pages_for

LAYERS, HEADS, BLOCK, HEAD_DIM, NUM_PAGES, MAX_SEQS, MAX_PAGES = 2, 2, 4, 2, 260, 8, 13


def _kv_value(origin: int, layer: int, head: int, position: int) -> float:
    return float(((origin * LAYERS + layer) * HEADS + head) * 1000 + position)


class _SharedCacheModel:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache = PerHeadPagedCache(NUM_PAGES, LAYERS, HEADS, BLOCK, MAX_SEQS, MAX_PAGES)
        buffer = torch.zeros(NUM_PAGES, 2, BLOCK, HEAD_DIM)
        self.key_cache, self.value_cache = buffer[:, 0], buffer[:, 1]
        self.pool = self.cache.kv_pool(self.key_cache, self.value_cache)
        self.tokens: dict[int, int] = {}  # live slot -> tokens appended (context length)
        self.frozen: dict[int, int] = {}  # live slot -> leading pages kept whole (shared)
        self.origin: dict[int, int] = {}  # live slot -> who wrote its frozen prefix
        self.next_origin = 0

    # --- operations -----------------------------------------------------------------
    def new(self, tokens: int) -> int:
        slot = self.cache.new_sequence()
        self.tokens[slot], self.frozen[slot] = 0, 0
        self.origin[slot] = self.next_origin
        self.next_origin += 1
        self.append(slot, tokens)
        return slot

    def append(self, slot: int, count: int) -> None:
        start = self.tokens[slot]
        if count <= 0 or pages_for(start + count, BLOCK) > MAX_PAGES:
            return
        positions = torch.arange(start, start + count)
        plan = self.cache.append(torch.tensor([slot]), torch.tensor([count]), positions)
        for layer in range(LAYERS):
            for token in range(count):
                for head in range(HEADS):
                    page = plan.write_pages[layer, token, head]
                    offset = plan.write_offsets[layer, token, head]
                    value = _kv_value(self.origin[slot], layer, head, start + token)
                    self.key_cache[page, offset] = value
                    self.value_cache[page, offset] = -value
        self.tokens[slot] = start + count

    def share(self, src: int, pages: int) -> int | None:
        clean = min(int(self.cache.head_lens[src].min()), self.tokens[src]) // BLOCK
        clean = clean if self.frozen[src] == 0 and not self.compressed(src) else self.frozen[src]
        pages = min(pages, clean)
        if pages <= 0 or not self.cache._free_seq_slots:
            return None
        dst = self.cache.new_sequence()
        self.cache.share_prefix(dst, src, pages)
        self.tokens[dst], self.frozen[dst], self.origin[dst] = pages * BLOCK, pages, self.origin[src]
        self.frozen[src] = max(self.frozen[src], pages)
        return dst

    def compressed(self, slot: int) -> bool:
        return int(self.cache.head_lens[slot].min()) < self.tokens[slot]

    def compress(self, slot: int, pages: int) -> None:
        sinks = self.frozen[slot] * BLOCK
        compress_sequences(
            self.cache, self.pool, torch.tensor([slot]), torch.tensor([pages]),
            torch.tensor([self.tokens[slot]]), torch.tensor([2]), torch.tensor([max(sinks, 1)]),
        )

    def release(self, slot: int) -> None:
        self.cache.release(torch.tensor([slot]))
        for table in (self.tokens, self.frozen, self.origin):
            del table[slot]

    # --- the oracle -----------------------------------------------------------------
    def check(self) -> None:
        cache, tables = self.cache, self.cache.tables
        page_refs: Counter = Counter()
        chunk_refs: Counter = Counter()
        for slot in self.tokens:
            held = pages_for(cache.head_lens[slot], BLOCK)
            flat = cache.page_tables_of(torch.tensor([slot]))[0]
            for layer in range(LAYERS):
                for head in range(HEADS):
                    count = int(held[layer, head])
                    page_refs.update(flat[layer, head, :count].tolist())
                    chunks = -(-count // tables.chunk_pages)
                    chunk_refs.update(tables.chunk_tables[slot, layer, head, :chunks].tolist())
                    self._check_frozen(slot, layer, head, flat[layer, head])
        page_refs.update(self.other_references())
        assert cache.allocator.num_free == NUM_PAGES - len(page_refs)
        free = set(cache.allocator.free_stack[: cache.allocator.num_free].tolist())
        assert not free & set(page_refs) and len(free) == cache.allocator.num_free
        shares = cache.page_shares.tolist()
        assert all(shares[p] == page_refs.get(p, 1) - 1 for p in range(NUM_PAGES))
        chunk_free = tables.chunk_allocator.num_free
        assert chunk_free == tables.chunk_allocator.num_pages - len(chunk_refs)
        chunk_shares = tables.chunk_shares.tolist()
        assert all(chunk_shares[c] == chunk_refs.get(c, 1) - 1 for c in range(1, len(chunk_shares)))

    def other_references(self) -> Counter:
        """Page references held by something other than the live slots (none here)."""
        return Counter()

    def _check_frozen(self, slot: int, layer: int, head: int, pages: torch.Tensor) -> None:
        """The frozen prefix holds, slot for slot, the KVs its writer put there."""
        for column in range(self.frozen[slot]):
            page = int(pages[column])
            for offset in range(BLOCK):
                position = column * BLOCK + offset
                value = _kv_value(self.origin[slot], layer, head, position)
                assert int(self.cache.slot_positions[page, offset]) == position
                assert float(self.key_cache[page, offset, 0]) == value
                assert float(self.value_cache[page, offset, 0]) == -value


def _random_walk(model: _SharedCacheModel, steps: int, actions: dict) -> Counter:
    """``steps`` random operations (``actions``: name -> (weight, do(live slots) ->
    whether it happened)), a brute-force check after each, then every slot released
    and checked again; returns how often each action happened."""
    rng = model.rng
    names = list(actions)
    weights = np.array([actions[name][0] for name in names], float)
    done = Counter()
    for _ in range(steps):
        live = list(model.tokens)
        name = names[rng.choice(len(names), p=weights / weights.sum())]
        if name == "new" or not live:
            if model.cache._free_seq_slots and model.cache.allocator.num_free > 60:
                model.new(int(rng.integers(1, 30)))
        elif actions[name][1](live):
            done[name] += 1
        model.check()
    for slot in list(model.tokens):
        model.release(slot)
        model.check()
    return done


def _common_actions(model: _SharedCacheModel) -> dict:
    rng = model.rng

    def append(live):
        if model.cache.allocator.num_free <= 30:
            return False
        model.append(int(rng.choice(live)), int(rng.integers(1, 9)))
        return True

    return {
        "new": (.2, None),
        "append": (.25, append),
        "compress": (.2, lambda live: model.compress(int(rng.choice(live)), int(rng.integers(1, 4))) or True),
        "release": (.1, lambda live: model.release(int(rng.choice(live))) or True),
    }


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_never_free_or_touch_a_held_shared_page(seed):
    model = _SharedCacheModel(seed)
    rng = model.rng
    actions = _common_actions(model)
    actions["share"] = (.35, lambda live: model.share(int(rng.choice(live)), int(rng.integers(1, 6))) is not None)
    done = _random_walk(model, 90, actions)
    assert done["share"] > 3  # the interleavings did share
    assert model.cache.allocator.num_free == NUM_PAGES
    assert int(model.cache.page_shares.abs().sum()) == 0
    assert int(model.cache.tables.chunk_shares.abs().sum()) == 0


def test_a_shared_page_is_freed_by_its_last_holder_whatever_the_order():
    for order in ((0, 1, 2), (2, 1, 0), (1, 0, 2)):
        model = _SharedCacheModel(0)
        first = model.new(21)  # 5 full pages + 1 KV per head
        holders = [first, model.share(first, 5), model.share(first, 3)]
        used = NUM_PAGES - model.cache.allocator.num_free
        assert used == LAYERS * HEADS * 6  # the shares took no page
        for index in order:
            model.release(holders[index])
            model.check()
        assert model.cache.allocator.num_free == NUM_PAGES


def test_two_holders_released_in_one_call_free_each_page_once():
    model = _SharedCacheModel(1)
    first = model.new(16)
    second = model.share(first, 4)
    model.append(second, 5)
    freed = model.cache.release(torch.tensor([first, second]))
    assert freed == LAYERS * HEADS * (4 + 2)  # shared 4 pages once, the second's own 2
    assert model.cache.allocator.num_free == NUM_PAGES


def test_sharing_refuses_a_slot_in_use_or_a_too_short_source():
    model = _SharedCacheModel(2)
    first = model.new(8)
    other = model.new(3)
    with pytest.raises(ValueError, match="not empty"):
        model.cache.share_prefix(other, first, 1)
    empty = model.cache.new_sequence()
    with pytest.raises(ValueError, match="fewer than"):
        model.cache.share_prefix(empty, first, 3)


class _GroupCacheModel(_SharedCacheModel):
    """The same cache with vLLM's prefix cache on top: ``PrefixGroups`` takes a slot's
    uncompressed leading pages as page groups of block ids (one reference each), a hit
    reserves its prefix, appends its own tokens and then points at the groups (as the
    model runner orders it), and the cache lets go of a chain's tail blocks."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        from kvcompress.ops.prefix_groups import PrefixGroups

        self.groups = PrefixGroups(self.cache)
        self.chain: dict[int, list[int]] = {}  # live slot -> block ids of its frozen prefix
        self.chains: list[tuple[list[int], int]] = []  # cached chains (block ids, origin)
        self.next_block = 1

    def take(self, slot: int) -> None:
        """The cache takes the slot's clean (uncompressed, full) pages past its chain."""
        have = self.chain.get(slot, [])
        if self.compressed(slot):
            return
        clean = min(int(self.cache.head_lens[slot].min()), self.tokens[slot]) // BLOCK
        if clean <= len(have):
            return
        new = list(range(self.next_block, self.next_block + clean - len(have)))
        self.next_block += len(new)
        self.groups.register(slot, len(have), new)
        self.chain[slot] = have + new
        self.frozen[slot] = max(self.frozen[slot], clean)
        self.chains.append((self.chain[slot], self.origin[slot]))

    def hit(self, pages: int, own_tokens: int) -> int | None:
        usable = [(ids, origin) for ids, origin in self.chains if ids and ids[0] in self.groups.pages]
        if not usable or not self.cache._free_seq_slots:
            return None
        ids, origin = usable[int(self.rng.integers(len(usable)))]
        alive = next((i for i, block in enumerate(ids) if block not in self.groups.pages), len(ids))
        pages = min(pages, alive)
        if pages_for(pages * BLOCK + own_tokens, BLOCK) > MAX_PAGES:
            return None
        dst = self.cache.new_sequence()
        self.tokens[dst], self.frozen[dst], self.origin[dst] = pages * BLOCK, pages, origin
        self.cache.reserve_prefix(dst, pages)
        self.append(dst, own_tokens)
        self.cache.fill_prefix(dst, self.groups.pages_of(ids[:pages]))
        self.chain[dst] = ids[:pages]
        return dst

    def uncache_tail(self) -> None:
        ids, _ = self.chains[int(self.rng.integers(len(self.chains)))]
        cached = [block for block in ids if block in self.groups.pages]
        self.groups.drop(cached[-int(self.rng.integers(1, 3)):] if cached else [])

    def release(self, slot: int) -> None:
        super().release(slot)
        self.chain.pop(slot, None)

    def other_references(self) -> Counter:
        """The cache's reference on every page of every group."""
        references = Counter()
        for pages in self.groups.pages.values():
            references.update(pages.reshape(-1).tolist())
        return references


@pytest.mark.parametrize("seed", range(5))
def test_prefix_groups_keep_held_pages_through_random_interleavings(seed):
    model = _GroupCacheModel(seed)
    rng = model.rng

    def hit(live):
        if model.cache.allocator.num_free <= 40:
            return False
        return model.hit(int(rng.integers(1, 6)), int(rng.integers(1, 9))) is not None

    def uncache(live):
        if not model.chains:
            return False
        model.uncache_tail()
        return True

    actions = _common_actions(model)
    actions.update(take=(.2, lambda live: model.take(int(rng.choice(live))) or True),
                   hit=(.25, hit), uncache=(.15, uncache))
    done = _random_walk(model, 120, actions)
    assert done["hit"] > 3 and done["take"] and done["uncache"]
    model.groups.drop(list(model.groups.pages))
    model.check()
    assert model.cache.allocator.num_free == NUM_PAGES
    assert int(model.cache.page_shares.abs().sum()) == 0
