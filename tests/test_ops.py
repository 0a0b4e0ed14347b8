"""Kernel-layer ops against independent oracles (no vLLM needed)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.ops import (
    OutOfPagesError,
    PageAllocator,
    PagedBatch,
    PerHeadPagedCache,
    reference_paged_attention,
)
from paged_cases import scrambled_cache
from kvcompress.ops.paged_cache import pages_for
from kvcompress.page_accounting import PageAccounting


def test_allocator_hands_out_distinct_pages_and_takes_them_back():
    allocator = PageAllocator(10)
    pages, offsets = allocator.allocate_for(torch.tensor([3, 0, 4]))
    assert offsets.tolist() == [0, 3, 3, 7]
    assert len(set(pages.tolist())) == 7 and allocator.num_free == 3
    with pytest.raises(OutOfPagesError):
        allocator.allocate(4)
    allocator.free(pages[:5])
    assert allocator.num_free == 8
    again = allocator.allocate(8)
    assert sorted(again.tolist()) == sorted(set(range(10)) - set(pages[5:].tolist()))
    allocator.free(again)
    allocator.free(pages[5:])
    with pytest.raises(RuntimeError, match="double free"):
        allocator.free(torch.tensor([0]))


def _ascending_neighbours(cache: PerHeadPagedCache, slots: list[int]) -> float:
    """Share of a head's consecutive table entries that are page ids ``p, p + 1``."""
    held = cache.pages_held(torch.tensor(slots))
    tables = cache.page_tables_of(torch.tensor(slots), int(held.max())).to(torch.int64)
    steps = tables.diff(dim=-1)
    in_use = torch.arange(1, tables.shape[-1]) < held.unsqueeze(-1)
    return float((steps[in_use] == 1).float().mean())


def test_prompt_pages_stay_ascending_runs_as_sequences_come_and_go():
    """Waves of 4 sequences (a 2048-token prompt each, then 256 decode tokens, then
    released): each head's pages stay ascending neighbours (what the CPU kernel reads
    fastest, bench_cpu_page_size.py) except where decode pages join, wave after wave.
    Brute-force count over the tables; a last-in-first-out stack handing out pages in
    the order they were pushed back gives descending runs that break up."""
    layers, heads, block = 4, 3, 64
    cache = PerHeadPagedCache(4 * 37 * layers * heads + 8, layers, heads, block, max_seqs=4, max_pages_per_head=37)
    for wave in range(4):
        slots = [cache.new_sequence() for _ in range(4)]
        for slot in slots:
            cache.append(torch.tensor([slot]), torch.tensor([2048]), torch.arange(2048))
        batch = torch.tensor(slots)
        for step in range(256):
            cache.append(batch, torch.ones(4, dtype=torch.int64), torch.full((4,), 2048 + step))
        # 32 prompt pages then 4 decode pages per head: 31 of 35 steps can be +1.
        assert _ascending_neighbours(cache, slots) >= 0.85, wave
        cache.release(batch)
    assert cache.allocator.num_free == cache.allocator.num_pages


