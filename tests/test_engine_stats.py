"""kvcompress's figures for ``/metrics`` as the planner counts them (no vLLM).

Oracle: the events fed in by hand (orders, worker reports, preemptions) and page
counts recomputed from the head lengths the test sets.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcompress.compression_planner import KV_GAUGES_MAX_AGE_S, CompressionPlanner
from kvcompress.config import KVCompressConfig
from kvcompress.contract import CompressionRecord, WorkerReport
from kvcompress.engine_stats import KVCompressStats, PolicyTotals
from kvcompress.page_accounting import PageAccounting
from worker_reports import report_of_scheduler_heads

LAYERS, HEADS, BLOCK, POOL = 2, 2, 16, 4096


class Params:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args


class Req:
    def __init__(self, request_id, prompt, **fields):
        self.request_id = request_id
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = prompt
        self.num_tokens = prompt + 1
        self.sampling_params = Params(fields or None)


def _planner(metrics: bool = True) -> CompressionPlanner:
    config = KVCompressConfig(enabled=True, rate=4, protected_window=8, min_cache_tokens=16)
    planner = CompressionPlanner(config, PageAccounting(POOL, LAYERS, HEADS, BLOCK, max_requests=4))
    if metrics:
        planner.enable_metrics()
    return planner


def _prefilled(planner, request_id, prompt, **fields) -> Req:
    planner.accounting.grow(request_id, prompt)
    return Req(request_id, prompt, **fields)


def _report(planner, shrink: dict, records=(), evict_mismatches=0) -> WorkerReport:
    """The report of a worker that holds the scheduler's heads after ``shrink``."""
    return report_of_scheduler_heads(planner.accounting, shrink, records, evict_mismatches)


def _record(policy, requests, pages, before, evicted, seconds) -> CompressionRecord:
    return CompressionRecord(policy=policy, requests=requests, pages_freed=pages,
                             kvs_before=before, kvs_evicted=evicted, seconds=seconds)


def _exact_kv_gauges(accounting) -> tuple[int, int]:
    """(kvs_held, kvs_logical) summed from the heads, growth applied."""
    held = sum(int(accounting.head_lens_of(r).sum()) for r in accounting.request_ids())
    logical = sum(accounting.logical_len(r) for r in accounting.request_ids()) * LAYERS * HEADS
    return held, logical


def test_kv_gauges_lag_decode_growth_by_at_most_their_age_and_nothing_else():
    planner = _planner()
    accounting = planner.accounting
    _prefilled(planner, "a", 300)  # 19 pages of 16 per head: room for 4 more tokens
    now = 100.0
    first = planner.take_metrics(now=now)
    assert (first.kvs_held, first.kvs_logical) == _exact_kv_gauges(accounting) == (LAYERS * HEADS * 300,) * 2

    # Decode growth inside held pages (the KV manager's fast path, no array op) ...
    accounting.grow_in_room("a", 302)
    young = planner.take_metrics(now=now + KV_GAUGES_MAX_AGE_S / 2)
    assert (young.kvs_held, young.kvs_logical) == (first.kvs_held, first.kvs_logical)  # may lag ...
    assert young.pages_free == POOL - LAYERS * HEADS * 19  # (pages are never late)
    due = planner.take_metrics(now=now + KV_GAUGES_MAX_AGE_S)
    assert (due.kvs_held, due.kvs_logical) == _exact_kv_gauges(accounting) == (LAYERS * HEADS * 302,) * 2

    # ... but an admission, a compression or a release shows at once, growth included.
    for change in (
        lambda: (accounting.grow_in_room("a", 303), _prefilled(planner, "b", 64)),
        lambda: (accounting.grow_in_room("a", 304), accounting.set_head_lens("b", np.full((LAYERS, HEADS), 40))),
        lambda: accounting.release("b"),
    ):
        change()
        figures = planner.take_metrics(now=now + KV_GAUGES_MAX_AGE_S)  # no time passed
        assert (figures.kvs_held, figures.kvs_logical) == _exact_kv_gauges(accounting)
        assert figures.pages_free == POOL - sum(accounting.pages_held(r) for r in accounting.request_ids())
    assert figures.kvs_held == figures.kvs_logical == LAYERS * HEADS * 304


