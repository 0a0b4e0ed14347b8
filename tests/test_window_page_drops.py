"""Sliding-window heads give back the pages behind their window (issue 60; no vLLM).

The scheduler decides (``PageAccounting.drop_behind_windows``), the worker's cache acts
(``PerHeadPagedCache.drop_leading_pages``). Checked against independent oracles: the
float64 banded dense attention for every query of a chunked prefill and decodes with the
pages dropped as the window moves (reference and vLLM's CPU kernel, which counts its window
in slots); a per-position model of each head for the scheduler's counts (every position a
later query can see is still held, and no page without one is).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.ops import PagedBatch, PerHeadPagedCache, reference_paged_attention, reference_write_kv
from kvcompress.ops.reference_attention import dense_causal_attention
from kvcompress.page_accounting import PageAccounting

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 3, 64, 16


def _attention_backends():
    from kvcompress.ops import cpu_attention

    backends = [("reference", reference_paged_attention)]
    if cpu_attention.unavailable_reason() is None:
        backends.append(("vllm_cpu", cpu_attention.paged_attention_cpu))
    return backends


def _pool(cache: PerHeadPagedCache, backend: str):
    from kvcompress.ops import cpu_attention

    num_pages = cache.num_pages
    if backend == "vllm_cpu":
        return cache.kv_pool(*cpu_attention.pool_views(torch.zeros(2, num_pages, BLOCK, HEAD_DIM)))
    buffer = torch.zeros(num_pages, 2, BLOCK, HEAD_DIM)
    return cache.kv_pool(buffer[:, 0], buffer[:, 1])


@pytest.mark.parametrize("backend", [name for name, _ in _attention_backends()])
@pytest.mark.parametrize("window", [1, 7, 16, 30, 40])
def test_dropping_pages_behind_the_window_keeps_every_query_exact(backend, window):
    """Two sequences, layer 0 windowed and layer 1 full attention; before each step the
    windowed heads drop the token blocks below ``q - W + 1`` (``q``: the step's first
    query position). Every query of both layers equals the float64 dense oracle (banded
    for layer 0), and the dropped pages are back in the allocator."""
    attend = dict(_attention_backends())[backend]
    torch.manual_seed(window)
    cache = PerHeadPagedCache(96, 2, NUM_KV_HEADS, BLOCK, max_seqs=2, max_pages_per_head=16)
    pool = _pool(cache, backend)
    schedules = {0: [(0, 20), (20, 44), (44, 45), (45, 46), (46, 79), (79, 80)],
                 1: [(0, 50), (50, 51), (51, 52), (52, 90), (90, 91), (91, 92)]}
    seqs = {s: torch.tensor([cache.new_sequence()]) for s in schedules}
    totals = {s: schedules[s][-1][1] for s in schedules}
    q = {s: torch.randn(2, totals[s], NUM_KV_HEADS * GROUP, HEAD_DIM) for s in schedules}
    kv = {s: torch.randn(2, 2, totals[s], NUM_KV_HEADS, HEAD_DIM) for s in schedules}  # [layer, k/v]
    out = {s: torch.empty_like(q[s]) for s in schedules}
    dropped = {s: 0 for s in schedules}
    freed_total = 0
    for step in range(len(schedules[0])):
        for s, schedule in schedules.items():
            start, end = schedule[step]
            due = max(start - window + 1, 0) // BLOCK
            drop = torch.tensor([[due - dropped[s], 0]])
            free_before = cache.allocator.num_free
            freed = cache.drop_leading_pages(seqs[s], drop)
            assert freed == (due - dropped[s]) * NUM_KV_HEADS == cache.allocator.num_free - free_before
            freed_total += freed
            dropped[s] = due
            plan = cache.append(seqs[s], torch.tensor([end - start]), torch.arange(start, end))
            for layer in range(2):
                reference_write_kv(pool.key_cache, pool.value_cache, kv[s][layer, 0, start:end],
                                   kv[s][layer, 1, start:end], plan.write_pages[layer], plan.write_offsets[layer])
                batch = PagedBatch(cache.flat_page_tables()[seqs[s], layer], cache.head_lens[seqs[s], layer],
                                   [0, end - start], torch.arange(start, end),
                                   sliding_window=window if layer == 0 else None)
                attend(q[s][layer, start:end], pool, batch, HEAD_DIM**-0.5, out=out[s][layer, start:end])
            lens = cache.head_lens[seqs[s]][0]
            assert lens[0].tolist() == [end - due * BLOCK] * NUM_KV_HEADS and lens[1].tolist() == [end] * NUM_KV_HEADS
        assert cache.allocator.num_used == int(cache.pages_held().sum())
    assert freed_total > 0
    for s in schedules:
        for layer in range(2):
            expected = dense_causal_attention(q[s][layer], kv[s][layer, 0], kv[s][layer, 1], HEAD_DIM**-0.5,
                                              sliding_window=window if layer == 0 else None)
            assert torch.allclose(out[s][layer].double(), expected, atol=1e-4), (s, layer)
    cache.release(torch.tensor([0, 1]))
    assert cache.allocator.num_free == cache.num_pages
    assert cache.tables.chunk_allocator.num_used == 0


def test_a_head_sharing_its_prefix_drops_its_references_not_the_pages():
    """A slot that shares another's leading pages (a prefix-cache hit) and drops them lets
    go of its references only: the pages stay for their other holder, the shared chunk
    tables are not rewritten under it, and everything is free once both are released."""
    cache = PerHeadPagedCache(64, 2, NUM_KV_HEADS, BLOCK, max_seqs=2, max_pages_per_head=16)
    source, sharer = cache.new_sequence(), cache.new_sequence()
    cache.append(torch.tensor([source]), torch.tensor([3 * BLOCK]), torch.arange(3 * BLOCK))
    before = cache.flat_page_tables()[source].clone()
    cache.share_prefix(sharer, source, 3)
    cache.append(torch.tensor([sharer]), torch.tensor([5]), torch.arange(3 * BLOCK, 3 * BLOCK + 5))
    used = cache.allocator.num_used
    assert cache.drop_leading_pages(torch.tensor([sharer]), torch.tensor([[2, 0]])) == 0
    assert cache.allocator.num_used == used
    assert torch.equal(cache.flat_page_tables()[source, :, :, :3], before[:, :, :3])
    sharer_tables = cache.flat_page_tables()[sharer]
    assert torch.equal(sharer_tables[0, :, :1], before[0, :, 2:3])  # its third page is now its first
    assert torch.equal(sharer_tables[1, :, :3], before[1, :, :3])  # the full layer is untouched
    assert cache.head_lens[sharer, 0].tolist() == [BLOCK + 5] * NUM_KV_HEADS
    cache.release(torch.tensor([source]))
    assert cache.allocator.num_used == int(cache.pages_held(torch.tensor([sharer])).sum())
    cache.release(torch.tensor([sharer]))
    assert cache.allocator.num_free == cache.num_pages and cache.tables.chunk_allocator.num_used == 0


def test_dropping_more_than_a_head_holds_is_refused():
    cache = PerHeadPagedCache(16, 1, 1, BLOCK, max_seqs=1, max_pages_per_head=4)
    slot = torch.tensor([cache.new_sequence()])
    cache.append(slot, torch.tensor([BLOCK + 1]), torch.arange(BLOCK + 1))
    with pytest.raises(ValueError, match="more pages than it holds"):
        cache.drop_leading_pages(slot, torch.tensor([[3]]))


@pytest.mark.parametrize("ranks, grant", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_scheduler_counts_match_a_per_position_model_of_each_head(ranks, grant):
    """Random requests (prompt chunks, decodes, releases) on a model with two windowed
    layers (windows 20 and 37) and a full one, ``drop_behind_windows`` before each step.
    A per-position model of every windowed head says what must be held: each position a
    query of the next step or later can see (``>= q - W + 1``), and which pages may go
    (a page holding none of those). The counts match it, the drops ordered are exactly
    the pages given back, and the accounting's own consistency check holds (its room
    too: with pages counted in pairs, ``grant`` 2, a head shortened from its front may reach
    its next pair sooner)."""
    rng = np.random.default_rng(ranks)
    windows = (20, None, 37)
    heads = 2 * ranks
    accounting = PageAccounting(400 * ranks, 3, heads, BLOCK, max_requests=4, num_ranks=ranks,
                                compressible_layers=(1,), layer_windows=windows, grant_pages=grant)
    held_from: dict[str, list[int]] = {}  # request -> first held position of each windowed layer
    lengths: dict[str, int] = {}
    for step in range(300):
        free_before = accounting.free_pages.copy()
        drops = accounting.drop_behind_windows()
        for request_id, by_layer in drops.items():
            assert by_layer[1] == 0 and (by_layer >= 0).all() and by_layer.any()
        freed = accounting.free_pages - free_before
        if grant == 1:  # (in pairs a dropped page may leave its pair counted)
            assert (freed == sum(int(d.sum()) for d in drops.values()) * heads // ranks).all()
        for request_id, q in lengths.items():
            for index, layer in enumerate((0, 2)):
                first = held_from[request_id][index] + BLOCK * int(drops.get(request_id, np.zeros(3, int))[layer])
                assert first <= max(q - windows[layer] + 1, 0), "dropped a position a later query sees"
                assert first + BLOCK > max(q - windows[layer] + 1, 0) or first + BLOCK > q, "kept a page no query sees"
                held_from[request_id][index] = first
        # This step: a new request, growth of some, a release.
        if len(lengths) < 3 and rng.random() < 0.2:
            request_id = f"r{step}"
            lengths[request_id], held_from[request_id] = 0, [0, 0]
        for request_id in list(lengths):
            if rng.random() < 0.05:
                accounting.release(request_id)
                del lengths[request_id], held_from[request_id]
                continue
            grow = int(rng.choice([1, 1, 1, 7, 40]))
            if accounting.pages_to_grow(request_id, lengths[request_id] + grow) <= accounting.num_free_pages // ranks:
                if accounting.fits_in_room(request_id, lengths[request_id] + grow):
                    accounting.grow_in_room(request_id, lengths[request_id] + grow)
                else:
                    accounting.grow(request_id, lengths[request_id] + grow)
                lengths[request_id] += grow
        accounting.check_consistent()
        for request_id, q in lengths.items():
            lens = accounting.head_lens_of(request_id)
            assert (lens[1] == q).all()
            for index, layer in enumerate((0, 2)):
                assert (lens[layer] == q - held_from[request_id][index]).all()
            def counted(n):
                return -(-(-(-n // BLOCK)) // grant) * grant

            pages = sum(counted(q - held_from[request_id][i]) for i in range(2)) + counted(q)
            assert accounting.pages_held(request_id) == pages * heads
    assert accounting.dropped_blocks.sum() > 0


def test_requests_with_prefix_cache_groups_or_a_pending_compression_drop_nothing():
    accounting = PageAccounting(200, 2, 1, BLOCK, layer_windows=(8, None))
    for request_id in ("plain", "shared", "pending"):
        accounting.grow(request_id, 100)
    accounting.share_blocks("shared", 2)
    accounting.mark_compressed("pending", 1)
    drops = accounting.drop_behind_windows()
    assert list(drops) == ["plain"] and drops["plain"].tolist() == [(100 - 8 + 1) // BLOCK, 0]
    assert accounting.drop_behind_windows() == {}  # nothing more until the request grows


@pytest.mark.parametrize("ranks, grant", [(1, 1), (2, 2)])
def test_admission_counts_a_window_head_at_its_window_plus_the_tokens_in_flight(ranks, grant):
    """vLLM's admission gate (the whole sequence must fit) counts a sliding-window head at
    ``min(ceil(F / b), ceil((W - 1 + in_flight) / b) + 1)`` pages, a full-attention head at
    ``ceil(F / b)``: checked against a per-layer sum, for new requests and for one
    part-way through its prompt."""
    windows, heads = (20, None, 37), 2 * ranks
    accounting = PageAccounting(4000 * ranks, 3, heads, BLOCK, max_requests=4, num_ranks=ranks,
                                compressible_layers=(1,), layer_windows=windows, grant_pages=grant)

    def counted(pages):
        return -(-pages // grant) * grant

    def window_pages(tokens, window, in_flight):
        return min(-(-tokens // BLOCK), -(-(window - 1 + in_flight) // BLOCK) + 1)

    for full in (1, 19, 20, 50, 57, 300):
        for in_flight in (1, 16, 33):
            pages = sum(counted(-(-full // BLOCK) if w is None else window_pages(full, w, in_flight)) for w in windows)
            free = int(accounting.free_pages[0])
            assert accounting.whole_sequence_shortfall("new", full, in_flight) == pages * heads // ranks - free
            assert accounting.whole_sequence_shortfall("new", full, in_flight, 5) == pages * heads // ranks - free + 5
            if full <= 20:
                assert accounting.whole_sequence_shortfall("new", full, in_flight) == accounting.shortfall("new", full)
    # Part-way: a head already past its count keeps what it holds; the others grow to theirs.
    accounting.grow("part", 100)
    accounting.drop_behind_windows()
    held = accounting.pages_held("part") // ranks
    lens = accounting.head_lens_of("part")[:, 0]  # the windowed layers shortened from the front
    assert lens[0] < 100 and lens[1] == 100 and lens[2] < 100
    in_flight = 16
    target = [max(-(-lens[0] // BLOCK), window_pages(lens[0] + 200, 20, in_flight)), -(-300 // BLOCK),
              max(-(-lens[2] // BLOCK), window_pages(lens[2] + 200, 37, in_flight))]
    pages = sum(counted(int(t)) for t in target) * heads // ranks
    free = int(accounting.free_pages[0])
    assert accounting.whole_sequence_shortfall("part", 300, in_flight) == pages - held - free


@pytest.mark.parametrize("grant", [1, 2])
def test_a_chunked_prefill_never_holds_more_than_its_admission_counted(grant):
    """What the gate counts bounds what the request comes to hold: a prompt of F tokens in
    chunks of ``in_flight`` tokens, the heads behind their windows dropped as each step
    begins (the scheduler's order), holds at most the gate's count at every step; and the
    windows matter (the gate counts fewer pages than the whole sequence on every layer)."""
    windows = (20, None, 37)
    for full in (100, 257, 500):
        for in_flight in (7, 16, 40):
            accounting = PageAccounting(100_000, 3, NUM_KV_HEADS, BLOCK, max_requests=2,
                                        compressible_layers=(1,), layer_windows=windows, grant_pages=grant)
            gate = accounting.whole_sequence_shortfall("r", full, in_flight) + 100_000
            peak, done = 0, 0
            while done < full:
                accounting.drop_behind_windows()
                done = min(full, done + in_flight)
                accounting.grow("r", done)
                peak = max(peak, accounting.pages_held("r"))
            assert peak <= gate, (full, in_flight)
            whole_sequence = accounting.shortfall("x", full) + accounting.num_free_pages  # "x" holds nothing
            assert gate < whole_sequence
