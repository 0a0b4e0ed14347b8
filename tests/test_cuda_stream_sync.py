"""On a CUDA GPU: the passes that run inside a layer's attention at a prompt's end (and
kvzip's scoring forward, and the decode metric pass) make no call that waits for the
CUDA stream, and compute what the same calls compute on CPU.

(The CPU attention path's own decode metric pass, ``decode_metrics_by_head``, reads the
longest head on the host by design: on CUDA the Triton pass below runs instead.)

CPU tests catch host reads by torch call name (``tests/host_reads.py``); this module
asks CUDA itself: ``torch.cuda.set_sync_debug_mode("error")`` raises at any synchronizing
call (``.item()``, ``nonzero``, boolean-mask indexing, a copy from pageable host memory).
Inputs are made on the device first; only the passes run under the mode.

Skipped without a GPU (CI has none). On a GPU machine (torch + triton, no vLLM needed):
``python -m pytest --noconftest tests/test_cuda_stream_sync.py``.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch

from kvcompress.ops.kv_pool import KVPool
from kvcompress.ops.metrics import accumulate_metrics, attention_metrics, pool_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@contextmanager
def no_stream_sync():
    """Any call inside that waits for the CUDA stream raises RuntimeError."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _prompt_layer(seed: int, heads: int = 4, group: int = 3, dim: int = 64, block: int = 16):
    """A pool of 48 pages with ``heads`` uncompressed prompt heads of ragged lengths on
    scattered pages (slot i at position i), table columns past a head's length pointing
    at page 0 and at other heads' pages, and the prompt's last 8 queries."""
    gen = torch.Generator().manual_seed(seed)
    num_pages, width = 48, 6
    lens = torch.tensor([96, 81, 17, 1][:heads])
    order = torch.randperm(num_pages - 1, generator=gen)[: heads * width] + 1
    tables = order.view(heads, width).clone()
    tables[0, -1] = 0
    tables[-1, -2:] = tables[0, :2]
    slot_positions = torch.full((num_pages, block), 10_000, dtype=torch.int32)
    for head in range(heads):
        used = -(-int(lens[head]) // block)
        slot_positions[tables[head, :used]] = torch.arange(used * block, dtype=torch.int32).view(-1, block)
    key_cache = torch.randn(num_pages, block, dim, generator=gen)
    slot_metrics = torch.rand(num_pages, block, generator=gen)
    query = torch.randn(8, heads * group, dim, generator=gen)
    positions = torch.arange(88, 96)
    return dict(key_cache=key_cache, slot_positions=slot_positions, slot_metrics=slot_metrics,
                tables=tables, lens=lens, query=query, positions=positions)


def _to(case: dict, device) -> dict:
    return {k: v.to(device) for k, v in case.items()}


def _prompt_metric_chain(case: dict, mode: str, word_starts) -> torch.Tensor:
    scored = attention_metrics(case["query"], case["positions"], case["key_cache"], case["slot_positions"],
                               case["tables"], case["lens"], 0.125)
    accumulate_metrics(case["slot_metrics"], case["tables"], case["lens"], scored)
    pool_metrics(case["slot_metrics"], case["tables"], case["lens"], 5, mode, word_starts)
    return case["slot_metrics"]


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("words", [False, True])
def test_prompt_metric_chain_waits_for_nothing(mode, words):
    """attention_metrics -> accumulate_metrics -> pool_metrics (max: kvc / snapkv / ...;
    avg: xkv), with and without word spans, as the backend runs them at every layer."""
    cpu = _prompt_layer(seed=1)
    word_starts = (torch.arange(96) // 3) * 3 if words else None
    want = _prompt_metric_chain(dict(cpu), mode, word_starts)
    gpu = _to(_prompt_layer(seed=1), CUDA)
    gpu_words = word_starts.to(CUDA) if words else None
    with no_stream_sync():
        got = _prompt_metric_chain(gpu, mode, gpu_words)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


def test_kvc_ea_prompt_end_ranking_waits_for_nothing():
    """kvc-ea's ranking given the window's end position from the host, as the runner
    gives it: the same multiset of values per head as on CPU, in (nearly) the same order
    (float rounding may swap near-equal neighbours)."""
    from kvcompress.ops.expected_attention import RopeFrequencies, rank_prompt_metrics

    freqs = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    cpu = _prompt_layer(seed=2)
    rank_prompt_metrics(cpu["slot_metrics"], cpu["key_cache"], cpu["query"], cpu["positions"], cpu["tables"],
                        cpu["lens"], 0.125, RopeFrequencies(freqs, True), sinks=1, protected=4)
    gpu = _to(_prompt_layer(seed=2), CUDA)
    rope = RopeFrequencies(freqs.to(CUDA), True)
    with no_stream_sync():
        rank_prompt_metrics(gpu["slot_metrics"], gpu["key_cache"], gpu["query"], gpu["positions"], gpu["tables"],
                            gpu["lens"], 0.125, rope, sinks=1, protected=4, start=96)
    got, want = gpu["slot_metrics"].cpu(), cpu["slot_metrics"]
    block = got.shape[1]
    for head, length in enumerate(cpu["lens"].tolist()):
        slots = cpu["tables"][head].repeat_interleave(block)[:length] * block + torch.arange(length) % block
        head_got, head_want = got.view(-1)[slots], want.view(-1)[slots]
        assert torch.equal(head_got.sort().values, head_want.sort().values)
        assert (head_got == head_want).float().mean() >= 0.9


def test_kvzip_reconstruction_attention_waits_for_nothing():
    """kvzip's scoring attention of one sequence in one layer (ragged held heads)."""
    from kvcompress.ops.reconstruction import reconstruction_attention
    from paged_cases import make_case

    pool, batch, _ = make_case([1], 4, 2, 128, 16, torch.float32, 5, max_context=300)
    gen = torch.Generator().manual_seed(50)
    query = torch.randn((33, 8, 128), generator=gen)
    key, value = torch.randn((33, 4, 128), generator=gen), torch.randn((33, 4, 128), generator=gen)
    tables, lens = batch.block_tables[0], batch.head_lens[0]
    out = torch.empty_like(query)
    scores = reconstruction_attention(query, key, value, pool, tables, lens, 128 ** -0.5, out)
    gpu_pool = KVPool(*(t.to(CUDA) for t in (pool.key_cache, pool.value_cache, pool.slot_positions,
                                              pool.slot_metrics)))
    g = [t.to(CUDA) for t in (query, key, value, tables, lens)]
    gpu_out = torch.empty_like(g[0])
    with no_stream_sync():
        gpu_scores = reconstruction_attention(g[0], g[1], g[2], gpu_pool, g[3], g[4], 128 ** -0.5, gpu_out)
    torch.testing.assert_close(gpu_out.cpu(), out, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(gpu_scores.cpu(), scores, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1, 1], [1, 17, 1, 30, 1]], ids=["decode", "mixed"])
def test_triton_decode_metric_pass_waits_for_nothing_on_a_steps_first_layer(query_lens):
    """The decode metric pass of CUDA's flattened path (``decode_metrics_triton``) at a
    step's first layer, where the batch's decode rows are not yet on the device: built
    on the host and copied without a stream wait; the metrics equal the reference's."""
    from kvcompress.ops import triton_attention
    from kvcompress.ops.kv_pool import MetricSink
    from kvcompress.ops.reference_attention import reference_paged_attention
    from paged_cases import make_case, moved_to

    pool, batch, query = make_case(query_lens, 2, 4, 64, 16, torch.float32, 11, max_context=1500,
                                   kernel_layout=False)
    batch = dataclasses.replace(batch, block_tables=batch.block_tables.to(torch.int32))
    selected = torch.tensor([s % 2 == 0 for s in range(len(query_lens))])
    want = KVPool(pool.key_cache, pool.value_cache, pool.slot_positions, torch.zeros_like(pool.slot_metrics))
    reference_paged_attention(query, want, batch, 64 ** -0.5, metrics=MetricSink(selected))
    gpu_pool, gpu_batch, gpu_query = moved_to((pool, batch, query), CUDA)
    gpu_pool = KVPool(gpu_pool.key_cache, gpu_pool.value_cache, gpu_pool.slot_positions,
                      torch.zeros_like(gpu_pool.slot_metrics))
    sink = MetricSink(selected.to(CUDA))
    max_len = int(batch.head_lens.max())
    triton_attention._PLAN_CACHE.clear()
    with no_stream_sync():
        triton_attention.decode_metrics_triton(gpu_query, gpu_pool, gpu_batch, 64 ** -0.5, sink,
                                               max_head_len=max_len)
    torch.testing.assert_close(gpu_pool.slot_metrics.cpu(), want.slot_metrics, rtol=1e-4, atol=1e-6)


def test_plan_tensors_are_cached_once_for_cuda_and_cuda_0():
    """Callers name the device ``cuda`` or ``cuda:0``: one cached copy per step."""
    from kvcompress.ops import triton_attention

    starts = [0, 1, 5, 6]
    triton_attention._PLAN_CACHE.clear()
    with no_stream_sync():
        rows = triton_attention._decode_rows(starts, torch.device("cuda"))
        decode, blocks = triton_attention._batch_plan(starts, 16, torch.device("cuda", 0))
    assert decode is rows
    assert rows.cpu().tolist() == [[0, 2], [0, 5]]
    assert blocks.cpu().tolist() == [[1], [1], [5]]


def test_the_check_catches_a_host_read():
    """The mode is on inside ``no_stream_sync``: an ``.item()`` raises there."""
    x = torch.ones(3, device=CUDA)
    with pytest.raises(RuntimeError), no_stream_sync():
        x.sum().item()
