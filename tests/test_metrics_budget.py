"""Eviction metrics against a float64 dense oracle, budget formulas, per-request fields
(no vLLM needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcompress.budget import (
    RequestFieldError,
    blocks_to_evict,
    evictable_blocks,
    kept_per_head,
    protected_tokens,
    request_budget,
    target_pages,
)
from kvcompress.config import KVCompressConfig
from kvcompress.ops import MetricSink, PagedBatch, PerHeadPagedCache, reference_paged_attention, reference_write_kv
from kvcompress.ops.kv_pool import KVPool
from kvcompress.ops.metrics import (
    accumulate_metrics,
    attention_metrics,
    max_pool_metrics,
)
from kvcompress.ops.decode_metrics import decode_metrics_by_head

LAYERS, KV_HEADS, GROUP, DIM, BLOCK = 1, 2, 3, 8, 4


def _filled_cache(length: int, seed: int = 0):
    """One sequence of ``length`` tokens in a per-head cache; returns cache, K, V, slot."""
    torch.manual_seed(seed)
    cache = PerHeadPagedCache(256, LAYERS, KV_HEADS, BLOCK, max_seqs=2, max_pages_per_head=32)
    key_cache = torch.zeros(256, BLOCK, DIM)
    value_cache = torch.zeros(256, BLOCK, DIM)
    slot = torch.tensor([cache.new_sequence()])
    keys = torch.randn(length, KV_HEADS, DIM)
    values = torch.randn(length, KV_HEADS, DIM)
    plan = cache.append(slot, torch.tensor([length]), torch.arange(length))
    reference_write_kv(key_cache, value_cache, keys, values, plan.write_pages[0], plan.write_offsets[0])
    return cache, key_cache, value_cache, slot, keys, values


def _oracle_metric(query, q_pos, keys, scale, power, skip_nearest=0):
    """float64: probs of each query over keys at positions <= its own, ** power, masked
    to keys >= skip_nearest before the query, summed over queries and the query group."""
    num_keys = keys.shape[0]
    out = torch.zeros(KV_HEADS, num_keys, dtype=torch.float64)
    for t in range(query.shape[0]):
        p = int(q_pos[t])
        for qh in range(query.shape[1]):
            h = qh // GROUP
            scores = (keys[: p + 1, h].double() @ query[t, qh].double()) * scale
            probs = torch.softmax(scores, 0)
            for k in range(p + 1):
                if p - k >= skip_nearest:
                    out[h, k] += probs[k] ** power
    return out


@pytest.mark.parametrize("power,skip,chunk", [(2, 0, 1024), (1, 0, 1024), (2, 3, 2)])
def test_attention_metrics_match_float64_oracle(power, skip, chunk):
    length = 23
    cache, key_cache, _, slot, keys, _ = _filled_cache(length)
    query = torch.randn(length, KV_HEADS * GROUP, DIM)
    rows = slice(length - 8, length) if skip == 0 else slice(0, length)
    q_pos = torch.arange(length)[rows]
    metric = attention_metrics(
        query[rows], q_pos, key_cache, cache.slot_positions,
        cache.flat_page_tables()[slot[0], 0], cache.head_lens[slot[0], 0], 0.3,
        power=power, skip_nearest=skip, query_chunk=chunk,
    )
    expected = _oracle_metric(query[rows], q_pos, keys, 0.3, power, skip)
    assert torch.allclose(metric[:, :length].double(), expected, atol=1e-5)
    assert torch.all(metric[:, length:] == 0)


def test_accumulate_and_max_pool_follow_logical_slots():
    length = 13
    cache, *_ , slot, _, _ = _filled_cache(length)
    tables, lens = cache.flat_page_tables()[slot[0], 0], cache.head_lens[slot[0], 0]
    metric = torch.rand(KV_HEADS, tables.shape[1] * BLOCK)
    accumulate_metrics(cache.slot_metrics, tables, lens, metric)
    accumulate_metrics(cache.slot_metrics, tables, lens, metric)
    slots = (tables.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).reshape(KV_HEADS, -1)
    stored = cache.slot_metrics.view(-1)[slots]
    assert torch.allclose(stored[:, :length], 2 * metric[:, :length])
    max_pool_metrics(cache.slot_metrics, tables, lens, 5)
    pooled = cache.slot_metrics.view(-1)[slots]
    for head in range(KV_HEADS):
        for k in range(length):
            window = stored[head, max(0, k - 2) : min(length, k + 3)]
            assert pooled[head, k] == window.max()


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("page_ids", [
    [[3, 5, 0, 9], [7, 2, 3, 3]],  # padding at page 0 (free) and at head 0's page 3
    [[0, 5, 3, 9], [7, 2, 0, 0]],  # page 0 held (its slot 0 too) and head 1's padding
])
def test_prompt_metric_passes_read_nothing_on_the_host_and_touch_only_held_slots(mode, words, page_ids):
    """The prompt-metric chain of a layer (attention_metrics, accumulate_metrics,
    pool_metrics in max mode, or avg as xkv's, as the attention backend runs it at a
    prompt's end) makes no
    torch call that reads a device value on the host (on CUDA each waits for the stream,
    at every layer), and equals a per-slot loop over the held slots: table columns past
    a head's length, here pointing at page 0 and at another head's pages, stay as they
    were bit for bit."""
    from host_reads import HostReadWatch

    torch.manual_seed(3)
    num_pages, heads, group, dim, block = 16, 2, 3, 8, 4
    key_cache = torch.randn(num_pages, block, dim)
    slot_positions = torch.arange(block, dtype=torch.int32).repeat(num_pages, 1)
    slot_positions += torch.arange(num_pages, dtype=torch.int32)[:, None] * block
    tables = torch.tensor(page_ids)
    lens = torch.tensor([7, 6])
    for head in range(heads):  # slot i of a head at position i (an uncompressed prompt)
        pages = tables[head, : -(-int(lens[head]) // block)]
        slot_positions[pages] = (torch.arange(len(pages) * block, dtype=torch.int32)).view(-1, block)
    slot_metrics = torch.rand(num_pages, block)
    before = slot_metrics.clone()
    query = torch.randn(3, heads * group, dim)
    query_positions = torch.tensor([4, 5, 6])
    word_starts = torch.tensor([0, 0, 2, 3, 3, 3, 6]) if words else None

    with HostReadWatch() as watch:
        scored = attention_metrics(query, query_positions, key_cache, slot_positions, tables, lens, 0.3)
        accumulate_metrics(slot_metrics, tables, lens, scored)
        from kvcompress.ops.metrics import pool_metrics

        pool_metrics(slot_metrics, tables, lens, 3, mode, word_starts)
    assert watch.reads == []

    want = before.clone()
    for head in range(heads):
        held = [(int(tables[head, i // block]), i % block) for i in range(int(lens[head]))]
        added = [float(want[p, o]) + float(scored[head, i]) for i, (p, o) in enumerate(held)]
        windows = [added[max(0, i - 1) : i + 2] for i in range(len(held))]
        pooled = [max(w) if mode == "max" else sum(w) / len(w) for w in windows]
        if words:
            spans = word_starts[: len(held)].tolist()
            pooled = [max(v for j, v in enumerate(pooled) if spans[j] == spans[i]) for i in range(len(held))]
        for (page, offset), value in zip(held, pooled):
            want[page, offset] = value
    assert torch.allclose(slot_metrics, want, rtol=0, atol=1e-6)
    untouched = torch.ones(num_pages, block, dtype=torch.bool)
    for head in range(heads):
        for i in range(int(lens[head])):
            untouched[tables[head, i // block], i % block] = False
    assert torch.equal(slot_metrics[untouched], before[untouched])


def test_decode_attention_adds_squared_probabilities_to_slot_metrics():
    length = 30
    cache, key_cache, value_cache, slot, keys, _ = _filled_cache(length)
    query = torch.randn(1, KV_HEADS * GROUP, DIM)
    before = cache.slot_metrics.clone()
    batch = PagedBatch(cache.flat_page_tables()[slot, 0], cache.head_lens[slot, 0], [0, 1], torch.tensor([length - 1]))
    reference_paged_attention(
        query, cache.kv_pool(key_cache, value_cache), batch, 0.25,
        metrics=MetricSink(torch.tensor([True]), power=2),
    )
    expected = _oracle_metric(query, torch.tensor([length - 1]), keys, 0.25, 2)
    tables = cache.flat_page_tables()[slot[0], 0]
    slots = (tables.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).reshape(KV_HEADS, -1)
    gained = (cache.slot_metrics - before).view(-1)[slots][:, :length]
    assert torch.allclose(gained.double(), expected, atol=1e-5)
    # Only held slots change (no zeroing or writing of the rest of the pool).
    touched = (cache.slot_metrics != before).sum().item()
    assert touched <= KV_HEADS * length


@pytest.mark.parametrize("power", [2, 1])
@pytest.mark.parametrize("max_pages_per_pass", [4096, 3], ids=["one-pass", "passes-of-3-pages"])
@pytest.mark.parametrize("kernel_layout", [True, False], ids=["k-as-d-by-b", "k-row-major"])
def test_decode_metrics_by_head_match_float64_oracle(power, max_pages_per_pass, kernel_layout):
    """Ragged head-sequences (1 KV, exact page multiples, partial last pages, pages in
    any pool order) scored in one pass or many: each head's query group adds
    ``softmax(q . K) ** power`` to exactly its held slots."""
    torch.manual_seed(power + max_pages_per_pass)
    num_pages, block, dim, group = 40, 4, 8, 3
    stored = torch.randn(num_pages, dim, block) if kernel_layout else torch.randn(num_pages, block, dim)
    key_cache = stored.transpose(1, 2) if kernel_layout else stored
    pool = KVPool(key_cache, torch.zeros_like(key_cache), torch.zeros(num_pages, block, dtype=torch.int64),
                  torch.rand(num_pages, block))
    before = pool.slot_metrics.clone()
    head_lens = torch.tensor([1, 8, 5, 13, 4, 2])
    width = 4
    page_ids = torch.randperm(num_pages)[: len(head_lens) * width].view(len(head_lens), width)
    query = torch.randn(len(head_lens), group, dim)
    decode_metrics_by_head(query, pool, page_ids.to(torch.int32), head_lens, 0.4, power,
                           max_pages_per_pass=max_pages_per_pass)
    expected = before.double().clone()
    for head, length in enumerate(head_lens.tolist()):
        slots = [(int(page_ids[head, k // block]), k % block) for k in range(length)]
        keys = torch.stack([key_cache[page, offset] for page, offset in slots]).double()
        probs = torch.softmax(query[head].double() @ keys.T * 0.4, dim=-1)  # [G, len]
        for k, (page, offset) in enumerate(slots):
            expected[page, offset] += (probs[:, k] ** power).sum()
    assert torch.allclose(pool.slot_metrics.double(), expected, atol=1e-6)


def test_decode_metrics_by_head_refuses_a_head_past_its_table():
    pool = KVPool(torch.zeros(4, 4, 8), torch.zeros(4, 4, 8), torch.zeros(4, 4, dtype=torch.int64), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="more KVs than its page table"):
        decode_metrics_by_head(torch.zeros(1, 2, 8), pool, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([9]), 1.0)


# ----------------------------------------------------------------------------- budgets


def _budget(**overrides):
    return request_budget(KVCompressConfig(enabled=True, **overrides), None)


def test_rate_budget_is_max_of_min_cache_and_share_plus_protected():
    budget = _budget(rate=8, protected_window=64, min_cache_tokens=128)
    assert kept_per_head(4096, budget) == 4096 // 8 + 64
    assert kept_per_head(1024, budget) == 128 + 64  # 1024 / 8 = 128
    assert kept_per_head(512, budget) == 128 + 64  # the floor wins
    assert kept_per_head(100, budget) == 100  # never more than the context
    # pages: ceil(keep * layers * heads / b)
    assert target_pages(4096, budget, 30 * 3, 16) == math.ceil((512 + 64) * 90 / 16)


def test_max_cache_tokens_budget_counts_protected_tokens():
    budget = _budget(max_cache_tokens=300, protected_window=32, sink_tokens=4)
    assert protected_tokens(5000, 32, 4) == 36
    assert kept_per_head(5000, budget) == 300
    assert kept_per_head(5000, _budget(max_cache_tokens=10, protected_window=32)) == 32
    both = _budget(rate=2, max_cache_tokens=300, protected_window=0, min_cache_tokens=0)
    assert kept_per_head(5000, both) == 300 and kept_per_head(400, both) == 200
    assert kept_per_head(5000, _budget(rate=1)) == 5000  # rate 1 keeps everything


def test_blocks_to_evict_is_capped_by_what_the_schedule_may_evict():
    lens = np.array([[40, 33], [17, 40]])  # held pages at b=16: 3+3+2+3 = 11
    budget = _budget(rate=4, protected_window=8, min_cache_tokens=0)
    # keep ceil(40/4) + 8 = 18 tokens per head -> ceil(18*4/16) = 5 pages -> evict 6,
    # but each head may lose floor((empty + len - 8) / 16): 2 + 2 + 1 + 2 = 7 blocks.
    assert evictable_blocks(lens, 8, 16) == 7
    assert blocks_to_evict(lens, 40, budget, 16) == 6
    assert blocks_to_evict(lens, 40, _budget(rate=64, protected_window=8, min_cache_tokens=0), 16) == 7
    assert blocks_to_evict(lens, 40, _budget(rate=1), 16) == 0


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"kv_compress_rate": 0.5}, "kv_compress_rate"),
        ({"kv_compress_rate": "fast"}, "kv_compress_rate"),
        ({"kv_compress_max_cache_tokens": 0}, "kv_compress_max_cache_tokens"),
        ({"kv_compress_max_cache_tokens": 2.5}, "kv_compress_max_cache_tokens"),
        ({"kv_compress_protected_window": -1}, "kv_compress_protected_window"),
        ({"kv_compress": "maybe"}, "kv_compress"),
        ({"kv_compress_ratio": 4}, "kv_compress_ratio"),
    ],
)
def test_invalid_request_fields_name_the_field(extra, field):
    with pytest.raises(RequestFieldError, match=field) as error:
        request_budget(KVCompressConfig(enabled=True, rate=4), extra)
    assert error.value.field == field


def test_request_fields_override_server_settings():
    server = KVCompressConfig(enabled=True, rate=4, protected_window=64)
    budget = request_budget(server, {"kv_compress_rate": 16, "kv_compress_protected_window": 8, "other": 1})
    assert budget.rate == 16 and budget.protected_window == 8 and budget.compresses
    assert not request_budget(server, {"kv_compress": False}).compresses
    assert not request_budget(server, {"kv_compress_rate": 1}).compresses
    assert request_budget(KVCompressConfig(enabled=True), {"kv_compress_rate": 8}).compresses
    with pytest.raises(RequestFieldError, match="without --kv-compress"):
        request_budget(KVCompressConfig(), {"kv_compress_rate": 8})


def test_request_fields_keep_their_parsing_and_name_the_first_bad_key():
    from kvcompress.budget import REQUEST_FIELDS

    assert list(REQUEST_FIELDS) == [
        "kv_compress", "kv_compress_rate", "kv_compress_max_cache_tokens",
        "kv_compress_protected_window", "kv_compress_policy", "kv_compress_observation_window",
        "kv_compress_shared_prefix_tokens",
    ]
    server = KVCompressConfig(enabled=True, rate=4)
    budget = request_budget(
        server,
        {"kv_compress": " TRUE ", "kv_compress_rate": "8", "kv_compress_max_cache_tokens": "300",
         "kv_compress_policy": " H2O", "kv_compress_observation_window": 16.0, "other": "x"},
    )
    assert (budget.enabled, budget.rate, budget.max_cache_tokens, budget.policy, budget.observation_window) == (
        True, 8.0, 300, "h2o", 16
    )
    assert not request_budget(server, {"kv_compress": "0"}).enabled
    for extra, field in (
        ({"kv_compress_rate": True}, "kv_compress_rate"),  # a JSON boolean is not a number
        ({"kv_compress_rate": None}, "kv_compress_rate"),
        ({"kv_compress_rate": float("nan")}, "kv_compress_rate"),
        ({"kv_compress": "yes"}, "kv_compress"),
        ({"kv_compress": None}, "kv_compress"),
        ({"kv_compress_ratio": 1, "kv_compress_rate": 0.5}, "kv_compress_ratio"),
        ({"kv_compress_rate": 0.5, "kv_compress_ratio": 1}, "kv_compress_rate"),
    ):
        with pytest.raises(RequestFieldError, match=field) as error:
            request_budget(server, extra)
        assert error.value.field == field


def test_a_shared_prefix_is_kept_whole_and_the_rate_applies_to_the_rest():
    """Brute force over small cases: with a shared prefix S the protected tokens are
    max(sinks, S) + window, and the rate budget counts only the L - S private tokens;
    a prefix covering most of the context leaves nothing to evict."""
    import dataclasses
    import math

    from kvcompress.budget import blocks_to_evict, kept_per_head, protected_tokens

    base = request_budget(KVCompressConfig(enabled=True, rate=4, min_cache_tokens=16,
                                           protected_window=8), None)
    for context in (64, 100, 300):
        for shared in (0, 32, 64, 96):
            if shared > context:
                continue
            budget = dataclasses.replace(base, shared_prefix_tokens=shared)
            protected = min(context, max(base.sink_tokens, shared) + 8)
            expected = min(context, max(16, math.ceil((context - shared) / 4)) + protected)
            assert kept_per_head(context, budget) == expected
            assert protected_tokens(context, 8, budget.protected_prefix) == protected
            lens = np.full((2, 2), context)
            evict = blocks_to_evict(lens, context, budget, 16)
            # Never past the shared prefix: what stays per head covers it.
            assert context - evict * 16 // 4 >= min(context, shared)
    nearly_all_shared = dataclasses.replace(base, shared_prefix_tokens=288)
    assert blocks_to_evict(np.full((2, 2), 300), 300, nearly_all_shared, 16) == 0
