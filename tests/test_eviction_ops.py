"""Block eviction schedule and MoveCache against brute-force oracles (CPU, no vLLM)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.ops import (
    KVPool,
    PerHeadPagedCache,
    compress_sequences,
    evictable_blocks,
    move_cache,
    plan_moves,
    protected_count,
    protected_slots,
    schedule_evictions,
    reference_write_kv,
)

# ---------------------------------------------------------------------------
# Random schedule inputs and the brute-force oracle
# ---------------------------------------------------------------------------


def _random_schedule_inputs(seed, num_seqs, num_layers, num_heads, block_size, tie_heavy):
    """metrics [S, L, H, K] (ragged heads, garbage past len), lens, protected, K."""
    rng = np.random.default_rng(seed)
    max_pages = 4
    num_slots = max_pages * block_size
    lens = rng.integers(0, num_slots + 1, size=(num_seqs, num_layers, num_heads))
    if tie_heavy:
        metrics = rng.choice([0.0, 0.25, 0.5, 1.0], size=(num_seqs, num_layers, num_heads, num_slots))
    else:
        metrics = rng.random((num_seqs, num_layers, num_heads, num_slots))
    protected = rng.random((num_seqs, num_layers, num_heads, num_slots)) < rng.choice([0.0, 0.15, 0.4])
    held = np.arange(num_slots) < lens[..., None]
    # Garbage past the head's length must not matter.
    metrics = np.where(held, metrics, rng.choice([0.0, 7.0, np.nan]))
    protected &= held
    return (
        torch.tensor(metrics, dtype=torch.float64),
        torch.tensor(lens, dtype=torch.int64),
        torch.tensor(protected),
    )


def _head_candidates(metrics, length, protected, block_size):
    """Sorted evictable metrics, empties and max blocks of one head (plain Python)."""
    values = sorted(
        0.0 if math.isnan(m) else m
        for m, p in zip(metrics[:length].tolist(), protected[:length].tolist())
        if not p
    )
    empties = math.ceil(length / block_size) * block_size - length
    max_blocks = (empties + len(values)) // block_size
    return values, empties, max_blocks


def _brute_force(metrics, lens, protected, wanted, block_size, block_cost):
    """Best per-head block vector of one sequence over every vector summing to
    min(E, evictable). Returns (best objective, blocks taken)."""
    heads = [
        _head_candidates(metrics[l, h], int(lens[l, h]), protected[l, h], block_size)
        for l in range(lens.shape[0])
        for h in range(lens.shape[1])
    ]
    total = min(wanted, sum(m for _, _, m in heads))
    best = None
    for vector in itertools.product(*[range(m + 1) for _, _, m in heads]):
        if sum(vector) != total:
            continue
        if block_cost == "sum":
            objective = sum(sum(v[: e * block_size - a]) for (v, a, _), e in zip(heads, vector) if e)
        else:  # descending multiset of block maxima, compared lexicographically
            objective = sorted(
                (v[k * block_size - a - 1] for (v, a, _), e in zip(heads, vector) for k in range(1, e + 1)),
                reverse=True,
            )
        if best is None or objective < best:
            best = objective
    return best, total


def _schedule_objective(plan, metrics, lens, protected, seq, block_size, block_cost):
    """The same objective for the schedule's answer, checking each head lost a prefix."""
    costs, total = [], 0.0
    for l in range(lens.shape[1]):
        for h in range(lens.shape[2]):
            values, empties, _ = _head_candidates(
                metrics[seq, l, h], int(lens[seq, l, h]), protected[seq, l, h], block_size
            )
            e = int(plan.evict_blocks[seq, l, h])
            evicted = plan.evicted[seq, l, h]
            assert not evicted[int(lens[seq, l, h]):].any()
            assert not (evicted & protected[seq, l, h]).any()
            got = sorted(torch.nan_to_num(metrics[seq, l, h][evicted], nan=0.0).tolist())
            expected_count = e * block_size - empties if e else 0
            # The evicted KVs are exactly (as a multiset) the head's lowest ones.
            assert got == values[:expected_count]
            old = int(lens[seq, l, h])
            new = int(plan.new_head_lens[seq, l, h])
            assert new == (math.ceil(old / block_size) - e) * block_size if e else new == old
            assert old - new == expected_count
            total += sum(got)
            costs += [values[k * block_size - empties - 1] for k in range(1, e + 1)]
    return (total if block_cost == "sum" else sorted(costs, reverse=True)), int(plan.evict_blocks[seq].sum())


