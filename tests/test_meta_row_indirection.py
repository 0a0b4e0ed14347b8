"""Every op reads slot positions and metrics through ``KVPool.page_meta_row`` (issue 61,
docs/design-61-metadata-rows.md): each op on a pool whose metadata was moved to random
rows of larger tensors, among garbage rows, gives what it gives on the plain pool. An op
that read row = page id would read garbage (no page keeps its own row), so each of these
fails on a bypass."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvcompress.ops import MetricSink, PagedBatch, dispatch
from kvcompress.ops.compress import compress_sequences, gather_logical
from kvcompress.ops.decode_metrics import DeferredDecodeQueries
from kvcompress.ops.expected_attention import RopeFrequencies, rank_prompt_metrics
from kvcompress.ops.metrics import accumulate_metrics, attention_metrics, pool_metrics
from kvcompress.ops.move_cache import move_cache
from kvcompress.ops.paged_cache import PerHeadPagedCache
from kvcompress.ops.reference_attention import reference_paged_attention, reference_write_kv
from paged_cases import by_page, make_case, scrambled_rows

SCALE = 0.3


def _case(seed, query_lens=(1, 6, 1, 3), kernel_layout=False):
    pool, batch, query = make_case(list(query_lens), 2, 2, 16, 8, torch.float32, seed, kernel_layout=kernel_layout)
    metrics = torch.rand(pool.slot_metrics.shape, generator=torch.Generator().manual_seed(seed))
    return dataclasses.replace(pool, slot_metrics=metrics), batch, query


def _own_kv(pool):
    """``pool`` with K / V of its own (same values and layout): for the ops that write them."""
    return dataclasses.replace(pool, key_cache=pool.key_cache.clone(), value_cache=pool.value_cache.clone())


def _same_metadata(rows_pool, plain_pool):
    positions, metrics = by_page(rows_pool)
    assert torch.equal(positions, plain_pool.slot_positions)
    # (NaN where a deferred query saw no KV, in both)
    torch.testing.assert_close(metrics, plain_pool.slot_metrics, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_attention_reads_positions_and_adds_metrics_through_the_rows(seed, window):
    pool, batch, query = _case(seed)
    batch = dataclasses.replace(batch, sliding_window=window)
    rows = scrambled_rows(pool, seed)
    sink = None if window else MetricSink(torch.ones(batch.block_tables.shape[0], dtype=torch.bool), 2)
    expected = reference_paged_attention(query, pool, batch, SCALE, metrics=sink)
    got = reference_paged_attention(query, rows, batch, SCALE, metrics=sink)
    assert torch.equal(got, expected)
    _same_metadata(rows, pool)


@pytest.mark.parametrize("seed", [3, 4])
def test_the_engines_attention_backend_takes_a_pool_with_rows(seed):
    """The CPU default (vLLM's kernel where it runs, its flattened metric pass) and the
    dispatch's choice for a pool with rows, decode rows adding metrics."""
    pool, batch, query = _case(seed, query_lens=(1, 1, 4, 1), kernel_layout=True)
    rows = scrambled_rows(pool, seed)
    sink = MetricSink(torch.tensor([True, False, True, True]), 1)
    expected = dispatch.paged_attention(query, pool, batch, SCALE, metrics=sink)
    got = dispatch.paged_attention(query, rows, batch, SCALE, metrics=sink)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    _same_metadata(rows, pool)


@pytest.mark.parametrize("seed", [5, 6])
def test_deferred_decode_metrics_mask_by_the_rows_positions(seed):
    pool, batch, query = _case(seed, query_lens=(1, 1, 1))
    rows = scrambled_rows(pool, seed)
    slots = np.arange(3)
    # Queries at earlier positions than the heads' newest KVs: the mask reads positions.
    positions = batch.query_positions.numpy() - 2
    tables, lens = batch.block_tables.unsqueeze(0), batch.head_lens.unsqueeze(0)
    for target in (pool, rows):
        queue = DeferredDecodeQueries(batch=4)  # 3 of 4: the padded pass
        for step in range(3):
            queries = query.unsqueeze(0) * (1.0 + step)  # [L=1, M, Hq, D]
            queue.add(slots, positions + step, queries, SCALE, 2)
        queue.flush(target, slots.tolist(), tables, lens)
    _same_metadata(rows, pool)


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("mode", ["max", "avg"])
def test_prompt_metrics_accumulate_and_pool_through_row_tables(seed, mode):
    pool, batch, query = _case(seed, query_lens=(9, 1))
    rows = scrambled_rows(pool, seed)
    tables, lens = batch.block_tables[0], batch.head_lens[0]
    q, q_pos = query[:9], batch.query_positions[:9]
    word_starts = torch.tensor([0, 0, 2, 2, 2, 5, 6, 6])
    for target in (pool, rows):
        meta = target.meta_tables(tables)
        scored = attention_metrics(q, q_pos, target.key_cache, target.slot_positions, tables, lens, SCALE,
                                   skip_nearest=2, position_tables=meta)
        accumulate_metrics(target.slot_metrics, meta, lens, scored)
        pool_metrics(target.slot_metrics, meta, lens, 3, mode, word_starts)
    _same_metadata(rows, pool)


def test_expected_attention_ranks_the_rows_metrics():
    pool, batch, query = _case(9, query_lens=(12,), kernel_layout=False)
    rows = scrambled_rows(pool, 9)
    tables, lens = batch.block_tables[0], batch.head_lens[0]
    rope = RopeFrequencies(1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16), True)
    for target in (pool, rows):
        rank_prompt_metrics(target.slot_metrics, target.key_cache, query[-4:], batch.query_positions[-4:],
                            tables, lens, SCALE, rope, sinks=1, protected=2,
                            meta_tables=target.meta_tables(tables))
    _same_metadata(rows, pool)


