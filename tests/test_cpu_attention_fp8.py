"""FP8 pages (``--kv-cache-dtype fp8*``) on vLLM's CPU attention kernel, where vLLM's own
CPU backend takes FP8 caches (AVX-512 or AMX hosts; elsewhere they run on the reference
and these tests, but the last, skip).

Oracles: the reference attention over the same FP8 bytes (it converts each value
exactly); for the writes, what vLLM's own writer stores for stock vLLM's cache layout
(one KV head-row per token, vLLM's slot mapping), and the rounding itself: every stored
value is the FP8 value next to the input toward zero (on normal-range inputs), which is
how vLLM's CPU kernel rounds, not as torch's cast (to nearest)."""

from __future__ import annotations

import pytest
import torch

from kvcompress.ops import KVPool, MetricSink, SlotBatch
from kvcompress.ops import cpu_attention
from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference
from kvcompress.ops.reference_attention import reference_paged_attention
from paged_cases import make_case

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TOLERANCE = 2e-5  # float32 queries: the kernel and the reference read the same FP8 values


@pytest.fixture()
def fp8_kernel():
    reason = cpu_attention.unavailable_reason() or cpu_attention.fp8_unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU kernel with FP8 caches: {reason}")


def fp8_pool(pool: KVPool, fp8: torch.dtype) -> KVPool:
    """``pool``'s values in a new kernel-layout buffer of ``fp8`` (torch's saturating cast)."""
    num_pages, block_size, head_dim = pool.key_cache.shape
    key, value = cpu_attention.pool_views(torch.empty((2, num_pages, block_size, head_dim), dtype=fp8))
    limit = torch.finfo(fp8).max
    key.copy_(pool.key_cache.clamp(-limit, limit).to(fp8))
    value.copy_(pool.value_cache.clamp(-limit, limit).to(fp8))
    return KVPool(key, value, pool.slot_positions, pool.slot_metrics.clone())


@pytest.mark.parametrize("cache_dtype", list(FP8))
@pytest.mark.parametrize("shape", [(2, 4, 64, 32), (8, 2, 128, 64), (1, 8, 64, 64)],
                         ids=lambda s: "hkv{}-g{}-d{}-b{}".format(*s))
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_fp8_pages_on_the_kernel_equal_the_reference(fp8_kernel, cache_dtype, shape, kind):
    num_kv_heads, group, head_dim, block_size = shape
    query_lens = {"decode": [1] * 7, "prefill": [37, 64, 5], "mixed": [1, 19, 1, 1, 40, 1]}[kind]
    plain, batch, query = make_case(query_lens, num_kv_heads, group, head_dim, block_size, torch.float32, seed=head_dim)
    pool = fp8_pool(plain, FP8[cache_dtype])
    assert cpu_attention.supports(query, pool) and cpu_attention.kernel_cache_dtype(pool) == cache_dtype
    scale = head_dim ** -0.5
    want = reference_paged_attention(query, pool, batch, scale)
    got = cpu_attention.paged_attention_cpu(query, pool, batch, scale)
    assert (got - want).abs().max().item() < TOLERANCE
    # Not the unquantized pool's attention: the FP8 values are really read.
    assert (got - reference_paged_attention(query, plain, batch, scale)).abs().max().item() > 100 * TOLERANCE


def test_fp8_pages_the_kernel_does_not_take_run_on_the_reference(fp8_kernel):
    """Pages of 16 tokens ask for the kernel's ``vec16`` path, which vLLM's CPU backend
    never uses for FP8 caches: the reference runs them."""
    plain, _, query = make_case([1, 3], 2, 2, 64, 16, torch.float32, seed=2)
    assert not cpu_attention.supports(query, fp8_pool(plain, torch.float8_e4m3fn))


def test_fp8_pages_are_not_taken_where_vllm_refuses_fp8_caches(monkeypatch):
    """vLLM's rule: FP8 caches need AVX-512 or AMX; on other hosts the reference runs
    FP8 pages (every host: the kernel's answer is asked of a fresh pool)."""
    plain, _, query = make_case([1, 3], 2, 2, 64, 32, torch.float32, seed=3)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_attention.fp8_unavailable_reason() is not None
    assert not cpu_attention.supports(query, fp8_pool(plain, torch.float8_e4m3fn))


def test_planned_fp8_decode_step_equals_the_reference_and_needs_the_query_dtype(fp8_kernel):
    num_kv_heads, group, head_dim, block_size = 2, 4, 64, 32
    num_slots, num_layers = 4, 2
    plain, batch, query = make_case([1] * (num_slots * num_layers), num_kv_heads, group, head_dim, block_size,
                                    torch.float32, seed=9)
    pool = fp8_pool(plain, torch.float8_e5m2)
    page_tables = batch.block_tables.view(num_slots, num_layers, num_kv_heads, -1)
    head_lens = batch.head_lens.view(num_slots, num_layers, num_kv_heads).clamp(min=1)
    seq_slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_dtype"):
        cpu_attention.plan_decode_step(pool, page_tables, head_lens, seq_slots, num_kv_heads * group)
    metric_rows = torch.tensor([1])
    plan = cpu_attention.plan_decode_step(pool, page_tables, head_lens, seq_slots, num_kv_heads * group,
                                          metric_rows, query_dtype=torch.float32)
    selected = torch.zeros(num_slots, dtype=torch.int8)
    selected[seq_slots[metric_rows].long()] = 1
    reference_pool = KVPool(pool.key_cache, pool.value_cache, pool.slot_positions, torch.zeros_like(pool.slot_metrics))
    rows_query = query.view(num_slots, num_layers, -1, head_dim)
    for layer in range(num_layers):
        layer_query = rows_query[seq_slots.long(), layer]
        slot_batch = SlotBatch(page_tables[:, layer], head_lens[:, layer], seq_slots, torch.full((3,), 10_000))
        want = paged_decode_by_slot_reference(layer_query, reference_pool, slot_batch, 0.1, metrics=MetricSink(selected))
        got = cpu_attention.decode_planned(layer_query, pool, plan[layer], 0.1, torch.empty_like(layer_query),
                                           metric_power=2)
        assert (got - want).abs().max().item() < TOLERANCE
    assert reference_pool.slot_metrics.abs().sum() > 0
    assert torch.allclose(pool.slot_metrics, reference_pool.slot_metrics, atol=1e-6)


