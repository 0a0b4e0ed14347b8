"""``KVCompressKVCacheManager`` over vLLM's real ``KVCacheManager`` and ``Request``s, driven
with vLLM 0.32's two call shapes of ``allocate_slots`` (the waiting-request call with
every keyword, and the running-request call ``(request, n, num_lookahead_tokens=k)``
that takes the dict-only fast path when the heads have room): every answer and every
page count against a brute-force recount, ``L * H * ceil(tokens / b)`` per request
(nothing is compressed here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvcompress.page_accounting import PageAccounting  # noqa: E402

# vLLM's core modules import triton: imported at collection, they would come before
# test_triton_kernels sets TRITON_INTERPRET, and its interpreter tests would then fail.
# So vLLM is imported when the tests run (``_vllm``), and this module sorts after
# test_triton_kernels and test_unified_attention (their interpreter runs come first).


def _vllm():
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from kvcompress.vllm_glue import kv_manager

    return SamplingParams, KVCacheManager, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request, kv_manager


def Request(*args):  # noqa: N802  (vLLM's Request, imported late)
    return _vllm()[5](*args)


def SamplingParams(**kwargs):  # noqa: N802
    return _vllm()[0](**kwargs)


def logical_block_count(*args, **kwargs):
    return _vllm()[6].logical_block_count(*args, **kwargs)

LAYERS, HEADS, BLOCK, MAX_LEN, PAGES, SEQS = 2, 3, 16, 200, 300, 8


def _manager(num_blocks: int | None = None):
    _, KVCacheManager, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, _, kv_manager = _vllm()
    num_blocks = num_blocks or logical_block_count(PAGES, SEQS, MAX_LEN, BLOCK)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=64, dtype=torch.float32))],
    )
    inner = KVCacheManager(config, max_model_len=MAX_LEN, scheduler_block_size=BLOCK,
                           hash_block_size=BLOCK, enable_caching=False)
    accounting = PageAccounting(PAGES, LAYERS, HEADS, BLOCK, max_requests=4)
    return kv_manager.KVCompressKVCacheManager(inner, accounting, max_model_len=MAX_LEN, watermark=0.0)


def _pages(tokens: int) -> int:
    return LAYERS * HEADS * -(-tokens // BLOCK)


def test_allocate_slots_answers_and_counts_match_a_brute_force_recount():
    rng = np.random.default_rng(3)
    manager = _manager()
    counted_calls = []
    counted = manager._allocate_counted
    manager._allocate_counted = lambda *a, **k: counted_calls.append(1) or counted(*a, **k)
    requests: dict = {}
    slots: dict[str, int] = {}  # request id -> tokens it has slots for (brute force)
    fast_calls = 0
    for step in range(600):
        free = PAGES - sum(_pages(t) for t in slots.values())
        op = rng.random()
        if op < 0.15 or not requests:  # a waiting request: vLLM's admission call
            request_id = f"r{step}"
            prompt = int(rng.integers(1, 120))
            request = Request(request_id, list(range(prompt)), SamplingParams(max_tokens=400), None)
            chunk = int(rng.integers(1, prompt + 1))
            blocks = manager.allocate_slots(
                request, chunk, num_new_computed_tokens=0,
                new_computed_blocks=manager.empty_kv_cache_blocks, num_lookahead_tokens=0,
                num_external_computed_tokens=0, delay_cache_blocks=False, skip_zeroing_group_ids=(),
                num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                has_scheduled_reqs=bool(requests),
            )
            assert (blocks is not None) == (_pages(chunk) <= free), step
            if blocks is not None:
                request.num_computed_tokens = chunk
                requests[request_id] = request
                slots[request_id] = chunk
        elif op < 0.25:  # finished
            request_id = str(rng.choice(sorted(requests)))
            manager.free(requests.pop(request_id))
            slots.pop(request_id)
        else:  # a running request: decode (1 token, sometimes lookahead) or a prefill chunk
            request_id = str(rng.choice(sorted(requests)))
            request = requests[request_id]
            new = 1 if rng.random() < 0.8 else int(rng.integers(2, 20))
            lookahead = int(rng.choice([0, 0, 0, 2]))
            target = min(request.num_computed_tokens + new + lookahead, MAX_LEN)
            need = _pages(max(target, slots[request_id])) - _pages(slots[request_id])
            fast = manager.accounting.fits_in_room(request_id, target)
            before = len(counted_calls)
            blocks = manager.allocate_slots(request, new, num_lookahead_tokens=lookahead)
            assert (blocks is not None) == (need <= free), step
            # The fast path is taken exactly when no page is needed, never counted.
            assert (len(counted_calls) == before) == fast, step
            assert not fast or need == 0, step
            fast_calls += fast
            if blocks is not None:
                slots[request_id] = max(slots[request_id], target)
                request.num_computed_tokens = min(request.num_computed_tokens + new, MAX_LEN - 1)
        accounting = manager.accounting
        assert accounting.num_free_pages == PAGES - sum(_pages(t) for t in slots.values()), step
        if step % 7 == 0:
            accounting.check_consistent()
            assert accounting.pages_held_by_request() == {r: _pages(t) for r, t in slots.items()}, step
    assert fast_calls > 100 and len(counted_calls) > 100  # both routes were exercised


def test_decode_growth_is_clamped_at_max_model_len():
    manager = _manager()
    prompt = MAX_LEN - 7  # its last page has room past max_model_len: the fast path
    request = Request("a", list(range(prompt)), SamplingParams(max_tokens=50), None)
    assert manager.allocate_slots(request, prompt, num_lookahead_tokens=0) is not None
    request.num_computed_tokens = MAX_LEN - 1
    assert manager.accounting.fits_in_room("a", MAX_LEN + 4)
    # Past max_model_len the slots stop at max_model_len (vLLM stops the request there).
    assert manager.allocate_slots(request, 1, num_lookahead_tokens=4) is not None
    assert manager.accounting.logical_len("a") == MAX_LEN
    assert manager.accounting.pages_held("a") == _pages(MAX_LEN)


def test_a_full_logical_pool_refuses_without_counting_pages():
    """vLLM's logical pool, capped at LOGICAL_OVERCOMMIT x the uncompressed tokens, can
    run out while pages are free: allocate_slots answers None (vLLM then waits or
    preempts) on both routes and no page is charged."""
    manager = _manager(num_blocks=3)  # the null block + 2 token blocks
    accounting = manager.accounting
    a = Request("a", list(range(BLOCK)), SamplingParams(max_tokens=99), None)
    assert manager.allocate_slots(a, BLOCK, num_lookahead_tokens=0) is not None
    a.num_computed_tokens = BLOCK
    assert manager.allocate_slots(a, 1, num_lookahead_tokens=0) is not None  # block 2
    free = accounting.num_free_pages
    b = Request("b", list(range(4)), SamplingParams(max_tokens=9), None)
    assert manager.allocate_slots(b, 4, num_lookahead_tokens=0) is None  # counted route
    a.num_computed_tokens = 2 * BLOCK
    assert accounting.fits_in_room("a", 2 * BLOCK) and not accounting.fits_in_room("a", 2 * BLOCK + 1)
    assert manager.allocate_slots(a, 1, num_lookahead_tokens=0) is None
    assert accounting.num_free_pages == free and accounting.logical_len("a") == BLOCK + 1
    assert accounting.pages_held_by_request() == {"a": _pages(BLOCK + 1)}


def test_logical_pool_size():
    """Every running request at full length, at most 64x the token blocks the pages
    hold uncompressed, at least one request at full length, never more than the pages."""
    from kvcompress.vllm_glue.kv_manager import LOGICAL_OVERCOMMIT

    assert LOGICAL_OVERCOMMIT == 64
    # Llama-3.1-8B (32 layers x 8 KV heads), 16-token pages, ~50 GB of bf16 pages
    # (8 KiB each), 128K context, 1024 sequences: 6.1M pages -> 1.5M logical blocks.
    pages = 6_100_000
    assert logical_block_count(pages, 1024, 131072, 16, pages_per_token_block=256) == 64 * (pages // 256) + 1
    # Few heads: the pages bound (a block per page) is the smaller.
    assert logical_block_count(1000, 64, 4096, 16, pages_per_token_block=8) == 1000 + 1
    # Few sequences: every one at full length.
    assert logical_block_count(10**6, 2, 4096, 16, pages_per_token_block=256) == 2 * 256 + 1
    # A pool smaller than one request's blocks at the overcommit still takes one request.
    assert logical_block_count(300, 8, 131072, 16, pages_per_token_block=256) == 300 + 1
    assert logical_block_count(10**5, 8, 131072, 16, pages_per_token_block=4096) == 8192 + 1