@pytest.mark.parametrize("seed", [10, 11])
@pytest.mark.parametrize("through", ["reference", "dispatch"])
def test_move_cache_moves_metadata_between_the_pages_rows(seed, through):
    pool, _, _ = _case(seed)
    rows = _own_kv(scrambled_rows(pool, seed))
    num_pages, block_size = pool.slot_positions.shape
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_pages * block_size, generator=gen)[:40]
    src, dst = slots[:20], slots[20:]
    moves = (src // block_size, src % block_size, dst // block_size, dst % block_size)
    run = move_cache if through == "reference" else dispatch.move_cache
    for target in (pool, rows):
        run(target, *moves)
    assert torch.equal(rows.key_cache, pool.key_cache) and torch.equal(rows.value_cache, pool.value_cache)
    _same_metadata(rows, pool)


def _filled_cache(seed, num_seqs=2, num_layers=2, num_heads=2, block_size=4, head_dim=4):
    """A cache filled by appends and writes, random metrics: the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    cache = PerHeadPagedCache(96, num_layers, num_heads, block_size, max_seqs=num_seqs, max_pages_per_head=12)
    buffer = torch.zeros(96, 2, block_size, head_dim)
    key_cache, value_cache = buffer[:, 0], buffer[:, 1]
    slots = torch.tensor([cache.new_sequence() for _ in range(num_seqs)])
    lengths = [int(n) for n in torch.randint(9, 30, (num_seqs,), generator=gen)]
    positions = torch.cat([torch.arange(n) for n in lengths])
    plan = cache.append(slots, torch.tensor(lengths), positions)
    for layer in range(num_layers):
        reference_write_kv(key_cache, value_cache, torch.randn(len(positions), num_heads, head_dim, generator=gen),
                           torch.randn(len(positions), num_heads, head_dim, generator=gen),
                           plan.write_pages[layer], plan.write_offsets[layer])
    cache.slot_metrics.copy_(torch.rand(cache.slot_metrics.shape, generator=gen))
    return cache, key_cache, value_cache, slots, torch.tensor(lengths)


@pytest.mark.parametrize("seed", [12, 13, 14])
def test_compress_sequences_ranks_and_moves_through_the_rows(seed):
    plain, k0, v0, slots, lengths = _filled_cache(seed)
    mapped, k1, v1, _, _ = _filled_cache(seed)
    rows = scrambled_rows(mapped.kv_pool(k1, v1), seed)
    mapped.slot_positions, mapped.slot_metrics = rows.slot_positions, rows.slot_metrics
    mapped.page_meta_row = rows.page_meta_row
    evict = torch.tensor([3, 5])
    expected = compress_sequences(plain, plain.kv_pool(k0, v0), slots, evict, lengths, 2, 1)
    got = compress_sequences(mapped, rows, slots, evict, lengths, 2, 1)
    assert expected.pages_freed > 0
    assert torch.equal(got.new_head_lens, expected.new_head_lens)
    assert torch.equal(got.evict_blocks, expected.evict_blocks)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)
    want_metrics, want_positions, want_tables = gather_logical(plain, slots)
    got_metrics, got_positions, got_tables = gather_logical(mapped, slots, pool=rows)
    assert torch.equal(got_tables, want_tables)
    held = torch.arange(want_metrics.shape[-1]) < expected.new_head_lens.unsqueeze(-1)
    assert torch.equal(got_positions[held], want_positions[held])
    assert torch.equal(got_metrics[held], want_metrics[held])


def test_backends_that_index_metadata_by_page_are_not_chosen_for_a_pool_with_rows():
    """CUDA and Triton kernels read slot metadata by page id: a pool with rows goes to a
    fallback that reads rows, and the CUDA ops' flat tensors refuse it."""
    from kvcompress.ops import backend_cuda, backend_triton, backend_vllm_triton
    from kvcompress.ops.backend_reference import BACKEND as reference

    assert not backend_cuda.BACKEND.meta_rows and not backend_triton.BACKEND.meta_rows
    assert not backend_vllm_triton.BACKEND.meta_rows and reference.meta_rows
    pool, batch, query = _case(15)
    rows = scrambled_rows(pool, 15)
    ops = dispatch.KernelOps(torch.device("cpu"), {"paged_attention": "triton"})
    assert ops._backend_for_call("paged_attention", query, rows, batch, None).meta_rows
    with pytest.raises(ValueError, match="page_meta_row"):
        rows.tensors()


# -- the cache's identity rows (sequences that never compress; row pages of those that do:
# tests/test_metadata_row_pages.py) -------------------------------------------------------


@pytest.mark.parametrize("path", ["host", "device", "chunk"])
def test_identity_rows_past_a_window_drop_hold_the_pages_token_blocks(path):
    """A sliding-window head of a never-compressing sequence gives back its leading pages;
    the pages it takes afterwards sit at table columns below their token blocks, and must
    read the identity rows of their token blocks (positions past the dropped ones), as the
    same cache without identity rows records them. Each append path: a decode step on the
    host's numpy views, the device path of one-token appends, a multi-token chunk."""
    block_size = 4
    caches = [PerHeadPagedCache(64, 2, 2, block_size, max_seqs=2, max_pages_per_head=12, identity_rows=rows)
              for rows in (False, True)]
    for cache in caches:
        if path == "device":
            cache.host = None
        slot = torch.tensor([cache.new_sequence(compresses=False)])
        cache.append(slot, torch.tensor([13]), torch.arange(13))
        cache.drop_leading_pages(slot, torch.tensor([[2, 0]]))  # layer 0 is windowed
        if path == "chunk":
            cache.append(slot, torch.tensor([9]), torch.arange(13, 22))
        else:
            for position in range(13, 22):
                cache.append(slot, torch.tensor([1]), torch.tensor([position]))
    lens = caches[0].head_lens[0]
    assert torch.equal(caches[1].head_lens[0], lens) and int(lens[0, 0]) == 22 - 8
    for cache in caches:
        positions, _ = cache.metadata_by_page()
        tables = cache.flat_page_tables()[0]
        for layer in range(2):
            for head in range(2):
                held = int(lens[layer, head])
                got = positions[tables[layer, head, : -(-held // block_size)].long()].reshape(-1)[:held]
                first = 22 - held
                assert torch.equal(got, torch.arange(first, 22, dtype=torch.int32)), (layer, head)
