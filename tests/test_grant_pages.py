"""Issue 61 step 4 (docs/design-61-metadata-rows.md): requests that never compress are
counted in stock vLLM's blocks (pairs of 64-token pages on CPU), and the pages kvcompress
keeps past the pool (identity pages, scratch page) are paid for beside the tables, so a
rate-1 pool holds every page of vLLM's token blocks.

Oracles: brute-force per-head sums; vLLM's own ``KVCacheConfig`` objects. The cache and
the accounting driven together through random operations with groups of pages:
``test_metadata_row_pages.py``; the engine against stock vLLM: ``test_engine_tiny.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcompress.page_accounting import PageAccounting, counted_pages

LAYERS, HEADS, BLOCK = 3, 2, 64


def test_grant_pages_are_stock_blocks_over_pages():
    from kvcompress.vllm_glue.kv_layout import grant_pages_for

    assert grant_pages_for(64, "cpu") == 2 and grant_pages_for(128, "cpu") == 1
    assert grant_pages_for(16, "cpu") == 8 and grant_pages_for(32, torch.device("cpu")) == 4
    assert grant_pages_for(16, "cuda") == 1 and grant_pages_for(64, "cuda") == 1


def test_counted_pages_round_only_never_compressing_heads():
    pages = np.array([[0, 1, 2, 3, 5]])
    assert counted_pages(pages, 2, np.array([[True]])).tolist() == [[0, 1, 2, 3, 5]]
    assert counted_pages(pages, 2, np.array([[False]])).tolist() == [[0, 2, 2, 4, 6]]
    assert counted_pages(pages, 3, False).tolist() == [[0, 3, 3, 3, 6]]
    assert counted_pages(7, 1, False) == 7


def _brute(lens: np.ndarray, grant: int, compresses: bool) -> int:
    total = 0
    for n in lens.reshape(-1).tolist():
        pages = math.ceil(n / BLOCK)
        total += pages if compresses else math.ceil(pages / grant) * grant
    return total


@pytest.mark.parametrize("grant", [1, 2, 4])
def test_accounting_counts_never_compressing_requests_in_groups(grant):
    """Admission asks (``shortfall`` / ``pages_to_grow`` of a request holding nothing),
    growth, the fast path's room and release all count ``grant * ceil(pages / grant)`` a
    head for a request that never compresses, ``ceil(len / b)`` for one that does (no
    metadata rows here)."""
    rng = np.random.default_rng(grant)
    accounting = PageAccounting(10_000, LAYERS, HEADS, BLOCK, max_requests=4, grant_pages=grant)
    for index in range(12):
        request_id, compresses = f"r{index}", bool(index % 2)
        accounting.note_compresses(request_id, compresses)
        tokens = int(rng.integers(1, 700))
        asked = accounting.pages_to_grow(request_id, tokens)
        assert accounting.shortfall(request_id, tokens) == asked - accounting.num_free_pages
        assert accounting.grow(request_id, tokens) == asked == _brute(np.full(LAYERS * HEADS, tokens), grant, compresses)
        for _ in range(int(rng.integers(1, 200))):  # decode steps, through the fast path where it fits
            target = accounting.logical_len(request_id) + 1
            if accounting.fits_in_room(request_id, target):
                accounting.grow_in_room(request_id, target)
            else:
                accounting.grow(request_id, target)
        accounting.check_consistent()
        lens = accounting.head_lens_of(request_id)
        assert accounting.pages_held(request_id) == _brute(lens, grant, compresses)
        # The fast path's bound: the tokens every head reaches before a new group (or page).
        room = min(math.ceil(math.ceil(n / BLOCK) / (1 if compresses else grant)) * (1 if compresses else grant)
                   * BLOCK - n for n in lens.reshape(-1).tolist())
        assert accounting.fits_in_room(request_id, accounting.logical_len(request_id) + room)
        assert not accounting.fits_in_room(request_id, accounting.logical_len(request_id) + room + 1)
        assert accounting.release(request_id) == _brute(lens, grant, compresses)
    assert accounting.num_free_pages == 10_000


def test_compression_counts_single_pages():
    """A compressing request is counted page by page, so the pages a compression frees
    are exactly those its heads give back, whatever the group of the others."""
    accounting = PageAccounting(1000, LAYERS, HEADS, BLOCK, max_requests=2, grant_pages=2)
    accounting.note_compresses("c", True)
    accounting.grow("c", 3 * BLOCK + 1)  # 4 pages a head
    accounting.mark_compressed("c", 5)
    assert accounting.num_free_pages == 1000 - 4 * LAYERS * HEADS + 5
    lens = np.full((LAYERS, HEADS), 3 * BLOCK + 1)
    lens[0, :] = 2 * BLOCK  # 2 heads give back 2 pages each, a third head one
    lens[1, 0] = 3 * BLOCK
    accounting.adopt("c", lens)
    accounting.check_consistent()
    assert accounting.pages_held("c") == _brute(lens, 2, True) == 4 * LAYERS * HEADS - 5


def test_watermark_in_whole_stock_blocks_for_requests_that_never_compress():
    from kvcompress.vllm_glue.kv_manager import watermark_pages

    accounting = PageAccounting(24300, 30, 3, BLOCK, grant_pages=2)  # SmolLM2: 135 blocks of 128
    assert watermark_pages(0.01, accounting, False) == 180  # stock: int(0.01 x 136) = 1 block
    assert watermark_pages(0.01, accounting, True) == 243  # 1% of the pages
    assert watermark_pages(0.0, accounting, False) == 0
    assert watermark_pages(0.05, PageAccounting(24300, 30, 3, BLOCK), False) == 13 * 90  # int(0.05 x 270) blocks of 64


def _kv_cache_config(num_blocks: int, block_size: int = 64):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=64, dtype=torch.float32)
    names = [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
    size = num_blocks * spec.page_size_bytes * LAYERS
    tensors = [KVCacheTensor(size=size, layers=names, layer_stride=spec.page_size_bytes * num_blocks,
                             block_stride=spec.page_size_bytes)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def test_the_buffer_holds_the_pages_past_the_pool():
    """The worker asks vLLM for its blocks and the identity pages and scratch page past
    them; the scheduler's pool is every page of the blocks; the budget pays for the rest."""
    from kvcompress.vllm_glue.kv_layout import SCRATCH_PAGES, MetadataRows, pages_in_pool, with_pages_past_the_pool
    from kvcompress.vllm_glue.memory import PerHeadLayout
    from kvcompress.vllm_glue.pool_builder import PoolShape

    config = _kv_cache_config(40)
    rows = MetadataRows.of(config, 8192, "cpu")  # 128 token blocks: 2 identity pages of 64 rows
    assert rows == MetadataRows(64, 2)
    page_bytes = 2 * 64 * 64 * 4
    grown = with_pages_past_the_pool(config, rows)
    assert grown.kv_cache_tensors[0].size == config.kv_cache_tensors[0].size + 3 * page_bytes
    assert config.kv_cache_tensors[0].size == 40 * LAYERS * HEADS * page_bytes  # untouched
    assert pages_in_pool(grown)[0] == pages_in_pool(config)[0] == 40 * LAYERS * HEADS
    shape = PoolShape.of(grown, rows=rows)
    assert shape.num_pages == 40 * LAYERS * HEADS and shape.buffer_pages == shape.num_pages + 2 + SCRATCH_PAGES
    assert shape.buffer_pages * page_bytes == grown.kv_cache_tensors[0].size

    layout = PerHeadLayout(LAYERS, HEADS, 64, 4, 64, 8, 8192, 8, identity_rows=True)
    assert layout.pages_past_the_pool == 3
    without = layout.metadata_bytes(1000) - layout.pages_past_the_pool * layout.page_bytes
    assert without > 0 and layout.metadata_bytes(1000) == without + 3 * page_bytes
    available = 200 * LAYERS * HEADS * page_bytes
    parts = layout.metadata_breakdown(available)
    assert sum(parts.values()) == available
    assert parts["slot_metadata"] == 2 * page_bytes and parts["pages"] % (LAYERS * HEADS * page_bytes) == 0