@settings(max_examples=400, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_seqs=st.integers(1, 2),
    shape=st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (1, 4)]),
    block_size=st.sampled_from([1, 2, 3, 4]),
    tie_heavy=st.booleans(),
    block_cost=st.sampled_from(["sum", "max"]),
    wanted=st.lists(st.integers(0, 18), min_size=2, max_size=2),
)
def test_schedule_matches_brute_force_optimum(
    seed, num_seqs, shape, block_size, tie_heavy, block_cost, wanted
):
    """"sum": minimum total evicted metric; "max": lexicographic minimax of block costs."""
    num_layers, num_heads = shape
    metrics, lens, protected = _random_schedule_inputs(
        seed, num_seqs, num_layers, num_heads, block_size, tie_heavy
    )
    wanted = torch.tensor(wanted[:num_seqs])
    plan = schedule_evictions(metrics, lens, protected, wanted, block_size, block_cost)
    assert plan.evict_blocks.shape == lens.shape and plan.evicted.shape == metrics.shape
    for seq in range(num_seqs):
        best, total = _brute_force(
            metrics[seq], lens[seq], protected[seq], int(wanted[seq]), block_size, block_cost
        )
        got, taken = _schedule_objective(plan, metrics, lens, protected, seq, block_size, block_cost)
        assert taken == total
        if block_cost == "sum":
            assert got == pytest.approx(best, abs=1e-9)
        else:
            assert got == best


def test_max_and_sum_costs_differ_on_a_hand_example():
    # b = 2, head A holds [0.1, 0.9], head B [0.5, 0.6], one block wanted.
    metrics = torch.tensor([0.1, 0.9, 0.6, 0.5]).view(1, 1, 2, 2)
    lens = torch.tensor([[[2, 2]]])
    protected = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    by_max = schedule_evictions(metrics, lens, protected, torch.tensor([1]), 2, "max")
    by_sum = schedule_evictions(metrics, lens, protected, torch.tensor([1]), 2, "sum")
    # max: A's block costs 0.9, B's 0.6 -> B goes. sum: A 1.0 < B 1.1 -> A goes.
    assert by_max.evict_blocks.tolist() == [[[0, 1]]]
    assert by_max.new_head_lens.tolist() == [[[2, 0]]]
    assert by_sum.evict_blocks.tolist() == [[[1, 0]]]
    assert by_sum.evicted.tolist() == [[[[True, True], [False, False]]]]


def test_partial_last_block_empties_go_first():
    # b = 4, head 0 holds 5 KVs (3 empty slots): its lowest KV alone buys a whole page.
    metrics = torch.tensor([[0.5, 0.1, 0.2, 0.3, 0.4, 9, 9, 9], [0.05, 0.06, 0.07, 0.08, 9, 9, 9, 9]])
    metrics = metrics.view(1, 1, 2, 8)
    lens = torch.tensor([[[5, 4]]])
    protected = torch.zeros(1, 1, 2, 8, dtype=torch.bool)
    # max: head 0's first block costs 0.1, head 1's 0.08 -> head 1.
    # sum: head 0's first block costs 0.1, head 1's 0.26 -> head 0 (one KV lost).
    by_max = schedule_evictions(metrics, lens, protected, torch.tensor([1]), 4, "max")
    by_sum = schedule_evictions(metrics, lens, protected, torch.tensor([1]), 4, "sum")
    assert by_max.evict_blocks.tolist() == [[[0, 1]]] and by_max.new_head_lens.tolist() == [[[5, 0]]]
    assert by_sum.evict_blocks.tolist() == [[[1, 0]]] and by_sum.new_head_lens.tolist() == [[[4, 4]]]
    assert by_sum.evicted[0, 0, 0].tolist() == [False, True] + [False] * 6
    for cost in ["max", "sum"]:
        plan = schedule_evictions(metrics, lens, protected, torch.tensor([3]), 4, cost)
        assert plan.evict_blocks.tolist() == [[[2, 1]]]
        assert plan.new_head_lens.tolist() == [[[0, 0]]]
        assert plan.evicted[0, 0, 0].tolist() == [True] * 5 + [False] * 3