def stock_layout_bytes(key: torch.Tensor, value: torch.Tensor, cache_dtype: str, block_size: int):
    """What vLLM's writer stores for ``key`` / ``value`` ``[T, H, D]`` in stock vLLM's own
    cache (``[N, H, b, D]`` K and V, token ``t`` at slot ``t``): ``[T, H, D]`` uint8 each
    (also the engine test's FP8 oracle, ``test_fp8_cache_engine.vllm_cpu_rounded``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    pages = -(-num_tokens // block_size)
    cache = torch.zeros((pages, num_kv_heads, 2 * block_size, head_dim), dtype=torch.uint8)
    key_cache, value_cache = cache.chunk(2, dim=2)
    torch.ops._C.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache,
                                            torch.arange(num_tokens), "vec", 1.0, 1.0, cache_dtype)

    def rows(part: torch.Tensor, transposed: bool) -> torch.Tensor:
        if transposed:  # K pages are [D, b] inside
            part = part.reshape(pages, num_kv_heads, head_dim, block_size).transpose(2, 3)
        return part.reshape(pages, num_kv_heads, block_size, head_dim).transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:num_tokens]

    return rows(key_cache, True), rows(value_cache, False)


def _toward_zero_neighbour(x: torch.Tensor, stored: torch.Tensor, fp8: torch.dtype) -> bool:
    """Whether ``stored`` (FP8) is the largest-magnitude FP8 value not above ``|x|``."""
    up = stored.view(torch.uint8).to(torch.int16)
    up = torch.where(x == 0, up, ((up & 0x7F) + 1) | (up & 0x80)).to(torch.uint8).view(fp8).float()
    value = stored.float()
    return bool(((value.abs() <= x.abs()) & ((up.abs() > x.abs()) | (x == 0))).all())


@pytest.mark.parametrize("cache_dtype", list(FP8))
@pytest.mark.parametrize("num_tokens", [3, 700])
def test_fp8_writes_store_stocks_bytes_rounded_toward_zero(fp8_kernel, cache_dtype, num_tokens):
    """The engine's writes into FP8 pages (a decode step's few rows as well as a prompt's:
    the indexed copy would round as torch does) store the bytes vLLM's writer stores for
    stock's cache, each the FP8 value next to the input toward zero; nothing else moves."""
    from kvcompress.ops.dispatch import resolve_ops

    ops = resolve_ops(torch.device("cpu"))
    if not ops.kernel_page_layout:
        pytest.skip("vLLM's CPU kernel is not this engine's attention here")
    fp8, block_size, num_kv_heads, head_dim, num_pages = FP8[cache_dtype], 32, 2, 64, 60
    gen = torch.Generator().manual_seed(num_tokens)
    plain = KVPool(*cpu_attention.pool_views(torch.zeros((2, num_pages, block_size, head_dim))),
                   torch.zeros((num_pages, block_size), dtype=torch.int32), torch.zeros((num_pages, block_size)))
    pool = fp8_pool(plain, fp8)
    before = [pool.key_cache.view(torch.uint8).clone(), pool.value_cache.view(torch.uint8).clone()]
    flat = torch.randperm(num_pages * block_size, generator=gen)[: num_tokens * num_kv_heads]
    pages, offsets = (flat // block_size).view(num_tokens, num_kv_heads), (flat % block_size).view(num_tokens, num_kv_heads)
    qkv = 3 * torch.randn((num_tokens, 4 * num_kv_heads * head_dim), generator=gen)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    ops.write_kv(pool, key, value, pages, offsets)
    stored_key, stored_value = pool.key_cache[pages, offsets], pool.value_cache[pages, offsets]
    want_key, want_value = stock_layout_bytes(key, value, cache_dtype, block_size)
    assert torch.equal(stored_key.view(torch.uint8), want_key)
    assert torch.equal(stored_value.view(torch.uint8), want_value)
    normal = key.abs() >= torch.finfo(fp8).smallest_normal
    assert _toward_zero_neighbour(key[normal], stored_key[normal], fp8)
    assert not torch.equal(stored_key, key.to(fp8))  # torch's cast rounds to nearest
    for cache, old in zip((pool.key_cache, pool.value_cache), before):
        untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
        untouched[pages, offsets] = False
        assert torch.equal(cache.view(torch.uint8)[untouched], old[untouched])