def test_allocation_hands_a_requester_ascending_ids():
    allocator = PageAllocator(64)
    allocator.free(allocator.allocate(64)[torch.randperm(64, generator=torch.Generator().manual_seed(0))])
    pages, offsets = allocator.allocate_for(torch.tensor([5, 9]))
    assert pages.tolist() == sorted(pages.tolist())
    assert allocator.allocate(1).numel() == 1


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.lists(st.integers(0, 40), min_size=3, max_size=3), min_size=1, max_size=6
    ),
    release_mask=st.lists(st.booleans(), min_size=3, max_size=3),
    block_size=st.sampled_from([4, 16]),
    decode_steps=st.integers(0, 9),
)
def test_paged_cache_tables_match_a_brute_force_model(steps, release_mask, block_size, decode_steps):
    """Every KV ends up at a distinct slot whose recorded position is its token's,
    pages held = ceil(len / b) per head, and releasing returns exactly those pages
    (prompt-like steps, then one-token decode steps: ``append_one``)."""
    layers, heads = 2, 3
    cache = PerHeadPagedCache(4000, layers, heads, block_size, max_seqs=3, max_pages_per_head=64)
    slots = torch.tensor([cache.new_sequence() for _ in range(3)])
    lengths = [0, 0, 0]
    seen = {}  # (seq, layer, head, position) -> (page, offset)
    for step in steps + [[1, 1, 1]] * decode_steps:
        num_new = torch.tensor(step)
        positions = torch.cat([torch.arange(lengths[i], lengths[i] + n) for i, n in enumerate(step)])
        plan = cache.append(slots, num_new, positions)
        token = 0
        for seq, count in enumerate(step):
            for i in range(count):
                for layer in range(layers):
                    for head in range(heads):
                        seen[(seq, layer, head, lengths[seq] + i)] = (
                            int(plan.write_pages[layer, token, head]),
                            int(plan.write_offsets[layer, token, head]),
                        )
                token += 1
            lengths[seq] += count
    assert len(set(seen.values())) == len(seen)  # no two KVs share a slot
    for (seq, layer, head, position), (page, offset) in seen.items():
        assert int(cache.slot_positions[page, offset]) == position
        # The page table reaches the same slot through the logical index.
        assert int(cache.flat_page_tables()[slots[seq], layer, head, position // block_size]) == page
        assert offset == position % block_size
    held = cache.pages_held(slots)
    expected = torch.tensor([math.ceil(n / block_size) for n in lengths]).view(3, 1, 1)
    assert torch.equal(held, expected.expand(3, layers, heads))
    assert cache.allocator.num_used == int(held.sum())
    per_sequence = [math.ceil(n / block_size) * layers * heads for n in lengths]
    assert cache.pages_held_per_sequence(slots.tolist()) == per_sequence
    host, cache.host = cache.host, None  # the device (torch) path
    assert cache.pages_held_per_sequence(slots.tolist()) == per_sequence
    cache.host = host
    to_release = slots[torch.tensor(release_mask)]
    freed = cache.release(to_release)
    assert freed == int(held[torch.tensor(release_mask)].sum())
    cache.release(slots[~torch.tensor(release_mask)])
    assert cache.allocator.num_free == cache.num_pages


@pytest.mark.parametrize("host_views", [True, False], ids=["numpy", "torch"])
def test_append_one_equals_the_general_append(host_views):
    """The decode fast path (on a CPU cache through its numpy views, else torch ops, as
    on a GPU) places KVs, takes pages, zeroes metrics and updates tables exactly as the
    general path does, page boundaries crossed included."""
    twins = [PerHeadPagedCache(500, 2, 3, 4, max_seqs=4, max_pages_per_head=32) for _ in range(2)]
    assert twins[0].host is not None
    if not host_views:
        twins[0].host = None
    for cache in twins:
        slots = torch.tensor([cache.new_sequence() for _ in range(3)])
        cache.append(slots, torch.tensor([5, 8, 3]), torch.cat([torch.arange(5), torch.arange(8), torch.arange(3)]))
        cache.slot_metrics.fill_(7.0)  # stale metrics of earlier occupants
    lengths = torch.tensor([5, 8, 3])
    for _ in range(11):
        one = twins[0].append_one(slots, lengths.clone())
        general = twins[1]._append_tokens(slots, torch.ones(3, dtype=torch.int64), lengths.clone())
        assert torch.equal(one.write_pages, general.write_pages)
        assert torch.equal(one.write_offsets, general.write_offsets)
        lengths += 1
    for name in ("head_lens", "slot_positions", "slot_metrics"):
        assert torch.equal(getattr(twins[0], name), getattr(twins[1], name)), name
    held = pages_for(twins[0].head_lens, 4).unsqueeze(-1) > torch.arange(32)  # [S, L, H, P]
    assert torch.equal(twins[0].flat_page_tables()[held], twins[1].flat_page_tables()[held])
    assert twins[0].tables.chunk_allocator.num_free == twins[1].tables.chunk_allocator.num_free
    assert int((twins[0].slot_metrics == 0).sum()) == 11 * 3 * 2 * 3
    assert twins[0].allocator.num_free == twins[1].allocator.num_free


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_fill_page_tables_matches_a_python_loop(backend):
    """The allocator's page-table scatter (dispatched; on CPU every choice but a forced
    "cuda" runs the reference) against a per-page loop, zero demands included."""
    from kvcompress.ops import dispatch
    from kvcompress.ops.page_tables import fill_page_tables

    generator = torch.Generator().manual_seed(7)
    num_rows, max_pages = 24, 10
    tables = torch.randint(0, 1000, (2, 3, 4, max_pages), generator=generator)  # rows = 2*3*4
    rows = torch.randperm(num_rows, generator=generator)[:15]
    first_column = torch.randint(0, 5, (15,), generator=generator)
    demand = torch.randint(0, 6, (15,), generator=generator)
    demand[3] = 0
    offsets = torch.zeros(16, dtype=torch.int64)
    torch.cumsum(demand, 0, out=offsets[1:])
    pages = torch.randperm(5000, generator=generator)[: int(offsets[-1])]
    expected = tables.clone().view(num_rows, max_pages)
    for r in range(15):
        for j in range(int(demand[r])):
            expected[rows[r], first_column[r] + j] = pages[offsets[r] + j]
    direct = tables.clone()
    fill_page_tables(direct, pages, offsets, first_column, rows)
    assert torch.equal(direct.view(num_rows, max_pages), expected)
    with dispatch.use_backend(backend):
        dispatched = tables.clone()
        dispatch.fill_page_tables(dispatched, pages, offsets, first_column, rows)
    assert torch.equal(dispatched.view(num_rows, max_pages), expected)
    assert dispatch.available_backends("cpu", "fill_page_tables") == ["reference"]
    with dispatch.use_backend("cuda"), pytest.raises(dispatch.BackendUnavailableError, match="fill_page_tables"):
        dispatch.fill_page_tables(tables.clone(), pages, offsets, first_column, rows)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_matches_float64_dense_oracle(dtype, tolerance, block_size):
    generator = torch.Generator().manual_seed(1)
    num_kv_heads, group, head_dim = 2, 4, 64
    lengths = torch.tensor([[37, 5], [1, 70], [33, 33]])
    pool, tables, dense = scrambled_cache(2, lengths, block_size, head_dim, dtype)
    # Seq 0: 3 prefill-continuation queries; seq 1: one decode; seq 2: 7 queries.
    query_lens = [3, 1, 7]
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    query_positions = []
    for s, count in enumerate(query_lens):
        top = max(int(dense[(s, h)][2].max()) if lengths[s, h] else 0 for h in range(num_kv_heads))
        query_positions += list(range(top - count + 1, top + 1))
    query_positions = torch.tensor(query_positions)
    query = torch.randn(query_start[-1], num_kv_heads * group, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    batch = PagedBatch(tables, lengths, query_start, query_positions)
    out = reference_paged_attention(query, pool, batch, scale, max_query_chunk=4)
    for s in range(3):
        for t in range(query_start[s], query_start[s + 1]):
            for qh in range(num_kv_heads * group):
                k, v, positions = dense[(s, qh // group)]
                visible = positions <= query_positions[t]
                if not visible.any():
                    expected = torch.zeros(head_dim, dtype=torch.float64)
                else:
                    scores = (k[visible] @ query[t, qh].double()) * scale
                    expected = torch.softmax(scores, 0) @ v[visible]
                assert torch.allclose(out[t, qh].double(), expected, atol=tolerance, rtol=tolerance)


def test_page_accounting_counts_ceil_of_head_lengths():
    accounting = PageAccounting(num_pages=200, num_layers=2, num_kv_heads=3, block_size=16, max_requests=1)
    assert accounting.pages_to_grow("a", 17) == 2 * 6
    accounting.grow("a", 17)
    assert accounting.pages_held("a") == 12 and accounting.num_free_pages == 188
    assert accounting.pages_to_grow("a", 32) == 0
    accounting.grow("b", 1)  # forces the row table to grow
    shrunk = np.array([[1, 16, 17], [0, 5, 2]])
    assert accounting.set_head_lens("a", shrunk) == 12 - (1 + 1 + 2 + 0 + 1 + 1)
    # Growth adds the same number of tokens to every head.
    assert accounting.pages_to_grow("a", 17 + 15) == int(
        np.ceil((shrunk + 15) / 16).sum() - np.ceil(shrunk / 16).sum()
    )
    accounting.check_consistent()
    assert accounting.release("a") == 6 and accounting.release("b") == 6
    assert accounting.num_free_pages == 200


def test_page_accounting_decode_growth_matches_a_brute_force_recount():
    """Decode steps grow a request a token at a time through the 'room' fast path (no
    array op while every head has space in its last page; fits_in_room / grow_in_room
    defer even that until the arrays are read). Against a recount of
    ceil(len / b) after every operation: growth by 1-3 tokens, evictions that shorten
    heads unevenly, compressions pending and adopted."""
    rng = np.random.default_rng(0)
    block, layers, heads = 4, 2, 3
    accounting = PageAccounting(num_pages=10_000, num_layers=layers, num_kv_heads=heads, block_size=block)
    lens = np.zeros((layers, heads), np.int64)
    logical = 0
    for step in range(400):
        op = rng.random()
        if op < 0.85 or logical == 0:
            growth = int(rng.integers(1, 4))
            want = int(np.ceil((lens + growth) / block).sum() - np.ceil(lens / block).sum())
            # The scheduler's decode route: no page needed -> recorded, arrays later.
            assert accounting.fits_in_room("r", logical + growth) == (want == 0 and logical > 0), step
            if want == 0 and logical > 0 and rng.random() < 0.7:
                accounting.grow_in_room("r", logical + growth)
            else:
                assert accounting.pages_to_grow("r", logical + growth) == want, step
                assert accounting.grow("r", logical + growth) == want
            lens += growth
            logical += growth
        elif op < 0.93:
            lens = np.minimum(lens, rng.integers(1, logical + 1, lens.shape))
            accounting.set_head_lens("r", lens.copy())
        else:  # a compression: pages charged up front, exact lengths adopted later
            accounting.mark_compressed("r", 0)
            assert accounting.pages_to_grow("r", logical + 1) == layers * heads  # upper bound while pending
            lens = np.minimum(lens, rng.integers(1, logical + 1, lens.shape))
            accounting.adopt("r", lens.copy())
        if step % 5 == 0:  # otherwise fast-path growth stays deferred for a few steps
            accounting.check_consistent()
            assert np.array_equal(accounting.head_lens_of("r"), lens)
            assert accounting.logical_len("r") == logical
        assert accounting.pages_held("r") == int(np.ceil(lens / block).sum())


def test_other_requests_page_counts_are_exact_while_one_has_growth_deferred():
    """A request's own page count and length need the arrays caught up only when that
    request has growth pending: asking for a waiting request (no row) or another running
    one leaves the deferred growth pending, and every answer equals a recount."""
    block, layers, heads = 4, 2, 3
    accounting = PageAccounting(num_pages=10_000, num_layers=layers, num_kv_heads=heads, block_size=block)
    accounting.grow("r", 9)  # 3 pages per head, room for 3 more tokens
    accounting.grow("o", 6)  # 2 pages per head, room for 2
    accounting.grow_in_room("r", 11)
    for tokens in (1, 4, 5, 13):
        assert accounting.pages_to_grow("waiting", tokens) == -(-tokens // block) * layers * heads
        assert accounting.pages_to_grow("o", tokens) == max(-(-tokens // block) - 2, 0) * layers * heads
    assert accounting.logical_len("o") == 6 and accounting.logical_len("waiting") == 0
    free = 10_000 - (3 + 2) * layers * heads
    assert accounting.num_free_pages == free
    for tokens, reserve in ((5, 0), (40_000, 0), (4, free - layers * heads), (4, free - layers * heads + 1)):
        need = -(-tokens // block) * layers * heads
        assert accounting.shortfall("waiting", tokens, reserve) == need + reserve - free
    assert accounting.deferred_growth == {"r": 11}  # still pending: nothing read r's rows
    assert accounting.pages_to_grow("r", 13) == layers * heads  # r's own question catches up
    assert accounting.deferred_growth == {} and accounting.logical_len("r") == 11
    accounting.check_consistent()


@pytest.mark.parametrize("path", ["general", "decode-numpy", "decode-torch"])
def test_a_head_past_its_page_table_is_refused(path):
    """Growing a head past ``max_pages_per_head`` pages (longer than max_model_len) raises
    before any page is taken, on the general append and both decode fast paths."""
    cache = PerHeadPagedCache(100, 2, 2, 4, max_seqs=2, max_pages_per_head=3)
    if path == "decode-torch":
        cache.host = None
    slots = torch.tensor([cache.new_sequence()])
    cache.append(slots, torch.tensor([12]), torch.arange(12))  # 3 full pages per head
    free = cache.allocator.num_free
    with pytest.raises(RuntimeError, match="more than 3 pages"):
        if path == "general":
            cache.append(slots, torch.tensor([2]), torch.arange(12, 14))
        else:
            cache.append_one(slots, torch.tensor([12]))
    assert cache.allocator.num_free == free


def test_fp8_pages_gather_and_scatter_as_bytes_and_saturate():
    """FP8 pages move through torch's index kernels as bytes (float8 lacks them on some
    devices); a write saturates at the format's largest finite value, as vLLM's does."""
    from kvcompress.ops.kv_pool import gather_pages, scatter_pages

    generator = torch.Generator().manual_seed(0)
    for page_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        buffer = torch.zeros(6, 2, 4, 8, dtype=page_dtype)
        key = buffer[:, 0]  # strided, as the engine's halves
        values = torch.randn(5, 8, generator=generator) * 4
        values[0, 0], values[1, 1] = 1e6, -1e6
        pages, offsets = torch.tensor([0, 2, 2, 5, 3]), torch.tensor([1, 0, 3, 2, 2])
        scatter_pages(key, (pages, offsets), values)
        limit = torch.finfo(page_dtype).max
        want = values.clamp(-limit, limit).to(page_dtype)
        assert torch.equal(key[pages, offsets].float(), want.float())
        assert key[0, 1, 0].item() == limit and key[2, 0, 1].item() == -limit
        assert torch.equal(buffer[:, 1].float(), torch.zeros(6, 4, 8))  # V untouched
        tables = torch.tensor([[2, 0], [5, 5]])
        gathered = gather_pages(key, tables)
        assert gathered.dtype == page_dtype and gathered.shape == (2, 2, 4, 8)
        assert torch.equal(gathered.float(), key.float()[tables])