def test_nan_metrics_count_as_zero():
    metrics = torch.tensor([0.3, float("nan"), 0.2, 0.4]).view(1, 1, 1, 4)
    plan = schedule_evictions(
        metrics, torch.tensor([[[4]]]), torch.zeros(1, 1, 1, 4, dtype=torch.bool), torch.tensor([1]), 1
    )
    assert plan.evicted.view(-1).tolist() == [False, True, False, False]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.sampled_from([(1, 1), (2, 3), (3, 2)]),
    wanted=st.integers(0, 40),
    block_cost=st.sampled_from(["sum", "max"]),
)
def test_block_size_one_evicts_the_lowest_kvs(seed, shape, wanted, block_cost):
    num_layers, num_heads = shape
    metrics, lens, protected = _random_schedule_inputs(seed, 1, num_layers, num_heads, 1, False)
    plan = schedule_evictions(metrics, lens, protected, torch.tensor([wanted]), 1, block_cost)
    held = torch.arange(metrics.shape[-1]) < lens.unsqueeze(-1)
    candidates = held & ~protected
    values = torch.where(candidates, metrics, torch.tensor(float("inf")))
    lowest = torch.sort(values.reshape(-1), stable=True).indices[: min(wanted, int(candidates.sum()))]
    expected = torch.zeros(values.numel(), dtype=torch.bool)
    expected[lowest] = True
    assert torch.equal(plan.evicted.reshape(-1), expected)
    assert torch.equal(plan.new_head_lens, lens - plan.evicted.sum(-1))


# ---------------------------------------------------------------------------
# Protected window, sinks, closed form
# ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 5]),
    block_cost=st.sampled_from(["sum", "max"]),
)
def test_protected_window_and_sinks_are_never_evicted(seed, block_size, block_cost):
    rng = np.random.default_rng(seed)
    num_seqs, num_layers, num_heads, num_slots = 3, 2, 2, 6 * block_size
    context_lens = torch.tensor(rng.integers(0, 2 * num_slots, size=num_seqs))
    window = torch.tensor(rng.integers(0, 8, size=num_seqs))
    sinks = torch.tensor(rng.integers(0, 4, size=num_seqs))
    lens = torch.tensor(rng.integers(0, num_slots + 1, size=(num_seqs, num_layers, num_heads)))
    lens = torch.minimum(lens, context_lens.view(-1, 1, 1))
    # Each head holds a random sorted subset of the context's positions.
    positions = torch.zeros(num_seqs, num_layers, num_heads, num_slots, dtype=torch.int32)
    for s, l, h in itertools.product(range(num_seqs), range(num_layers), range(num_heads)):
        n = int(lens[s, l, h])
        positions[s, l, h, :n] = torch.tensor(np.sort(rng.permutation(int(context_lens[s]))[:n]))
        positions[s, l, h, n:] = int(rng.integers(0, 100))  # garbage
    protected = protected_slots(positions, lens, context_lens, window, sinks)
    for s, l, h, k in itertools.product(
        range(num_seqs), range(num_layers), range(num_heads), range(num_slots)
    ):
        p = int(positions[s, l, h, k])
        expected = k < lens[s, l, h] and (p >= context_lens[s] - window[s] or p < sinks[s])
        assert bool(protected[s, l, h, k]) == bool(expected)
    metrics = torch.tensor(rng.random((num_seqs, num_layers, num_heads, num_slots)), dtype=torch.float32)
    plan = schedule_evictions(metrics, lens, protected, torch.full((num_seqs,), 10**6), block_size, block_cost)
    assert not (plan.evicted & protected).any()


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    shape=st.sampled_from([(1, 1), (2, 3), (4, 2)]),
)
def test_evictable_blocks_closed_form_agrees_with_schedule(seed, block_size, shape):
    rng = np.random.default_rng(seed)
    num_seqs, (num_layers, num_heads) = 3, shape
    num_slots = 5 * block_size
    lens = torch.tensor(rng.integers(0, num_slots + 1, size=(num_seqs, num_layers, num_heads)))
    # Exactly p_s protected KVs in every head of sequence s (p_s <= its shortest head).
    counts = torch.tensor([int(rng.integers(0, int(lens[s].min()) + 1)) for s in range(num_seqs)])
    protected = torch.zeros(num_seqs, num_layers, num_heads, num_slots, dtype=torch.bool)
    for s, l, h in itertools.product(range(num_seqs), range(num_layers), range(num_heads)):
        chosen = rng.permutation(int(lens[s, l, h]))[: int(counts[s])]
        protected[s, l, h, torch.tensor(chosen, dtype=torch.int64)] = True
    metrics = torch.tensor(rng.random((num_seqs, num_layers, num_heads, num_slots)))
    for cost in ["max", "sum"]:
        plan = schedule_evictions(metrics, lens, protected, torch.full((num_seqs,), 10**9), block_size, cost)
        assert torch.equal(plan.evict_blocks.sum(dim=(1, 2)), evictable_blocks(lens, counts, block_size))
    # Realistic case: uncompressed heads (positions 0..len-1 of a context of len tokens).
    context = lens.amax(dim=(1, 2))
    window = torch.tensor(rng.integers(0, 3 * block_size, size=num_seqs))
    sinks = torch.tensor(rng.integers(0, 5, size=num_seqs))
    full = context.view(-1, 1, 1).expand_as(lens).contiguous()
    positions = torch.arange(num_slots).expand(num_seqs, num_layers, num_heads, num_slots)
    protected = protected_slots(positions, full, context, window, sinks)
    counts = protected_count(context, window, sinks)
    assert torch.equal(protected.sum(-1), counts.view(-1, 1, 1).expand_as(full))
    plan = schedule_evictions(metrics, full, protected, torch.full((num_seqs,), 10**9), block_size)
    assert torch.equal(plan.evict_blocks.sum(dim=(1, 2)), evictable_blocks(full, counts, block_size))


