"""Running a step's compression orders on the worker (``worker_compression.py``,
vLLM-free): one batched compression per policy, pending metrics flushed first, the
recorder called per group, counts and the mismatch against the pages ordered. The
compression itself is ``compress_sequences`` (its oracles: test_eviction_ops.py); here
its pages freed and head lengths are compared with one call over the same sequences."""

from __future__ import annotations

import torch

from kvcompress.config import KVCompressConfig
from kvcompress.contract import CompressionOrder, RequestCompression
from kvcompress.budget import request_budget
from kvcompress.ops import PerHeadPagedCache, compress_sequences
from kvcompress.worker_compression import CompressionRun, WorkerStats, run_orders

LAYERS, KV_HEADS, BLOCK, DIM = 2, 2, 4, 8


def _cache(lengths: list[int]):
    cache = PerHeadPagedCache(256, LAYERS, KV_HEADS, BLOCK, max_seqs=4, max_pages_per_head=16)
    pool = cache.kv_pool(torch.zeros(256, BLOCK, DIM), torch.zeros(256, BLOCK, DIM))
    slots = [cache.new_sequence() for _ in lengths]
    for slot, length in zip(slots, lengths):
        cache.append(torch.tensor([slot]), torch.tensor([length]), torch.arange(length))
    generator = torch.Generator().manual_seed(0)
    cache.slot_metrics.copy_(torch.rand(cache.slot_metrics.shape, generator=generator))
    return cache, pool, slots


def _order(policy: str, evict: int, context: int) -> CompressionOrder:
    settings = KVCompressConfig(enabled=True, rate=4, protected_window=4, min_cache_tokens=4, sink_tokens=0)
    budget = request_budget(settings, {"kv_compress_policy": policy})
    return CompressionOrder((evict,), context, RequestCompression(budget, settings.policy_for(policy)))


def test_orders_run_one_compression_per_policy_after_flushing_their_metrics():
    lengths = [40, 36, 44]
    cache, pool, slots = _cache(lengths)
    reference, ref_pool, _ = _cache(lengths)
    orders = {"a": _order("kvc", 4, 40), "b": _order("streamingllm", 3, 36), "c": _order("kvc", 5, 44),
              "not-placed": _order("kvc", 2, 10)}
    placed = {"a": slots[0], "b": slots[1], "c": slots[2]}
    calls = []
    run = CompressionRun(cache=cache, pool=pool, ops=None, rank=0, block_cost="max",
                         generator=lambda: torch.Generator().manual_seed(1),
                         flush=lambda s: calls.append(("flush", list(s))),
                         record=lambda group, o: calls.append(("record", list(group))))
    stats = WorkerStats()
    outcome = run_orders(run, orders, placed, stats)
    assert calls == [("flush", [slots[0], slots[1], slots[2]]), ("record", ["a", "c"]), ("record", ["b"])]
    assert outcome.request_ids == ["a", "b", "c"] and [r.policy for r in outcome.records] == ["kvc", "streamingllm"]
    # The oracle: the same compressions, called directly, group by group.
    freed = 0
    for group, policy in ((["a", "c"], "kvc"), (["b"], "streamingllm")):
        result = compress_sequences(
            reference, ref_pool, torch.tensor([placed[r] for r in group]),
            torch.tensor([orders[r].evict_pages_on(0) for r in group]), torch.tensor([orders[r].context_len for r in group]),
            4, 0, block_cost="max", policy=orders[group[0]].compression.policy,
            generator=torch.Generator().manual_seed(1))
        freed += int(result.pages_freed)
    assert torch.equal(cache.head_lens, reference.head_lens) and outcome.pages_freed == freed > 0
    assert stats.compressions == 3 and stats.pages_freed == freed and stats.pages_freed_by_policy.keys() == {"kvc", "streamingllm"}
    assert outcome.pages_ordered == 12 and outcome.mismatch == (freed != 12)
    assert stats.evict_mismatches == int(outcome.mismatch)


def test_no_placed_request_no_work():
    cache, pool, _ = _cache([8])
    flushed = []
    run = CompressionRun(cache=cache, pool=pool, ops=None, rank=0, block_cost="max",
                         generator=torch.Generator, flush=flushed.append)
    stats = WorkerStats()
    outcome = run_orders(run, {"x": _order("kvc", 1, 8)}, {}, stats)
    assert outcome.request_ids == [] and not outcome.mismatch and flushed == [] and stats == WorkerStats()


def test_step_report_counts_each_live_request_s_pages_past_its_prefix_groups():
    """The report's pages held are recounted by hand from the head lengths (pages per
    head = ceil(len / block)), less the leading shared pages of each head; head lengths
    only for the compressed requests; free pages from the allocator."""
    import math

    from kvcompress.worker_compression import CompressionOutcome, step_report
    from kvcompress.worker_requests import WorkerRequests

    lengths = [40, 36, 9]
    cache, _, slots = _cache(lengths)
    requests = WorkerRequests(cache.max_seqs)
    for name, slot, length in zip("abc", slots, lengths):
        requests.admit(name, _order("kvc", 1, length).compression, prefix_hits=(7,) if name == "b" else ())
        requests.place(name, slot, length, length)
    outcome = CompressionOutcome(["a", "gone"], [], pages_freed=3, pages_ordered=4)
    stats = WorkerStats()
    report = step_report(cache, requests, outcome, True, stats)
    heads = LAYERS * KV_HEADS
    want = {name: heads * (math.ceil(length / BLOCK) - (1 if name == "b" else 0))
            for name, length in zip("abc", lengths)}
    assert report.pages_held == want
    assert list(report.head_lens) == ["a"] and report.head_lens["a"].tolist() == [[40, 40], [40, 40]]
    assert report.evict_mismatches == 1 and report.free_pages == cache.allocator.num_free
    assert stats.max_pages_used == heads * sum(math.ceil(length / BLOCK) for length in lengths)
    assert step_report(cache, requests, outcome, False, stats).pages_held is None
