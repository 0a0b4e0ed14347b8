"""vLLM's CPU attention kernel over the per-head pool (kvcompress.ops.cpu_attention)
against the PyTorch reference on the same pages: ragged per-head caches whose older
slots hold an increasing subset of the positions (as compression leaves them) and
whose last ``q_len`` slots hold the step's tokens; GQA 1..8, head sizes 64/80/96/128,
block sizes 16/32, decode, prefill and chunked-prefill batches, fp32 and bf16; and the
decode metric pass against the reference decode's metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcompress.ops import KVPool, MetricSink, PagedBatch, SlotBatch
from kvcompress.ops import cpu_attention
from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference
from kvcompress.ops.flattened import flat_query_starts
from kvcompress.ops.reference_attention import reference_paged_attention
from paged_cases import make_case



@pytest.fixture(autouse=True)
def _vllm_cpu_kernel():
    # Probed per test, never at collection: loading vLLM's kernels imports triton,
    # which must first be imported by tests/test_triton_kernels.py with its interpreter on.
    reason = cpu_attention.unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU kernel: {reason}")


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

SHAPES = [  # (num_kv_heads, group, head_dim, block_size)
    (2, 4, 64, 16),
    (3, 3, 64, 32),
    (1, 8, 128, 16),
    (4, 1, 80, 16),
    (2, 2, 96, 32),
    (8, 2, 128, 32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-g{}-d{}-b{}".format(*s))
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed", "long-chunks"])
def test_kernel_equals_reference(shape, kind):
    num_kv_heads, group, head_dim, block_size = shape
    query_lens = {
        "decode": [1] * 7,
        "prefill": [37, 64, 5],
        "mixed": [1, 19, 1, 1, 40, 1],
        # chunks of >= BY_HEAD_FROM_ROWS rows: one kernel call per KV head
        "long-chunks": [1, 150, 1, cpu_attention.BY_HEAD_FROM_ROWS, 1],
    }[kind]
    pool, batch, query = make_case(query_lens, num_kv_heads, group, head_dim, block_size, torch.float32, seed=sum(shape))
    scale = head_dim ** -0.5
    assert cpu_attention.supports(query, pool)
    want = reference_paged_attention(query, pool, batch, scale)
    got = cpu_attention.paged_attention_cpu(query, pool, batch, scale)
    assert (got - want).abs().max().item() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 64, 16), (3, 3, 80, 32), (8, 1, 128, 64)], ids=["hkv2-g4-d64-b16", "hkv3-g3-d80-b32", "hkv8-g1-d128-b64"])
def test_a_call_per_kv_head_equals_the_flattened_call_and_the_reference(shape, dtype):
    """flat_prompt_by_head (query column views, an output buffer per head) and the one
    flattened call give the reference attention on ragged heads, decode rows among
    prompt chunks."""
    from kvcompress.ops.flattened import paged_attention_flat

    num_kv_heads, group, head_dim, block_size = shape
    pool, batch, query = make_case([1, 70, 1, 1, 33, 1], num_kv_heads, group, head_dim, block_size, dtype, seed=head_dim)
    scale = head_dim ** -0.5
    want = reference_paged_attention(query, pool, batch, scale)
    flat = paged_attention_flat(cpu_attention._attend, query, pool, batch, scale)
    by_head = paged_attention_flat(cpu_attention._attend, query, pool, batch, scale, by_head_from=1)
    assert (flat.float() - want.float()).abs().max().item() < TOLERANCE[dtype]
    assert (by_head.float() - want.float()).abs().max().item() < TOLERANCE[dtype]
    assert (by_head.float() - flat.float()).abs().max().item() < TOLERANCE[dtype]


def test_flat_query_starts_number_the_head_major_rows():
    starts = [0, 3, 4, 10]
    got = flat_query_starts(starts, 2).tolist()
    # brute force: sequence h * S + s owns rows h * T + starts[s] .. of the [H * T] query
    rows_of = [[h * 10 + r for r in range(starts[s], starts[s + 1])] for h in range(2) for s in range(3)]
    assert got == [rows[0] for rows in rows_of] + [20]
    assert all(got[i + 1] - got[i] == len(rows_of[i]) for i in range(6))


@pytest.mark.parametrize("query_lens", [[37, 64, 5], [1, 19, 1, 1, 40, 1]], ids=["prefill", "mixed"])
def test_per_step_flat_starts_give_the_same_attention(query_lens):
    # the runner copies the flattened starts to the device once per step; every layer's
    # call then takes them from the PagedBatch instead of copying its own
    pool, batch, query = make_case(query_lens, 3, 3, 64, 32, torch.float32, seed=11)
    scale = 0.125
    flat = torch.from_numpy(flat_query_starts(batch.query_start_loc, 3))
    with_starts = dataclasses.replace(batch, flat_query_start_loc=flat)
    want = reference_paged_attention(query, pool, batch, scale)
    got = cpu_attention.paged_attention_cpu(query, pool, with_starts, scale)
    assert (got - want).abs().max().item() < TOLERANCE[torch.float32]
    # and they are what the kernel reads: starts of the first two sequences' lengths
    # swapped (still valid) give other rows to those sequences
    starts = batch.query_start_loc
    swapped = [0, starts[2] - starts[1]] + starts[2:]
    wrong = dataclasses.replace(batch, flat_query_start_loc=torch.from_numpy(flat_query_starts(swapped, 3)))
    bad = cpu_attention.paged_attention_cpu(query, pool, wrong, scale)
    assert (bad - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("query_lens", [[37, 64, 5], [1, 19, 1, 1, 40, 1]], ids=["prefill", "mixed"])
def test_a_strided_query_gives_the_reference_attention(query_lens):
    # vLLM's query is a column slice of the fused QKV projection: rows (Hq + 2H) * D apart.
    num_kv_heads, group, head_dim = 3, 3, 64
    pool, batch, query = make_case(query_lens, num_kv_heads, group, head_dim, 32, torch.float32, seed=21)
    num_rows, num_q_heads = query.shape[0], num_kv_heads * group
    fused = torch.randn(num_rows, (num_q_heads + 2 * num_kv_heads) * head_dim)
    fused[:, : num_q_heads * head_dim] = query.reshape(num_rows, -1)
    strided = fused[:, : num_q_heads * head_dim].view(num_rows, num_q_heads, head_dim)
    assert not strided.is_contiguous()
    scale = 0.125
    want = reference_paged_attention(query, pool, batch, scale)
    got = cpu_attention.paged_attention_cpu(strided, pool, batch, scale)
    assert (got - want).abs().max().item() < TOLERANCE[torch.float32]


def test_the_kernel_reads_a_strided_query_but_writes_rows_g_times_d_apart():
    # The contract _attend documents (a per-KV-head call over a view of the query would
    # save the regrouping copy, but its output must then go through a contiguous buffer).
    num_kv_heads, group, head_dim = 2, 4, 64
    pool, batch, query = make_case([300], num_kv_heads, group, head_dim, 64, torch.float32, seed=1)
    want = reference_paged_attention(query, pool, batch, 0.125)
    by_head = query.view(300, num_kv_heads, group, head_dim)
    starts = torch.tensor(batch.query_start_loc, dtype=torch.int32)
    max_len = int(batch.head_lens.max())
    tables = batch.block_tables[:, :, : -(-max_len // pool.block_size)].to(torch.int32)
    lens = batch.head_lens.to(torch.int32)
    into_buffer = torch.empty_like(by_head)
    into_view = torch.zeros_like(by_head)
    for head in range(num_kv_heads):
        buffer = torch.empty(300, group, head_dim)
        args = (starts, 300, lens[:, head].contiguous(), max_len, tables[:, head].contiguous(), 0.125)
        cpu_attention._attend(by_head[:, head], pool, buffer, *args)
        into_buffer[:, head] = buffer
        cpu_attention._attend(by_head[:, head], pool, into_view[:, head], *args)
    assert (into_buffer.view_as(want) - want).abs().max().item() < TOLERANCE[torch.float32]
    assert (into_view.view_as(want) - want).abs().max().item() > 1e-2


def test_bf16_decode_and_prefill():
    pool, batch, query = make_case([1, 30, 1, 12], 2, 4, 64, 16, torch.bfloat16, seed=5)
    scale = 0.125
    want = reference_paged_attention(query, pool, batch, scale).float()
    got = cpu_attention.paged_attention_cpu(query, pool, batch, scale).float()
    assert (got - want).abs().max().item() < TOLERANCE[torch.bfloat16]


def test_uncompressed_heads_equal_dense_causal_attention():
    """Without eviction the pages hold a plain causal prefix: the kernel equals a float64
    dense causal attention of the same KVs (an oracle independent of the reference)."""
    from kvcompress.ops.reference_attention import dense_causal_attention

    pool, batch, query = make_case([48], 2, 4, 64, 16, torch.float32, seed=11, ragged=False, max_context=1)
    # A prefill from position 0 of one sequence: rebuild K/V in token order.
    length = int(batch.head_lens[0, 0])
    assert length == 48 and int(batch.query_positions[0]) == 0
    keys = torch.stack([pool.key_cache[batch.block_tables[0, h]].reshape(-1, 64)[:length] for h in range(2)], 1)
    values = torch.stack([pool.value_cache[batch.block_tables[0, h]].reshape(-1, 64)[:length] for h in range(2)], 1)
    want = dense_causal_attention(query, keys, values, 0.125)
    got = cpu_attention.paged_attention_cpu(query, pool, batch, 0.125)
    assert (got.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("power", [1, 2])
def test_decode_metrics_equal_the_reference_decode(power):
    pool, batch, query = make_case([1] * 6, 3, 3, 64, 16, torch.float32, seed=power)
    selected = torch.tensor([True, False, True, True, False, True])
    reference_pool = KVPool(pool.key_cache, pool.value_cache, pool.slot_positions, torch.zeros_like(pool.slot_metrics))
    reference_paged_attention(query, reference_pool, batch, 0.125, metrics=MetricSink(selected, power))
    cpu_attention.paged_attention_cpu(query, pool, batch, 0.125, metrics=MetricSink(selected, power))
    assert reference_pool.slot_metrics.abs().sum() > 0
    assert torch.allclose(pool.slot_metrics, reference_pool.slot_metrics, atol=1e-6)


def test_decode_by_slot_with_padding_rows():
    pool, batch, query = make_case([1] * 5, 2, 4, 64, 16, torch.float32, seed=3)
    # Slot 5 is an empty padding slot; rows 5 and 6 point at it.
    tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:1])])
    lens = torch.cat([batch.head_lens, torch.zeros_like(batch.head_lens[:1])])
    seq_slots = torch.tensor([3, 0, 4, 1, 2, 5, 5], dtype=torch.int32)
    order = seq_slots[:5].long()
    rows_query = torch.cat([query[order], torch.randn(2, 8, 64)])
    positions = torch.cat([batch.query_positions[order], torch.zeros(2, dtype=torch.int64)])
    slot_batch = SlotBatch(tables, lens, seq_slots, positions)
    selected = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.int8)
    reference_pool = KVPool(pool.key_cache, pool.value_cache, pool.slot_positions, torch.zeros_like(pool.slot_metrics))
    want = paged_decode_by_slot_reference(rows_query, reference_pool, slot_batch, 0.125, metrics=MetricSink(selected))
    got = cpu_attention.paged_decode_by_slot_cpu(rows_query, pool, slot_batch, 0.125, metrics=MetricSink(selected))
    assert (got - want).abs().max().item() < 2e-5
    assert torch.equal(got[5:], torch.zeros_like(got[5:]))
    assert torch.allclose(pool.slot_metrics, reference_pool.slot_metrics, atol=1e-6)


@pytest.mark.parametrize("layers_alike", [False, True], ids=["ragged-layers", "equal-layers"])
@pytest.mark.parametrize("shape", [(2, 4, 64, 16), (3, 3, 80, 32)], ids=["hkv2-g4-d64-b16", "hkv3-g3-d80-b32"])
def test_planned_decode_step_equals_the_reference_per_layer(shape, layers_alike):
    """``plan_decode_step`` (every layer's kernel tables, once per step) + ``decode_planned``
    against the reference slot-indexed decode of each layer: outputs and the metrics of
    the selected rows (added once, after the last layer, for all layers). Equal layers
    share one work split (as at rate 1)."""
    num_kv_heads, group, head_dim, block_size = shape
    num_slots, num_layers = 5, 3
    pool, batch, query = make_case([1] * (num_slots * num_layers), num_kv_heads, group, head_dim, block_size, torch.float32, seed=head_dim + layers_alike)
    page_tables = batch.block_tables.view(num_slots, num_layers, num_kv_heads, -1)
    head_lens = batch.head_lens.view(num_slots, num_layers, num_kv_heads)
    if layers_alike:
        page_tables = page_tables[:, :1].expand_as(page_tables).contiguous()
        head_lens = head_lens[:, :1].expand_as(head_lens).contiguous()
    head_lens = head_lens.clamp(min=1)  # a decode row always holds its own new KV
    seq_slots = torch.tensor([3, 0, 4, 1], dtype=torch.int32)
    metric_rows = torch.tensor([0, 2])
    selected = torch.zeros(num_slots, dtype=torch.int8)
    selected[seq_slots[metric_rows].long()] = 1
    plan = cpu_attention.plan_decode_step(pool, page_tables, head_lens, seq_slots, num_kv_heads * group, metric_rows)
    assert len(plan) == num_layers
    assert (plan[0].scheduler_metadata is plan[1].scheduler_metadata) == layers_alike
    # The runner's hint for never-compressed rows (each head equal in every layer).
    hinted = cpu_attention.plan_decode_step(
        pool, page_tables, head_lens, seq_slots, num_kv_heads * group, None, uniform=True,
    ) if layers_alike else None
    reference_pool = KVPool(pool.key_cache, pool.value_cache, pool.slot_positions, torch.zeros_like(pool.slot_metrics))
    rows_query = query.view(num_slots, num_layers, -1, head_dim)
    metrics_before = pool.slot_metrics.clone()
    for layer in range(num_layers):
        layer_query = rows_query[seq_slots.long(), layer]
        positions = torch.full((4,), 10_000, dtype=torch.int64)  # a decode query sees every held KV
        slot_batch = SlotBatch(page_tables[:, layer], head_lens[:, layer], seq_slots, positions)
        want = paged_decode_by_slot_reference(layer_query, reference_pool, slot_batch, 0.1, metrics=MetricSink(selected))
        got = cpu_attention.decode_planned(layer_query, pool, plan[layer], 0.1, torch.empty_like(layer_query), metric_power=2)
        assert (got - want).abs().max().item() < TOLERANCE[torch.float32]
        if hinted is not None:
            assert hinted[layer].scheduler_metadata is hinted[0].scheduler_metadata
            got = cpu_attention.decode_planned(layer_query, pool, hinted[layer], 0.1, torch.empty_like(layer_query))
            assert (got - want).abs().max().item() < TOLERANCE[torch.float32]
        if layer < num_layers - 1:  # the metric pass waits for the step's last layer
            assert torch.equal(pool.slot_metrics, metrics_before)
    assert reference_pool.slot_metrics.abs().sum() > 0
    assert torch.allclose(pool.slot_metrics, reference_pool.slot_metrics, atol=1e-6)


def test_planned_decode_refuses_an_empty_head():
    pool, batch, _ = make_case([1, 1], 2, 2, 64, 16, torch.float32, seed=1)
    lens = batch.head_lens.clone().unsqueeze(1)
    lens[1, 0, 1] = 0
    with pytest.raises(RuntimeError, match="no KV"):
        cpu_attention.plan_decode_step(pool, batch.block_tables.unsqueeze(1), lens, torch.tensor([0, 1]), 4)


def test_row_major_pool_is_not_taken():
    pool, batch, query = make_case([1, 1], 2, 2, 64, 16, torch.float32, seed=0)
    buffer = torch.zeros((pool.key_cache.shape[0], 2, 16, 64))
    row_major = KVPool(buffer[:, 0], buffer[:, 1], pool.slot_positions, pool.slot_metrics)
    assert not cpu_attention.supports(query, row_major)
    assert cpu_attention.supports(query, pool)


def test_slot_order_invariant_and_kernel_on_a_compressed_cache():
    """The invariant the kernel's causal mask relies on, on a cache grown by
    ``PerHeadPagedCache.append`` and compacted by ``compress_sequences`` (MoveCache):
    after every append the step's tokens are the last slots of every head, in position
    order, and every older slot holds an earlier position; the kernel then equals the
    reference (which masks by stored position) on prefill, chunked-prefill and decode
    steps of that cache."""
    from kvcompress.ops import PerHeadPagedCache, compress_sequences, reference_write_kv

    gen = torch.Generator().manual_seed(7)
    num_layers, num_kv_heads, group, head_dim, block_size = 2, 2, 3, 64, 16
    cache = PerHeadPagedCache(600, num_layers, num_kv_heads, block_size, max_seqs=3, max_pages_per_head=40)
    buffer = torch.zeros(2, 600, block_size, head_dim)
    pool = cache.kv_pool(*cpu_attention.pool_views(buffer))
    assert cpu_attention.in_kernel_layout(pool)
    slots = torch.tensor([cache.new_sequence() for _ in range(3)])
    context = [0, 0, 0]
    steps = [[120, 75, 200], "compress", [40, 1, 1], [1, 1, 1], "compress", [1, 33, 1], [1, 1, 1]]
    for step in steps:
        if step == "compress":
            cache.slot_metrics.copy_(torch.rand(cache.slot_metrics.shape, generator=gen))
            result = compress_sequences(
                cache, pool, slots, torch.tensor([3, 2, 4]), torch.tensor(context),
                torch.tensor([8, 8, 8]), torch.tensor([0, 0, 0]),
            )
            assert result.pages_freed > 0
            continue
        positions = torch.cat([torch.arange(context[s], context[s] + n) for s, n in enumerate(step)])
        plan = cache.append(slots, torch.tensor(step), positions)
        for layer in range(num_layers):
            new = torch.randn(2, len(positions), num_kv_heads, head_dim, generator=gen)
            reference_write_kv(pool.key_cache, pool.value_cache, new[0], new[1],
                     plan.write_pages[layer], plan.write_offsets[layer])
        starts = [0]
        for s, n in enumerate(step):
            starts.append(starts[-1] + n)
            for layer in range(num_layers):
                for head in range(num_kv_heads):
                    length = int(cache.head_lens[slots[s], layer, head])
                    index = torch.arange(length)
                    pages = cache.flat_page_tables()[slots[s], layer, head, index // block_size]
                    held = cache.slot_positions[pages, index % block_size].long()
                    assert torch.equal(held[length - n:], torch.arange(context[s], context[s] + n))
                    assert bool((held[: length - n] < context[s]).all())
        for layer in range(num_layers):
            batch = PagedBatch(
                cache.flat_page_tables()[slots, layer], cache.head_lens[slots, layer], starts, positions
            )
            query = torch.randn(len(positions), num_kv_heads * group, head_dim, generator=gen)
            want = reference_paged_attention(query, pool, batch, 0.125)
            got = cpu_attention.paged_attention_cpu(query, pool, batch, 0.125)
            assert (got - want).abs().max().item() < 2e-5
        context = [c + n for c, n in zip(context, step)]


def _kv_write_case(num_tokens, num_kv_heads, head_dim, block_size, dtype, seed, pool_seed):
    """Two equal kernel-layout pools of 40 random pages, distinct targets (every (token,
    head) its own (page, offset)), and K / V as strided ``[T, H, D]`` slices of a fused QKV
    row as the model gives them: ``(pools, key, value, write_pages, write_offsets)``."""
    num_pages = 40
    gen = torch.Generator().manual_seed(seed)
    pools = []
    for _ in range(2):
        buffer = torch.randn((2, num_pages, block_size, head_dim), generator=torch.Generator().manual_seed(pool_seed)).to(dtype)
        pools.append(KVPool(*cpu_attention.pool_views(buffer), torch.zeros((num_pages, block_size), dtype=torch.int32),
                            torch.zeros((num_pages, block_size))))
    flat = torch.randperm(num_pages * block_size, generator=gen)[: num_tokens * num_kv_heads]
    write_pages, write_offsets = (flat // block_size).view(num_tokens, num_kv_heads), (flat % block_size).view(num_tokens, num_kv_heads)
    qkv = torch.randn((num_tokens, (num_kv_heads * 4) * head_dim), generator=gen).to(dtype)
    key = qkv[:, num_kv_heads * 2 * head_dim : num_kv_heads * 3 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, num_kv_heads * 3 * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    return pools, key, value, write_pages, write_offsets


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (3, 80, 32), (1, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_writes_by_vllms_op_equal_the_indexed_copy(num_kv_heads, head_dim, block_size, dtype):
    """``write_kv_cpu`` (vLLM's ``cpu_attn_reshape_and_cache`` over (token, head) rows)
    stores every new K and V where ``reference_attention.reference_write_kv`` does, from strided
    ``[T, H, D]`` slices of a fused QKV row as the model gives them; nothing else moves."""
    from kvcompress.ops.reference_attention import reference_write_kv

    pools, key, value, write_pages, write_offsets = _kv_write_case(
        37, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + block_size, pool_seed=3,
    )
    assert not key.is_contiguous()
    reference_write_kv(pools[0].key_cache, pools[0].value_cache, key, value, write_pages, write_offsets)
    cpu_attention.write_kv_cpu(pools[1], key, value, write_pages, write_offsets.to(torch.int32))
    assert torch.equal(pools[0].key_cache, pools[1].key_cache)
    assert torch.equal(pools[0].value_cache, pools[1].value_cache)
    assert torch.equal(pools[1].key_cache[write_pages, write_offsets], key)


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_at_flat_slots_equal_the_indexed_copy(planned, dtype):
    """``write_kv_at_slots`` and a decode step's ``write_kv_planned`` (one copy and one
    op call at ``page * b + offset`` slots, into the layer's kernel caches) store what
    ``reference_write_kv`` stores at the pages and offsets; nothing else moves."""
    from kvcompress.ops.reference_attention import reference_write_kv

    block_size = 64
    pools, key, value, write_pages, write_offsets = _kv_write_case(
        13, 2, 64, block_size, dtype, seed=11, pool_seed=7,
    )
    flat_slots = (write_pages * block_size + write_offsets).reshape(-1)
    if planned:
        tables = torch.zeros((1, 26, 1), dtype=torch.int32)
        layer, = cpu_attention.unplanned_decode_layers(
            pools[0], tables, torch.ones((1, 26), dtype=torch.int32), write_slots=flat_slots.view(1, 26),
        )
        cpu_attention.write_kv_planned(layer, key, value)
    else:
        cpu_attention.write_kv_at_slots(pools[0], key, value, flat_slots)
    reference_write_kv(pools[1].key_cache, pools[1].value_cache, key, value, write_pages, write_offsets)
    assert torch.equal(pools[0].key_cache, pools[1].key_cache)
    assert torch.equal(pools[0].value_cache, pools[1].value_cache)
    assert torch.equal(pools[0].value_cache[write_pages, write_offsets], value)


@pytest.mark.parametrize("num_tokens", [3, 700])
def test_engine_ops_write_prompt_batches_by_vllms_op_and_decode_rows_by_indexed_copy(num_tokens, monkeypatch):
    """The engine's ``reference_write_kv`` on the kernel layout: batches of at least
    ``KERNEL_WRITE_MIN_ROWS`` (token, head) rows go to vLLM's op, a decode step's few rows
    to the indexed copy; either way every K / V lands where the indexed copy puts it."""
    from kvcompress.ops.dispatch import resolve_ops
    from kvcompress.ops.reference_attention import reference_write_kv

    ops = resolve_ops(torch.device("cpu"))
    if not ops.kernel_page_layout:
        pytest.skip("vLLM's CPU kernel is not this engine's attention here")
    pools, key, value, write_pages, write_offsets = _kv_write_case(
        num_tokens, 2, 64, 64, torch.float32, seed=num_tokens, pool_seed=5,
    )
    calls = []
    original = cpu_attention.write_kv_cpu
    monkeypatch.setattr(cpu_attention, "write_kv_cpu", lambda *args: calls.append(1) or original(*args))
    ops.write_kv(pools[0], key, value, write_pages, write_offsets)
    reference_write_kv(pools[1].key_cache, pools[1].value_cache, key, value, write_pages, write_offsets)
    assert (num_tokens == 700) == bool(calls)
    assert torch.equal(pools[0].key_cache, pools[1].key_cache)
    assert torch.equal(pools[0].value_cache, pools[1].value_cache)