# ---------------------------------------------------------------------------
# MoveCache
# ---------------------------------------------------------------------------


def test_plan_moves_follows_algorithm_1():
    # len 8, new_len 4: evicted slots 1, 2 (kept region) and 4, 6; kept 5, 7 move.
    evicted = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    row, src, dst = plan_moves(evicted, torch.tensor([8, 5]), torch.tensor([4, 5]))
    # Walk [4, 8) backwards: 7 -> first hole 1, 5 -> next hole 2.
    assert row.tolist() == [0, 0] and src.tolist() == [7, 5] and dst.tolist() == [1, 2]
    with pytest.raises(ValueError):
        plan_moves(evicted, torch.tensor([8, 5]), torch.tensor([5, 5]))


def test_move_cache_moves_every_field_through_strided_views():
    pool = torch.randn(4, 2, 3, 5)
    key_cache, value_cache = pool[:, 0], pool[:, 1]
    metrics = torch.rand(4, 3)
    positions = torch.arange(12, dtype=torch.int32).view(4, 3)
    before = (key_cache.clone(), value_cache.clone(), metrics.clone(), positions.clone())
    src = (torch.tensor([3, 2]), torch.tensor([2, 0]))
    dst = (torch.tensor([0, 0]), torch.tensor([1, 2]))
    move_cache(KVPool(key_cache, value_cache, positions, metrics), *src, *dst)
    for now, old in zip((key_cache, value_cache, metrics, positions), before):
        assert torch.equal(now[dst], old[src])
        untouched = torch.ones(4, 3, dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(now[untouched], old[untouched])


class _Model:
    """A cache filled through ``append`` + ``reference_write_kv`` and a plain-Python reader."""

    def __init__(self, seed, num_seqs, num_layers, num_heads, block_size, head_dim=4, num_pages=400):
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = PerHeadPagedCache(
            num_pages, num_layers, num_heads, block_size, max_seqs=num_seqs, max_pages_per_head=40
        )
        buffer = torch.zeros(num_pages, 2, block_size, head_dim)  # strided K / V views
        self.key_cache, self.value_cache = buffer[:, 0], buffer[:, 1]
        self.pool = self.cache.kv_pool(self.key_cache, self.value_cache)
        self.slots = torch.tensor([self.cache.new_sequence() for _ in range(num_seqs)])
        self.context = [0] * num_seqs
        self.shape = (num_seqs, num_layers, num_heads)

    def append(self, num_new, tie_heavy):
        cache = self.cache
        num_seqs, num_layers, num_heads = self.shape
        positions = torch.cat(
            [torch.arange(self.context[s], self.context[s] + n) for s, n in enumerate(num_new)]
        )
        plan = cache.append(self.slots, torch.tensor(num_new), positions)
        assert torch.equal(  # fresh KVs start with metric 0
            cache.slot_metrics[plan.write_pages, plan.write_offsets],
            torch.zeros(plan.write_pages.shape),
        )
        head_dim = self.key_cache.shape[-1]
        for layer in range(num_layers):
            keys = torch.randn(len(positions), num_heads, head_dim, generator=self.generator)
            values = torch.randn(len(positions), num_heads, head_dim, generator=self.generator)
            reference_write_kv(self.key_cache, self.value_cache, keys, values,
                     plan.write_pages[layer], plan.write_offsets[layer])
        self.context = [c + n for c, n in zip(self.context, num_new)]
        # New random metrics everywhere (as if attention had been accumulated).
        fresh = torch.rand(cache.slot_metrics.shape, generator=self.generator)
        if tie_heavy:
            fresh = (fresh * 4).floor() / 4
        cache.slot_metrics.copy_(fresh)

    def head(self, s, l, h, length=None):
        """{position: (K, V, metric)} of logical slots [0, length) of one head."""
        cache, b = self.cache, self.cache.block_size
        slot = int(self.slots[s])
        length = int(cache.head_lens[slot, l, h]) if length is None else length
        out = {}
        for i in range(length):
            page, offset = int(cache.flat_page_tables()[slot, l, h, i // b]), i % b
            position = int(cache.slot_positions[page, offset])
            assert position not in out, "a position appears twice in one head"
            out[position] = (
                self.key_cache[page, offset].clone(),
                self.value_cache[page, offset].clone(),
                cache.slot_metrics[page, offset].clone(),
            )
        return out

    def logical(self, s, l, h, num_slots):
        """Metrics and positions of one head in logical order, padded to num_slots."""
        cache, b = self.cache, self.cache.block_size
        slot = int(self.slots[s])
        metrics = torch.zeros(num_slots)
        positions = torch.zeros(num_slots, dtype=torch.int64)
        for i in range(int(cache.head_lens[slot, l, h])):
            page, offset = int(cache.flat_page_tables()[slot, l, h, i // b]), i % b
            metrics[i] = cache.slot_metrics[page, offset]
            positions[i] = int(cache.slot_positions[page, offset])
        return metrics, positions

    def check_pages(self):
        cache = self.cache
        held = cache.pages_held(self.slots)
        pages = []
        for s, l, h in itertools.product(*map(range, self.shape)):
            pages += cache.flat_page_tables()[int(self.slots[s]), l, h, : int(held[s, l, h])].tolist()
        assert len(pages) == len(set(pages)), "a page appears in two tables"
        assert cache.allocator.num_free + len(pages) == cache.num_pages
        free = cache.allocator.free_stack[: cache.allocator.num_free].tolist()
        assert not set(free) & set(pages)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_seqs=st.integers(1, 3),
    shape=st.sampled_from([(1, 1), (1, 2), (2, 2), (3, 1)]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    block_cost=st.sampled_from(["max", "sum"]),
    tie_heavy=st.booleans(),
    rounds=st.integers(1, 3),
)
def test_compress_sequences_keeps_exactly_the_unevicted_kvs(
    seed, num_seqs, shape, block_size, block_cost, tie_heavy, rounds
):
    num_layers, num_heads = shape
    model = _Model(seed, num_seqs, num_layers, num_heads, block_size)
    rng, cache = model.rng, model.cache
    heads = list(itertools.product(range(num_seqs), range(num_layers), range(num_heads)))
    for _ in range(rounds):
        model.append(rng.integers(0, 3 * block_size + 3, size=num_seqs).tolist(), tie_heavy)
        before = {key: model.head(*key) for key in heads}
        old_lens = cache.head_lens[model.slots].clone()
        context = torch.tensor(model.context)
        window = torch.tensor(rng.integers(0, 6, size=num_seqs))
        sinks = torch.tensor(rng.integers(0, 3, size=num_seqs))
        wanted = torch.tensor(rng.integers(0, 3 * num_layers * num_heads + 1, size=num_seqs))

        # Independent prediction of the evicted set from a plain-Python gather.
        max_pages = max(1, int(((old_lens + block_size - 1) // block_size).max()))
        num_slots = max_pages * block_size
        metrics = torch.zeros(num_seqs, num_layers, num_heads, num_slots)
        positions = torch.zeros(num_seqs, num_layers, num_heads, num_slots, dtype=torch.int64)
        for s, l, h in heads:
            metrics[s, l, h], positions[s, l, h] = model.logical(s, l, h, num_slots)
        protected = protected_slots(positions, old_lens, context, window, sinks)
        expected = schedule_evictions(metrics, old_lens, protected, wanted, block_size, block_cost)

        result = compress_sequences(
            cache, model.pool, model.slots, wanted, context, window, sinks, block_cost=block_cost,
        )
        assert torch.equal(result.new_head_lens, expected.new_head_lens)
        assert torch.equal(result.evict_blocks, expected.evict_blocks)
        assert torch.equal(cache.head_lens[model.slots], result.new_head_lens)
        assert result.pages_freed == int(result.evict_blocks.sum())
        assert result.kvs_evicted == int((old_lens - result.new_head_lens).sum())
        for s, l, h in heads:
            evicted_positions = set(positions[s, l, h][expected.evicted[s, l, h]].tolist())
            kept = {p: kv for p, kv in before[(s, l, h)].items() if p not in evicted_positions}
            after = model.head(s, l, h)
            assert len(after) == int(result.new_head_lens[s, l, h])
            assert after.keys() == kept.keys()
            for position, (k, v, metric) in after.items():
                k0, v0, metric0 = kept[position]
                assert torch.equal(k, k0) and torch.equal(v, v0) and torch.equal(metric, metric0)
            for position in before[(s, l, h)]:  # protected KVs survive
                if position >= model.context[s] - int(window[s]) or position < int(sinks[s]):
                    assert position in after
        model.check_pages()
    held = int(cache.pages_held(model.slots).sum())
    assert cache.release(model.slots) == held
    assert cache.allocator.num_free == cache.num_pages


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4]),
    block_cost=st.sampled_from(["max", "sum"]),
)
def test_batched_compression_equals_one_sequence_at_a_time(seed, block_size, block_cost):
    num_seqs, num_layers, num_heads = 3, 2, 2
    models = [_Model(seed, num_seqs, num_layers, num_heads, block_size) for _ in range(2)]
    rng = np.random.default_rng(seed + 1)
    for _ in range(2):
        num_new = rng.integers(0, 4 * block_size + 3, size=num_seqs).tolist()
        tie_heavy = bool(rng.integers(0, 2))
        for model in models:
            model.append(num_new, tie_heavy)
        context = torch.tensor(models[0].context)
        window = torch.tensor(rng.integers(0, 5, size=num_seqs))
        sinks = torch.tensor(rng.integers(0, 3, size=num_seqs))
        wanted = torch.tensor(rng.integers(0, 10, size=num_seqs))
        batched, single = models
        result = compress_sequences(
            batched.cache, batched.pool, batched.slots, wanted, context, window, sinks,
            block_cost=block_cost,
        )
        freed = 0
        for s in range(num_seqs):
            pick = slice(s, s + 1)
            one = compress_sequences(
                single.cache, single.pool, single.slots[pick], wanted[pick],
                context[pick], window[pick], sinks[pick], block_cost=block_cost,
            )
            assert torch.equal(one.new_head_lens[0], result.new_head_lens[s])
            assert torch.equal(one.evict_blocks[0], result.evict_blocks[s])
            freed += one.pages_freed
        assert freed == result.pages_freed
        assert batched.cache.allocator.num_free == single.cache.allocator.num_free
        assert torch.equal(batched.cache.head_lens, single.cache.head_lens)
        for s, l, h in itertools.product(range(num_seqs), range(num_layers), range(num_heads)):
            a, b = batched.head(s, l, h), single.head(s, l, h)
            assert a.keys() == b.keys()
            for position in a:
                assert all(torch.equal(x, y) for x, y in zip(a[position], b[position]))
        for model in models:
            model.check_pages()


def test_compress_frees_pages_and_new_pages_reuse_them():
    """Lengths shrink to whole pages; appending afterwards allocates fresh slots
    past the compacted KVs and keeps their positions."""
    model = _Model(0, 1, 1, 2, 4, num_pages=8)
    model.append([10], tie_heavy=False)  # 2 heads x 3 pages = 6 of 8
    assert model.cache.allocator.num_free == 2
    result = compress_sequences(
        model.cache, model.pool, model.slots,
        torch.tensor([3]), torch.tensor([10]), torch.tensor([2]), torch.tensor([0]),
    )
    assert result.pages_freed == 3 and model.cache.allocator.num_free == 5
    assert int(result.new_head_lens.sum()) == 3 * 4
    model.append([5], tie_heavy=False)
    model.check_pages()
    for h in range(2):
        positions = sorted(model.head(0, 0, h))
        assert positions[-5:] == [10, 11, 12, 13, 14] and 8 in positions and 9 in positions


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 16]),
    frozen=st.sampled_from([(1,), (0,), (2,), (0, 2), (0, 1, 2)]),
    policy=st.sampled_from([None, "pyramidkv"]),
)
def test_frozen_layers_keep_every_kv_and_the_rest_compress_as_if_alone(seed, block_size, frozen, policy):
    """``layers=``: the layers not given (sliding-window layers, issue 60) keep every KV,
    page and metric; the given ones are scheduled exactly as the schedule alone would
    schedule a model made of only them (budget split included)."""
    from kvcompress.policies import resolve_policy

    num_seqs, num_layers, num_heads = 2, 3, 2
    model = _Model(seed, num_seqs, num_layers, num_heads, block_size)
    rng, cache = model.rng, model.cache
    model.append(rng.integers(block_size, 4 * block_size + 3, size=num_seqs).tolist(), tie_heavy=False)
    chosen = [layer for layer in range(num_layers) if layer not in frozen]
    heads = list(itertools.product(range(num_seqs), range(num_layers), range(num_heads)))
    before = {key: model.head(*key) for key in heads}
    old_lens = cache.head_lens[model.slots].clone()
    context = torch.tensor(model.context)
    window, sinks = torch.tensor([2, 1]), torch.tensor([1, 0])
    wanted = torch.tensor(rng.integers(1, 3 * num_heads * max(1, len(chosen)) + 1, size=num_seqs))
    resolved = resolve_policy(policy) if policy else None

    max_pages = max(1, int(((old_lens + block_size - 1) // block_size).max()))
    num_slots = max_pages * block_size
    metrics = torch.zeros(num_seqs, len(chosen), num_heads, num_slots)
    positions = torch.zeros(num_seqs, len(chosen), num_heads, num_slots, dtype=torch.int64)
    for s, (i, l), h in itertools.product(range(num_seqs), enumerate(chosen), range(num_heads)):
        metrics[s, i, h], positions[s, i, h] = model.logical(s, l, h, num_slots)
    lens = old_lens[:, chosen]
    if chosen:
        protected = protected_slots(positions, lens, context, window, sinks)
        expected = schedule_evictions(metrics, lens, protected, wanted, block_size, "max",
                                      split=resolved.split if resolved else None)

    result = compress_sequences(cache, model.pool, model.slots, wanted, context, window, sinks,
                                policy=resolved, layers=torch.tensor(chosen, dtype=torch.int64))
    for layer in frozen:
        assert torch.equal(result.new_head_lens[:, layer], old_lens[:, layer])
        assert int(result.evict_blocks[:, layer].sum()) == 0
        assert int(result.kept_unprotected_by_layer[layer]) == 0
    if chosen:
        assert torch.equal(result.new_head_lens[:, chosen], expected.new_head_lens)
        assert torch.equal(result.evict_blocks[:, chosen], expected.evict_blocks)
    else:
        assert result.pages_freed == 0
    assert result.pages_freed == int(result.evict_blocks.sum())
    assert torch.equal(cache.head_lens[model.slots], result.new_head_lens)
    for s, l, h in heads:
        after = model.head(s, l, h)
        if l in frozen:  # every KV where it was, with its metric
            assert after.keys() == before[(s, l, h)].keys()
            for position, kv in after.items():
                assert all(torch.equal(x, y) for x, y in zip(kv, before[(s, l, h)][position]))
    model.check_pages()