def test_counts_travel_as_deltas_and_gauges_follow_the_accounting():
    planner = _planner()
    a = _prefilled(planner, "a", 320)                      # server policy kvc
    b = _prefilled(planner, "b", 640, kv_compress_policy="snapkv")
    planner.begin_step()
    planner.compress_due([a, b])
    orders = planner.take_orders()
    assert set(orders) == {"a", "b"}
    # The worker keeps 96 KVs per head of a, 176 of b (its real numbers do not matter:
    # the planner counts what the worker says).
    shrink = {"a": np.full((LAYERS, HEADS), 96, np.int64), "b": np.full((LAYERS, HEADS), 176, np.int64)}
    records = [_record("kvc", 1, 56, 1280, 896, 0.004), _record("snapkv", 1, 116, 2560, 1856, 0.25)]
    assert planner.adopt(_report(planner, shrink, records))

    figures = planner.take_metrics()
    assert figures.compressions == {"after_prefill": {"kvc": 1, "snapkv": 1}}
    assert figures.by_policy == {
        "kvc": PolicyTotals(1, 56, 1280, 896, 0.004),
        "snapkv": PolicyTotals(1, 116, 2560, 1856, 0.25),
    }
    assert figures.compression_seconds == {"kvc": [0.004], "snapkv": [0.25]}
    assert (figures.steps_checked, figures.page_mismatches, figures.evict_mismatches) == (1, 0, 0)
    # Gauges: pages and KVs recomputed from the head lengths set above.
    held_pages = LAYERS * HEADS * (96 // BLOCK + 176 // BLOCK)
    assert figures.pages_total == POOL
    assert figures.pages_free == POOL - held_pages and figures.pages_held == held_pages
    assert figures.kvs_held == LAYERS * HEADS * (96 + 176)
    assert figures.kvs_logical == LAYERS * HEADS * (320 + 640)
    assert figures.kvs_kept_ratio == pytest.approx((96 + 176) / (320 + 640))

    # The next take holds only what happened since: a preemption of a compressed
    # request, a step with a disagreeing worker, and an evict mismatch.
    planner.begin_step()
    planner.on_preempted("a")
    planner.accounting.release("a")
    bad = _report(planner, {}, evict_mismatches=1)
    bad.free_pages -= 1
    assert not planner.adopt(bad)
    later = planner.take_metrics()
    assert later.compressions == {} and later.by_policy == {} and later.compression_seconds == {}
    assert (later.preemptions, later.preemptions_after_compression) == (1, 1)
    assert (later.steps_checked, later.page_mismatches, later.evict_mismatches) == (1, 1, 1)
    assert later.kvs_held == LAYERS * HEADS * 176 and later.kvs_logical == LAYERS * HEADS * 640

    # Cumulative counters (kvc_page_stats) keep everything.
    stats = planner.stats
    assert stats.compressions_by_policy == {"kvc": 1, "snapkv": 1}
    assert stats.reported["snapkv"] == PolicyTotals(1, 116, 2560, 1856, 0.25)
    assert stats.evict_mismatches == 1 and stats.mismatches == 1 and stats.num_preemptions == 1
    assert planner.page_stats()["reported"]["kvc"]["pages_freed"] == 56


def test_instead_of_preemption_is_its_own_reason():
    planner = _planner()
    a = _prefilled(planner, "a", 320)
    planner.begin_step()
    planner.relieve(a, [], pages_short=1)
    assert planner.take_metrics().compressions == {"instead_of_preemption": {"kvc": 1}}


def test_without_stats_nothing_accumulates_for_metrics():
    planner = _planner(metrics=False)
    a = _prefilled(planner, "a", 320)
    planner.begin_step()
    planner.compress_due([a])
    planner.take_orders()
    shrink = {"a": np.full((LAYERS, HEADS), 96, np.int64)}
    planner.adopt(_report(planner, shrink, [_record("kvc", 1, 56, 1280, 896, 0.01)]))
    assert planner.metrics is None and planner.take_metrics() is None
    assert planner.stats.reported["kvc"].pages_freed == 56


def test_no_live_request_keeps_everything():
    assert KVCompressStats().kvs_kept_ratio == 1.0
