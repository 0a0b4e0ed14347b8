"""Decode-only steps through the fixed-address DecodeBuffers (the CUDA-graph path)
against the per-step eager path, on the reference ops (CPU).

The same cache state is attended twice: once with tables gathered for the batch and
``query_start_loc`` (the eager path every mixed step takes) and once through
``DecodeBuffers`` padded to more rows than the batch, as vLLM pads a graph's batch.
Real rows must agree, padding rows must read nothing and write only the scratch
page, and the eviction metrics must move exactly as in the eager path.

vLLM (which imports triton.language) is imported inside the tests, not at collection:
the Triton interpreter tests must import triton first, under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from kvcompress.ops import KVPool, MetricSink, PagedBatch, PerHeadPagedCache, SlotBatch, reference_write_kv
from kvcompress.ops.dispatch import paged_attention, paged_decode_by_slot

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 2, 2, 64, 16


def _state(seed: int):
    generator = torch.Generator().manual_seed(seed)
    num_pages = 200
    cache = PerHeadPagedCache(num_pages, LAYERS, KV_HEADS, BLOCK, max_seqs=6, max_pages_per_head=32)
    pad_slot = cache.new_sequence()
    # The pool has one more page than the allocator: the scratch page.
    pool = torch.randn(num_pages + 1, 2, BLOCK, HEAD_DIM, generator=generator)
    slots = [cache.new_sequence() for _ in range(4)]
    prompt = [37, 5, 70, 16]
    positions = torch.cat([torch.arange(n) for n in prompt])
    cache.append(torch.tensor(slots), torch.tensor(prompt), positions)
    # Ragged heads, as after eviction: shorten some heads of some sequences.
    cache.head_lens[slots[0], 0, 1] = 20
    cache.head_lens[slots[2], 1, 0] = 33
    cache.slot_metrics.uniform_(generator=generator)
    return cache, pool, pad_slot, slots, prompt, generator


@pytest.mark.parametrize("power", [1, 2])
def test_decode_buffers_match_the_eager_step(power):
    from kvcompress.vllm_glue.step import DecodeBuffers

    cache, pool, pad_slot, slots, prompt, generator = _state(power)
    key_cache, value_cache = pool[:, 0], pool[:, 1]
    num_rows, padded = 3, 7  # batch of 3 (slots in another order), padded to 7 rows
    batch = torch.tensor([slots[2], slots[0], slots[3]])
    positions = torch.tensor([prompt[2], prompt[0], prompt[3]])
    plan = cache.append(batch, torch.ones(3, dtype=torch.int64), positions)
    buffers = DecodeBuffers.allocate(
        num_layers=LAYERS, num_kv_heads=KV_HEADS, max_rows=8, num_slots=cache.max_seqs,
        pad_slot=pad_slot, scratch_page=cache.num_pages, max_head_len=32 * BLOCK,
        block_size=BLOCK, metric_power=power, device=torch.device("cpu"),
    )
    compressing = torch.tensor([slots[2], slots[3]])  # slot 0's request does not compress
    buffers.fill(num_rows, batch, positions, plan.write_pages, plan.write_offsets, compressing)
    assert buffers.seq_slots[num_rows:].eq(pad_slot).all()
    assert buffers.write_pages[:, num_rows:].eq(cache.num_pages).all()

    scale = HEAD_DIM ** -0.5
    query = torch.randn(padded, KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    key = torch.randn(padded, KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(padded, KV_HEADS, HEAD_DIM, generator=generator)
    for layer in range(LAYERS):
        # Eager path (what mixed steps do): gathered tables, host query_start_loc.
        eager_pool, eager_metrics = pool.clone(), cache.slot_metrics.clone()
        reference_write_kv(eager_pool[:, 0], eager_pool[:, 1], key[:num_rows], value[:num_rows],
                           plan.write_pages[layer], plan.write_offsets[layer])
        tables = cache.flat_page_tables()[batch, layer]
        lens = cache.head_lens[batch, layer]
        expected = paged_attention(
            query[:num_rows], KVPool(eager_pool[:, 0], eager_pool[:, 1], cache.slot_positions, eager_metrics),
            PagedBatch(tables, lens, list(range(num_rows + 1)), positions), scale,
            metrics=MetricSink(torch.tensor([True, False, True]), power),
        )
        # Buffer path, padded rows included.
        buffer_pool, buffer_metrics = pool.clone(), cache.slot_metrics.clone()
        reference_write_kv(buffer_pool[:, 0], buffer_pool[:, 1], key, value,
                 buffers.write_pages[layer, :padded], buffers.write_offsets[layer, :padded])
        out = torch.full_like(query, float("nan"))
        # The engine's two-level tables, as the attention backend passes them.
        slot_batch = SlotBatch(
            cache.tables.chunk_tables[:, layer], cache.head_lens[:, layer], buffers.seq_slots[:padded],
            buffers.query_positions[:padded], max_head_len=buffers.max_head_len,
            row_index=buffers.row_index[:padded], chunks=cache.tables.chunks,
        )
        paged_decode_by_slot(
            query, KVPool(buffer_pool[:, 0], buffer_pool[:, 1], cache.slot_positions, buffer_metrics),
            slot_batch, scale, out=out, metrics=MetricSink(buffers.metric_slots, buffers.metric_power),
        )
        torch.testing.assert_close(out[:num_rows], expected, atol=1e-6, rtol=1e-5)
        assert torch.equal(out[num_rows:], torch.zeros_like(out[num_rows:]))
        assert torch.equal(buffer_metrics, eager_metrics)
        assert (eager_metrics != cache.slot_metrics).sum() > 20  # metrics did move
        # Padding rows wrote the scratch page and nothing else.
        assert torch.equal(buffer_pool[: cache.num_pages], eager_pool[: cache.num_pages])
        assert not torch.equal(buffer_pool[cache.num_pages], pool[cache.num_pages])


def test_decode_buffers_refuse_more_rows_than_allocated():
    from kvcompress.vllm_glue.step import DecodeBuffers

    buffers = DecodeBuffers.allocate(
        num_layers=1, num_kv_heads=1, max_rows=2, num_slots=3, pad_slot=0, scratch_page=9,
        max_head_len=64, block_size=16, metric_power=2, device=torch.device("cpu"),
    )
    with pytest.raises(RuntimeError, match="3 rows exceeds the 2 rows"):
        buffers.fill(3, torch.zeros(3, dtype=torch.int64), torch.zeros(3), torch.zeros(1, 3, 1),
                     torch.zeros(1, 3, 1))
    # Partitions stay few whatever max_model_len is (the graph's grid).
    long = DecodeBuffers.allocate(
        num_layers=1, num_kv_heads=1, max_rows=2, num_slots=3, pad_slot=0, scratch_page=9,
        max_head_len=131072, block_size=16, metric_power=2, device=torch.device("cpu"),
    )
    narrow = long.partition_size_for(2, 1)
    assert narrow % 16 == 0 and 131072 / narrow <= 64
    # Wide batches (enough (row, KV head) pairs to fill the GPU) take 2048-key partitions.
    short = DecodeBuffers.allocate(
        num_layers=1, num_kv_heads=8, max_rows=256, num_slots=3, pad_slot=0, scratch_page=9,
        max_head_len=8192, block_size=16, metric_power=2, device=torch.device("cpu"),
    )
    assert short.partition_size_for(1, 8) == 512 and short.partition_size_for(63, 8) == 512
    assert short.partition_size_for(64, 8) == 2048 and short.partition_size_for(256, 8) == 2048
    wide = long.partition_size_for(512, 1)
    assert 131072 / wide <= 64 and wide % 16 == 0