def test_admission_gate_counts_what_stock_vllm_counts_for_a_sliding_window_model():
    """vLLM's full-sequence admission gate for a request that never compresses, in pages
    of 64 tokens counted in pairs, is never more than stock vLLM's in 128-token blocks
    (per layer the whole sequence, or ``SlidingWindowSpec``'s own
    ``max_admission_blocks_per_request`` on a windowed layer; Gemma 3's shape: window
    512, five windowed layers to one full), and at most one pair a windowed layer less
    (finer pages start the window nearer its first token); with no window the two agree."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    windows = (512, 512, 512, 512, 512, None) * 2
    spec = SlidingWindowSpec(block_size=128, num_kv_heads=1, head_size=256, dtype=torch.float32, sliding_window=512)
    accounting = PageAccounting(100_000, len(windows), 1, BLOCK, layer_windows=windows, grant_pages=2)
    for full in (100, 511, 1023, 1024, 1100, 2048, 4000):
        for in_flight in (256, 512, 2048):
            cap = spec.max_admission_blocks_per_request(max_in_flight_tokens=in_flight, max_model_len=8192)
            stock_blocks = sum(math.ceil(full / 128) if w is None else min(math.ceil(full / 128), cap) for w in windows)
            counted = accounting.whole_sequence_shortfall("r", full, in_flight) + 100_000
            assert stock_blocks * 2 - 2 * 10 <= counted <= stock_blocks * 2, (full, in_flight)
            if full <= 511 + in_flight:  # no window cap anywhere: the whole sequence, as stock
                assert counted == stock_blocks * 2
