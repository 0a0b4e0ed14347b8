"""Sliding-window attention in the kernel layer (issue 60, first part; no vLLM needed).

A sliding-window layer's query at position ``p`` sees the KVs at positions ``p - W < k <= p``
(vLLM's convention: itself and the ``W - 1`` tokens before it). Checked against two
oracles: a per-row brute force over the stored positions (compacted heads, as a compressed
head would be) and the float64 dense attention with a banded mask; and that a backend
without window support never takes a windowed call (the dispatch hands it to the reference).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.ops import PagedBatch, PerHeadPagedCache, reference_paged_attention, reference_write_kv
from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference
from kvcompress.ops.dispatch import resolve_ops, use_backend
from kvcompress.ops.kv_pool import MetricSink, SlotBatch
from kvcompress.ops.reference_attention import dense_causal_attention
from paged_cases import scrambled_cache

NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 64


def _brute_force(query, query_positions, query_start, dense, scale, window):
    """Per query row and head: softmax over the KVs whose stored position is inside the
    window, in float64."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s in range(len(query_start) - 1):
        for t in range(query_start[s], query_start[s + 1]):
            p = int(query_positions[t])
            for qh in range(query.shape[1]):
                k, v, positions = dense[(s, qh // GROUP)]
                visible = (positions <= p) & (positions > p - window)
                if visible.any():
                    scores = (k[visible] @ query[t, qh].double()) * scale
                    out[t, qh] = torch.softmax(scores, 0) @ v[visible]
    return out


def _mixed_batch(dense, lengths, query_lens, seed):
    """Queries at the top positions of each sequence (a prompt chunk, a decode row, ...)."""
    generator = torch.Generator().manual_seed(seed)
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    positions = []
    for s, count in enumerate(query_lens):
        top = max(int(dense[(s, h)][2].max()) if lengths[s, h] else 0 for h in range(NUM_KV_HEADS))
        positions += list(range(top - count + 1, top + 1))
    query = torch.randn(query_start[-1], NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    return query, torch.tensor(positions), query_start


@pytest.mark.parametrize("window", [1, 5, 16, 40, 10_000])
@pytest.mark.parametrize("block_size", [16, 32])
def test_windowed_reference_equals_a_brute_force_over_stored_positions(window, block_size):
    lengths = torch.tensor([[37, 5], [1, 70], [33, 33], [60, 61]])
    pool, tables, dense = scrambled_cache(3, lengths, block_size, HEAD_DIM)
    query, positions, query_start = _mixed_batch(dense, lengths, [3, 1, 7, 1], seed=4)
    scale = HEAD_DIM**-0.5
    batch = PagedBatch(tables, lengths, query_start, positions, sliding_window=window)
    out = reference_paged_attention(query, pool, batch, scale, max_query_chunk=4)
    expected = _brute_force(query, positions, query_start, dense, scale, window)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)
    if window < 40:  # the window cuts something off: the full causal result differs
        full = reference_paged_attention(query, pool, PagedBatch(tables, lengths, query_start, positions), scale)
        assert not torch.allclose(out, full, atol=1e-3)


@pytest.mark.parametrize("window", [None, 1, 7, 16, 30])
def test_chunked_prefill_then_decode_through_the_cache_equals_the_banded_dense_oracle(window):
    """End to end through the cache: a prompt appended in two chunks, then a decode
    (None: plain causal attention)."""
    torch.manual_seed(5)
    block_size, total = 16, 45
    cache = PerHeadPagedCache(64, 1, NUM_KV_HEADS, block_size, max_seqs=1, max_pages_per_head=16)
    buffer = torch.zeros(64, 2, block_size, HEAD_DIM)
    key_cache, value_cache = buffer[:, 0], buffer[:, 1]
    pool = cache.kv_pool(key_cache, value_cache)
    seq = torch.tensor([cache.new_sequence()])
    queries = torch.randn(total, NUM_KV_HEADS * GROUP, HEAD_DIM)
    keys = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
    values = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
    outputs = torch.empty_like(queries)
    for start, end in [(0, 20), (20, 44), (44, 45)]:
        plan = cache.append(seq, torch.tensor([end - start]), torch.arange(start, end))
        reference_write_kv(key_cache, value_cache, keys[start:end], values[start:end],
                           plan.write_pages[0], plan.write_offsets[0])
        batch = PagedBatch(cache.flat_page_tables()[seq, 0], cache.head_lens[seq, 0], [0, end - start],
                           torch.arange(start, end), sliding_window=window)
        reference_paged_attention(queries[start:end], pool, batch, HEAD_DIM**-0.5, out=outputs[start:end])
    expected = dense_causal_attention(queries, keys, values, HEAD_DIM**-0.5, sliding_window=window)
    assert torch.allclose(outputs.double(), expected, atol=1e-5)
    if window is not None:  # the band cuts something off for the last query
        unbanded = dense_causal_attention(queries, keys, values, HEAD_DIM**-0.5)
        assert not torch.allclose(expected[-1], unbanded[-1], atol=1e-3)


def test_slot_indexed_decode_keeps_the_window():
    lengths = torch.tensor([[37, 5], [20, 70], [33, 33]])
    pool, tables, dense = scrambled_cache(6, lengths, 16, HEAD_DIM)
    query, positions, _ = _mixed_batch(dense, lengths, [1, 1, 1], seed=7)
    scale, window = HEAD_DIM**-0.5, 9
    # Rows 0 and 1 decode slots 2 and 0 of the slot tables.
    slots = torch.tensor([2, 0], dtype=torch.int32)
    batch = SlotBatch(tables, lengths, slots, positions[[2, 0]], sliding_window=window)
    out = paged_decode_by_slot_reference(query[[2, 0]], pool, batch, scale)
    expected = _brute_force(query, positions, [0, 1, 2, 3], dense, scale, window)
    assert torch.allclose(out.double(), expected[[2, 0]], atol=1e-5)


def _contiguous_cpu_cache(total: int, block_size: int = 16, seed: int = 12):
    """A never-compressed head layout in vLLM's CPU kernel page layout: one sequence,
    positions ``0 .. total - 1`` in slot order; its pool, tables and the dense Q / K / V."""
    from kvcompress.ops import cpu_attention

    if cpu_attention.unavailable_reason() is not None:
        pytest.skip(cpu_attention.unavailable_reason())
    torch.manual_seed(seed)
    cache = PerHeadPagedCache(64, 1, NUM_KV_HEADS, block_size, max_seqs=1, max_pages_per_head=32)
    buffer = torch.zeros(2, 64, block_size, HEAD_DIM)
    pool = cache.kv_pool(*cpu_attention.pool_views(buffer))
    seq = torch.tensor([cache.new_sequence()])
    queries = torch.randn(total, NUM_KV_HEADS * GROUP, HEAD_DIM)
    keys, values = torch.randn(2, total, NUM_KV_HEADS, HEAD_DIM)
    return cache, pool, seq, queries, keys, values


@pytest.mark.parametrize("window", [1, 7, 16, 30, 1000])
def test_vllm_cpu_kernel_window_equals_the_banded_oracle_on_a_never_compressed_head(window):
    """vLLM's CPU kernel counts its window in slots back from the query: on consecutive
    positions (a sliding-window layer is never compressed) that is the window by position,
    through prompt chunks longer and shorter than the window, and decode rows."""
    from kvcompress.ops.cpu_attention import paged_attention_cpu

    total = 90
    cache, pool, seq, queries, keys, values = _contiguous_cpu_cache(total)
    outputs = torch.empty_like(queries)
    scale = HEAD_DIM**-0.5
    for start, end in [(0, 40), (40, 45), (45, 88), (88, 89), (89, 90)]:
        plan = cache.append(seq, torch.tensor([end - start]), torch.arange(start, end))
        reference_write_kv(pool.key_cache, pool.value_cache, keys[start:end], values[start:end],
                           plan.write_pages[0], plan.write_offsets[0])
        batch = PagedBatch(cache.flat_page_tables()[seq, 0], cache.head_lens[seq, 0], [0, end - start],
                           torch.arange(start, end), sliding_window=window)
        paged_attention_cpu(queries[start:end], pool, batch, scale, out=outputs[start:end])
    expected = dense_causal_attention(queries, keys, values, scale, sliding_window=window)
    assert torch.allclose(outputs.double(), expected, atol=1e-4)


def test_a_backend_without_windows_hands_windowed_calls_to_the_reference(monkeypatch):
    """A backend that takes this pool and call but applies no window (here vLLM's CPU
    backend with its window support switched off) must never run a windowed call."""
    from kvcompress.ops import cpu_attention, dispatch

    total, window = 40, 6
    cache, pool, seq, queries, keys, values = _contiguous_cpu_cache(total)
    plan = cache.append(seq, torch.tensor([total]), torch.arange(total))
    reference_write_kv(pool.key_cache, pool.value_cache, keys, values, plan.write_pages[0], plan.write_offsets[0])

    class WindowlessCpu(cpu_attention.VllmCpuBackend):
        sliding_window = False

    windowless = WindowlessCpu()
    real = dispatch.backend_named
    monkeypatch.setattr(dispatch, "backend_named", lambda name: windowless if name == "vllm_cpu" else real(name))
    with use_backend("vllm_cpu"):
        ops = resolve_ops("cpu", ["paged_attention"])
    assert ops.backend("paged_attention") is windowless
    scale = HEAD_DIM**-0.5
    calls = []
    monkeypatch.setattr(windowless, "paged_attention", lambda *a, **k: calls.append(1) or real("vllm_cpu").paged_attention(*a, **k))

    def attend(sliding_window):
        batch = PagedBatch(cache.flat_page_tables()[seq, 0], cache.head_lens[seq, 0], [0, total],
                           torch.arange(total), sliding_window=sliding_window)
        assert windowless.supports(queries, pool, batch)  # the kernel would take it
        return ops.paged_attention(queries, pool, batch, scale)

    assert torch.allclose(attend(None).double(), dense_causal_attention(queries, keys, values, scale), atol=1e-4)
    assert calls == [1]  # the unwindowed call ran on the backend
    banded = dense_causal_attention(queries, keys, values, scale, sliding_window=window)
    assert torch.allclose(attend(window).double(), banded, atol=1e-5)
    assert calls == [1]  # the windowed one did not


def test_a_windowed_layer_takes_no_metrics():
    lengths = torch.tensor([[20, 20]])
    pool, tables, dense = scrambled_cache(10, lengths, 16, HEAD_DIM)
    query, positions, query_start = _mixed_batch(dense, lengths, [1], seed=11)
    batch = PagedBatch(tables, lengths, query_start, positions, sliding_window=4)
    sink = MetricSink(torch.ones(1, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="sliding-window layer takes no decode metrics"):
        reference_paged_attention(query, pool, batch, HEAD_DIM**-0.5, metrics=sink)
