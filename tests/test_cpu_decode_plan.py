"""``DecodeBatchPlan`` (the decode plan kept between steps, kvcompress.ops.cpu_decode_plan)
against its oracle: a twin cache driven by the rebuild-every-step path
(``append_one`` + ``plan_decode_step``), through random walks of decode steps with
page boundaries, compressions (heads shrunk), finishes, admissions and reorderings. After
every step both caches must be identical (lengths, held page ids, last pages, slot
positions and metrics, free pages) and so must the plans (write targets, tables over the
held pages, lengths, work split) and the kernel's outputs on the same queries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.ops import KVPool
from kvcompress.ops import cpu_attention
from kvcompress.ops.paged_cache import PerHeadPagedCache, pages_for


@pytest.fixture(autouse=True)
def _vllm_cpu_kernel():
    reason = cpu_attention.unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU kernel: {reason}")


NUM_LAYERS, NUM_PAGES, MAX_SEQS, MAX_PAGES = 3, 3000, 12, 40


class Twin:
    """One cache + kernel-layout pool; ``plan`` steps it incrementally when given."""

    def __init__(self, num_kv_heads: int, block_size: int, head_dim: int, group: int) -> None:
        from kvcompress.ops.cpu_decode_plan import DecodeBatchPlan

        self.cache = PerHeadPagedCache(NUM_PAGES, NUM_LAYERS, num_kv_heads, block_size, MAX_SEQS, MAX_PAGES)
        self.cache.slot_metrics.fill_(7.0)  # stale metrics of earlier occupants: appends zero them
        buffer = torch.randn((2, NUM_PAGES + 1, block_size, head_dim), generator=torch.Generator().manual_seed(0))
        key, value = cpu_attention.pool_views(buffer)
        self.pool = self.cache.kv_pool(key, value)
        self.num_q_heads = num_kv_heads * group
        self.plan = DecodeBatchPlan(self.cache, self.pool, self.num_q_heads)


def _prefill(twins, lengths: list[int]) -> list[int]:
    slots = []
    for twin in twins:
        slots = [twin.cache.new_sequence() for _ in lengths]
        positions = torch.cat([torch.arange(n) for n in lengths])
        twin.cache.append(torch.tensor(slots), torch.tensor(lengths), positions)
    return slots


def _shrink(cache: PerHeadPagedCache, slot: int, rng: np.random.Generator) -> None:
    """A compression's effect on the tables: every head of ``slot`` keeps a random
    prefix of its KVs (>= 1), pages past it freed (MoveCache's data moves do not touch
    the plan's arrays)."""
    old = cache.head_lens[slot].clone()
    new = torch.from_numpy(rng.integers(1, old.numpy() + 1))
    seq = torch.tensor([slot])
    tables = cache.page_tables_of(seq, int(pages_for(old, cache.block_size).max())).to(torch.int64)
    cache.free_tail_pages(seq, tables, new.unsqueeze(0))


def _assert_caches_equal(ours: PerHeadPagedCache, theirs: PerHeadPagedCache, live: list[int]) -> None:
    for name in ("head_lens", "slot_positions", "slot_metrics", "page_shares"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    held = pages_for(ours.head_lens, ours.block_size).unsqueeze(-1) > torch.arange(MAX_PAGES)
    assert torch.equal(ours.flat_page_tables()[held], theirs.flat_page_tables()[held])
    assert ours.allocator.num_free == theirs.allocator.num_free
    heads = ours.head_lens[live] > 0
    assert np.array_equal(ours.host.last_pages[live][heads.numpy()], theirs.host.last_pages[live][heads.numpy()])


def _assert_plans_equal(ours, theirs, ours_layers, theirs_layers, block_size: int) -> None:
    assert torch.equal(ours.write_pages, theirs.write_pages)
    assert torch.equal(ours.write_offsets.to(torch.int64), theirs.write_offsets)
    flat_slots = (theirs.write_pages * block_size + theirs.write_offsets).view(len(ours_layers), -1)
    for mine, want, slots in zip(ours_layers, theirs_layers, flat_slots, strict=True):
        # The flat slots vLLM's write op takes: the same targets, [B * H] int64.
        assert mine.write_slots.dtype == torch.int64 and torch.equal(mine.write_slots, slots)
        assert torch.equal(want.write_slots, slots)  # plan_decode_step's, from the tables
        assert torch.equal(mine.seq_lens, want.seq_lens)
        # The work split is an opaque blob (padding included): shared alike, outputs compared.
        shared = mine.scheduler_metadata is ours_layers[0].scheduler_metadata
        assert shared == (want.scheduler_metadata is theirs_layers[0].scheduler_metadata)
        assert mine.block_table.shape == want.block_table.shape
        used = pages_for(want.seq_lens, block_size).unsqueeze(-1) > torch.arange(want.block_table.shape[1])
        assert torch.equal(mine.block_table[used], want.block_table[used])
        assert (mine.metrics is None) == (want.metrics is None)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "shape", [(2, 4, 64, 16), (3, 2, 80, 32), (1, 8, 128, 16)], ids=["hkv2-g4-d64-b16", "hkv3-g2-d80-b32", "hkv1-g8-d128-b16"],
)
def test_incremental_plan_equals_the_rebuild_every_step(shape, seed):
    num_kv_heads, group, head_dim, block_size = shape
    rng = np.random.default_rng(seed)
    ours, theirs = Twin(num_kv_heads, block_size, head_dim, group), Twin(num_kv_heads, block_size, head_dim, group)
    twins = (ours, theirs)
    live = _prefill(twins, [int(n) for n in rng.integers(1, 3 * block_size, size=5)])
    rows_key = object()
    compressed = False
    for step in range(60):
        event = rng.random()
        if event < 0.08:  # a compression of one row (the runner's composition holds)
            slot = int(rng.choice(live))
            for twin in twins:
                _shrink(twin.cache, slot, np.random.default_rng(step))
            compressed = True
        elif event < 0.14 and len(live) > 1:  # a finish: new composition
            slot = live.pop(int(rng.integers(len(live))))
            for twin in twins:
                twin.cache.release(torch.tensor([slot]))
            rows_key = object()
        elif event < 0.20 and len(live) < MAX_SEQS - 2:  # an admission (prefilled), new composition
            live += _prefill(twins, [int(rng.integers(1, 2 * block_size))])
            rows_key = object()
        elif event < 0.24:  # vLLM reordered its batch: new composition
            rng.shuffle(live)
            rows_key = object()
        slots = np.asarray(live, np.int64)
        positions = ours.cache.host.head_lens[slots].max(axis=(1, 2)) + step  # any position: it is only stored
        metric_rows = torch.tensor([0]) if step % 5 == 0 else None
        # Never-compressed rows hold equal heads in every layer; after a shrink: checked.
        uniform = None if compressed else True
        plan, layers = ours.plan.step(rows_key, slots, positions.copy(), metric_rows, uniform)
        want = theirs.cache.append_one(torch.from_numpy(slots), torch.from_numpy(positions.copy()), host_slots=slots)
        want_layers = cpu_attention.plan_decode_step(
            theirs.pool, theirs.cache.tables, theirs.cache.head_lens, torch.from_numpy(slots),
            theirs.num_q_heads, metric_rows, uniform,
        )
        _assert_caches_equal(ours.cache, theirs.cache, live)
        _assert_plans_equal(plan, want, layers, want_layers, block_size)
        query = torch.randn((len(live), theirs.num_q_heads, head_dim), generator=torch.Generator().manual_seed(step))
        for layer in range(NUM_LAYERS):
            got = cpu_attention.decode_planned(query, ours.pool, layers[layer], 0.1, torch.empty_like(query), 2)
            expected = cpu_attention.decode_planned(query, theirs.pool, want_layers[layer], 0.1, torch.empty_like(query), 2)
            assert torch.equal(got, expected)
    # It did advance in place (not a rebuild every step) and did rebuild on changes.
    assert 1 < ours.plan.rebuilds < 40


def test_a_plan_is_rebuilt_after_any_other_change_to_the_cache():
    """The cache's version: a change the runner did not announce (here a shrink with the
    same composition) still makes the next step a rebuild."""
    ours = Twin(2, 16, 64, 2)
    live = _prefill([ours], [20, 33])
    slots = np.asarray(live, np.int64)
    key = object()
    for step in range(3):
        ours.plan.step(key, slots, np.array([20 + step, 33 + step]), None, True)
    assert ours.plan.rebuilds == 1
    _shrink(ours.cache, live[1], np.random.default_rng(0))
    shrunk = ours.cache.head_lens[live[1]].clone()
    _, layers = ours.plan.step(key, slots, np.array([30, 40]), None, None)
    assert ours.plan.rebuilds == 2
    # The rebuilt plan reads the shrunk heads, each one KV longer (row 1 of every layer;
    # the kernel's lengths are head-major, [H, B]).
    planned = torch.stack([layer.seq_lens.view(-1, 2)[:, 1] for layer in layers])
    assert torch.equal(planned.to(torch.int64), shrunk + 1)
