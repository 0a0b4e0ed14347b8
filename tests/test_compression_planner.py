"""The compression planner without vLLM: which requests, when, how many pages.

Oracle: page counts recomputed by hand from the budget rule in ``kvcompress.budget``'s
docstring (keep = max(min_cache, ceil(L / r)) + protected; pages = ceil(keep L H / b))
and the order rules in the planner's docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvcompress.compression_planner import CompressionPlanner
from kvcompress.config import KVCompressConfig
from kvcompress.contract import WorkerReport
from kvcompress.page_accounting import PageAccounting
from worker_reports import report_of_scheduler_heads

LAYERS, HEADS, BLOCK = 2, 2, 16


@dataclass
class Params:
    extra_args: dict | None = None


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    output_tokens: int = 0
    sampling_params: Params = field(default_factory=Params)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.output_tokens


def _planner(num_pages: int = 4096, **settings) -> CompressionPlanner:
    config = KVCompressConfig(enabled=True, **settings)
    accounting = PageAccounting(num_pages, LAYERS, HEADS, BLOCK, max_requests=8)
    return CompressionPlanner(config, accounting)


def _prefilled(planner: CompressionPlanner, request_id: str, prompt: int, **fields) -> Req:
    """A request whose prompt is in the cache and whose first token was sampled."""
    request = Req(request_id, prompt, num_computed_tokens=prompt, output_tokens=1,
                  sampling_params=Params(fields or None))
    planner.accounting.grow(request_id, prompt)
    return request


def _expected_evict(prompt: int, rate: float, window: int, min_cache: int, sinks: int = 0) -> int:
    held = LAYERS * HEADS * math.ceil(prompt / BLOCK)
    keep = min(prompt, max(min_cache, math.ceil(prompt / rate)) + min(prompt, sinks + window))
    return max(0, held - math.ceil(keep * LAYERS * HEADS / BLOCK))


def _worker_report(planner: CompressionPlanner, shrink: dict[str, np.ndarray]) -> WorkerReport:
    """What a worker holding exactly the scheduler's heads (after ``shrink``) reports."""
    return report_of_scheduler_heads(planner.accounting, shrink)


def test_prefilled_request_is_ordered_its_budget_in_pages():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    request = _prefilled(planner, "a", 1000)
    free_before = planner.accounting.num_free_pages
    planner.begin_step()
    planner.compress_due([request])
    orders = planner.take_orders()
    expected = _expected_evict(1000, 4, 8, 16)
    assert expected > 0
    assert list(orders) == ["a"]
    assert orders["a"].evict_pages == expected
    assert orders["a"].context_len == 1000
    assert orders["a"].compression.policy.name == "kvc"
    assert planner.accounting.num_free_pages == free_before + expected  # credited at once
    assert planner.stats.compressions_after_prefill == 1


def test_no_order_before_the_prompt_is_in_the_cache_or_at_rate_one():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    half = Req("half", 1000, num_computed_tokens=512)
    planner.accounting.grow("half", 512)
    uncompressed = _prefilled(planner, "off", 1000, kv_compress_rate=1)
    planner.begin_step()
    planner.compress_due([half, uncompressed])
    assert planner.take_orders() == {}


def test_request_fields_override_the_server_and_invalid_ones_fall_back():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    custom = _prefilled(planner, "custom", 1000, kv_compress_rate=8,
                        kv_compress_policy="snapkv", kv_compress_observation_window=5)
    broken = _prefilled(planner, "broken", 1000, kv_compress_rate="fast")
    planner.begin_step()
    planner.compress_due([custom, broken])
    orders = planner.take_orders()
    assert orders["custom"].evict_pages == _expected_evict(1000, 8, 8, 16)
    assert orders["custom"].compression.policy.name == "snapkv"
    assert orders["custom"].compression.policy.metric.observation_window == 5
    assert orders["broken"].evict_pages == _expected_evict(1000, 4, 8, 16)  # server settings
    assert orders["broken"].compression.policy.name == "kvc"


def test_kv_cap_per_step_orders_never_compressed_then_least_recent_first():
    # Each 1000-token request sorts 4000 KVs; the cap lets one through per step
    # (the first of a step is always allowed).
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16, interval=1,
                       max_kv_per_iteration=5000)
    a, b = _prefilled(planner, "a", 1000), _prefilled(planner, "b", 1000)
    planner.begin_step()
    planner.compress_due([a, b])
    assert list(planner.take_orders()) == ["a"]
    planner.adopt(_settle(planner, ["a"]))
    planner.begin_step()
    planner.compress_due([a, b])
    assert list(planner.take_orders()) == ["b"]  # never compressed before a's second turn
    planner.adopt(_settle(planner, ["b"]))
    planner.begin_step()
    planner.compress_due([b, a])
    assert list(planner.take_orders()) == []  # both at budget: nothing more to free
    assert planner.stats.compressions == 2 and planner.stats.mismatches == 0


def _settle(planner: CompressionPlanner, compressed: list[str]) -> WorkerReport:
    """The worker's report after it evicted exactly the ordered pages: every head of a
    compressed request shrinks by whole pages, spread evenly."""
    shrink = {}
    for request_id, order in planner.step.orders.items():
        if request_id not in compressed:
            continue
        lens = planner.accounting.head_lens_of(request_id).copy()
        pages = -(-lens // BLOCK)
        for index in range(order.evict_pages):
            pages.flat[index % pages.size] -= 1
        shrink[request_id] = np.minimum(lens, pages * BLOCK)
    return _worker_report(planner, shrink)


def test_adopt_takes_worker_lengths_and_flags_any_disagreement():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    request = _prefilled(planner, "a", 1000)
    planner.begin_step()
    planner.compress_due([request])
    report = _settle(planner, ["a"])
    assert planner.adopt(report) is True
    assert not planner.accounting.is_pending("a")
    assert np.array_equal(planner.accounting.head_lens_of("a"), report.head_lens["a"])
    planner.accounting.check_consistent()
    wrong = WorkerReport(report.free_pages - 1, dict(report.pages_held), {})
    assert planner.adopt(wrong) is False
    assert planner.stats.mismatches == 1 and planner.stats.steps_checked == 2


def test_per_request_pages_are_asked_on_compressing_steps_and_on_the_interval():
    """The worker reports every request's pages when the scheduler asks (steps that
    compress, and every PAGES_HELD_CHECK_INTERVAL steps); free pages every step. A
    report without per-request pages is checked on free pages alone; one with them
    on both (a swap of pages between two requests is caught only there)."""
    from kvcompress.compression_planner import PAGES_HELD_CHECK_INTERVAL

    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    requests = [_prefilled(planner, name, 100) for name in "ab"]
    asked = []
    for _ in range(2 * PAGES_HELD_CHECK_INTERVAL):
        planner.begin_step()
        asked.append(planner.report_pages_held())
    assert sum(asked) == 2 and asked[PAGES_HELD_CHECK_INTERVAL - 1] and asked[-1]
    full = _worker_report(planner, {})
    swapped = dict(full.pages_held, a=full.pages_held["a"] + 1, b=full.pages_held["b"] - 1)
    assert planner.adopt(WorkerReport(full.free_pages, None, {})) is True
    assert planner.adopt(WorkerReport(full.free_pages - 1, None, {})) is False
    assert planner.adopt(WorkerReport(full.free_pages, swapped, {})) is False
    assert planner.stats.mismatches == 2
    planner.begin_step()
    planner.compress_due(requests)  # a compressing step asks for them
    assert planner.step.orders and planner.report_pages_held()


def test_relieve_compresses_requests_not_yet_scheduled_until_enough_pages():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    requests = [_prefilled(planner, name, 1000) for name in "abc"]
    planner.begin_step()
    one = _expected_evict(1000, 4, 8, 16)
    planner.relieve(requests[2], [requests[0], requests[1]], pages_short=one + 1)
    orders = planner.take_orders()
    # the first candidate frees `one` pages, not enough: the second follows; the third
    # (the request asking) is never needed
    assert list(orders) == ["a", "b"]
    assert planner.stats.compressions_instead_of_preemption == 2


def test_running_requests_are_recompressed_only_while_a_request_waits_for_pages():
    # No interval: a (prefilled at step 1) and b (at step 40) are compressed after their
    # prefill only, until a waiting request is refused pages (from step 70 on): then the
    # running ones are recompressed as with an interval of PRESSURE_INTERVAL (64) steps,
    # those at least half of it past their last compression joining one that is due
    # (oracle: make_room's docstring and the interval rule of compress_due).
    from kvcompress.compression_planner import PRESSURE_INTERVAL

    assert PRESSURE_INTERVAL == 64
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    requests: list[Req] = []
    compressed_at: dict[str, list[int]] = {}
    for step in range(1, 121):
        if step in (1, 40):
            requests.append(_prefilled(planner, "a" if step == 1 else "b", 1000))
        for request in requests:
            if planner.requests.get(request.request_id) is not None:  # past its first step
                request.output_tokens += 1
                request.num_computed_tokens += 1
                planner.accounting.grow(request.request_id, request.num_computed_tokens + 64)
        planner.begin_step()
        planner.compress_due(requests)
        if step >= 70:  # vLLM refused a waiting request pages in the step before
            planner.note_admission_short(5)
        planner.make_room(requests)
        for request_id in planner.step.orders:
            compressed_at.setdefault(request_id, []).append(step)
        planner.adopt(_settle(planner, list(planner.step.orders)))
    # a is 64 steps past its compression at step 65 but nothing waits until 70; b is 30
    # past its own then (< 32: it does not join); at 104 b falls due and a (34) joins.
    assert compressed_at == {"a": [1, 70, 104], "b": [40, 104]}
    assert planner.stats.compressions_to_admit == 3
    assert planner.stats.compressions_after_prefill == 2
    assert planner.admission_short == 0  # acted on, not carried over


def test_preemption_voids_the_order_and_recompression_is_counted():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    request = _prefilled(planner, "a", 1000)
    planner.begin_step()
    planner.compress_due([request])
    planner.adopt(_settle(planner, ["a"]))
    planner.begin_step()
    planner.on_preempted("a")
    planner.accounting.release("a")
    assert planner.take_orders() == {}
    assert planner.stats.preempted_after_compression == 1
    assert planner.stats.num_preemptions == 1
    request = _prefilled(planner, "a", 1000)  # recomputed prefill
    planner.begin_step()
    planner.compress_due([request])
    assert list(planner.take_orders()) == ["a"]
    assert planner.stats.recompressed_after_preemption == 1
    planner.on_finished("a")
    assert "a" not in planner.requests


def test_interval_recompresses_after_n_steps_only():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16, interval=3)
    request = _prefilled(planner, "a", 1000)
    planner.begin_step()
    planner.compress_due([request])
    planner.adopt(_settle(planner, ["a"]))
    ordered_at = []
    for step in range(2, 9):
        request.output_tokens += 1
        request.num_computed_tokens += 1
        planner.accounting.grow("a", request.num_computed_tokens + 64)  # grows past budget
        planner.begin_step()
        planner.compress_due([request])
        if planner.take_orders():
            ordered_at.append(step)
            planner.adopt(_settle(planner, ["a"]))
    assert ordered_at == [4, 7]
    assert planner.stats.compressions_on_interval == 2


def test_interval_compressions_of_a_staggered_batch_fall_into_step():
    # Six requests prefilled one step apart: the first falling due on the interval takes
    # along every request at least half an interval past its last compression, so the
    # batch is recompressed in one call per interval instead of six, and no request
    # waits longer than the interval (oracle: the rule in compress_due's comment).
    interval = 8
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16, interval=interval)
    requests: list[Req] = []
    compressed_at: dict[str, list[int]] = {}
    for step in range(1, 41):
        if step <= 6:
            requests.append(_prefilled(planner, f"r{step}", 1000))
        for request in requests[:-1] if step <= 6 else requests:
            request.output_tokens += 1
            request.num_computed_tokens += 1
            planner.accounting.grow(request.request_id, request.num_computed_tokens + 64)
        planner.begin_step()
        planner.compress_due(requests)
        for request in requests:  # the planner numbers its steps from 1, as this loop
            if planner.requests[request.request_id].last_compressed_step == step:
                compressed_at.setdefault(request.request_id, []).append(step)
        planner.adopt(_settle(planner, list(planner.step.orders)))
    for request_id, steps in compressed_at.items():
        assert steps[0] == int(request_id[1:])  # after its prefill, in its own step
        gaps = np.diff(steps)
        assert gaps.max() <= interval and gaps.min() >= interval // 2, (request_id, steps)
    on_interval_steps = sorted({s for steps in compressed_at.values() for s in steps[1:]})
    # r1 falls due at 9 and takes r2..r5 (4..7 steps since theirs), r6 follows at 14
    # and takes the others (5 past): from then on all six compress together.
    assert on_interval_steps == [9, 14, 22, 30, 38]
    assert [compressed_at[f"r{i}"][-3:] for i in range(1, 7)] == [[22, 30, 38]] * 6


def _dispatch(planner: CompressionPlanner, requests: list[Req]) -> dict:
    planner.begin_step()
    planner.compress_due(requests)
    return planner.take_orders()


def test_requests_released_while_the_step_runs_are_not_a_mismatch():
    # vLLM aborts requests between the model step and update_from_output: the
    # scheduler has released their pages, the worker's report still counts them.
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    a, b, c = (_prefilled(planner, name, 600) for name in "abc")
    orders = _dispatch(planner, [a, b, c])
    assert set(orders) == {"a", "b", "c"}
    report = _settle(planner, ["a", "b", "c"])  # the worker compressed all three
    for request_id in ("b", "c"):  # then two were aborted, before the report came
        planner.on_released(request_id, planner.accounting.release(request_id))
    assert planner.adopt(report) is True
    assert planner.stats.mismatches == 0 and planner.stats.released_in_flight == 2
    planner.accounting.check_consistent()
    # next step: the worker dropped them too (finished_req_ids); nothing is left over
    _dispatch(planner, [a])
    held = {"a": planner.accounting.pages_held("a")}
    assert planner.adopt(WorkerReport(planner.accounting.num_free_pages, held, {})) is True


def test_release_before_dispatch_is_not_expected_in_the_report():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    a, b = _prefilled(planner, "a", 600), _prefilled(planner, "b", 600)
    planner.begin_step()  # b finishes during schedule(): the worker is told at once
    planner.on_released("b", planner.accounting.release("b"))
    planner.compress_due([a])
    planner.take_orders()
    assert planner.adopt(_settle(planner, ["a"])) is True
    assert planner.stats.released_in_flight == 0


def test_a_real_disagreement_is_still_reported_with_requests_in_flight():
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    a, b = _prefilled(planner, "a", 600), _prefilled(planner, "b", 600)
    _dispatch(planner, [a, b])
    report = _settle(planner, ["a", "b"])
    planner.on_released("b", planner.accounting.release("b"))
    report.pages_held["b"] += 1  # the worker holds a page nobody accounts for
    assert planner.adopt(report) is False
    assert planner.stats.mismatches == 1


def test_batch_peaks_match_a_brute_force_count():
    """``note_batch`` skips its count when it cannot raise the decoding peak; the
    peaks still equal a count of every batch."""
    rng = np.random.default_rng(5)
    planner = _planner()
    want_running = want_decoding = 0
    for _ in range(300):
        batch = [
            Req(f"r{i}", 10, num_computed_tokens=int(rng.integers(0, 12)))
            for i in range(int(rng.integers(0, 40)))
        ]
        planner.note_batch(batch)
        want_running = max(want_running, len(batch))
        want_decoding = max(want_decoding, sum(r.num_computed_tokens >= 10 for r in batch))
        assert (planner.stats.max_running, planner.stats.max_decoding) == (want_running, want_decoding)


def test_a_request_with_prefix_cache_blocks_released_in_flight_is_counted_past_them():
    """A request whose first 2 token blocks are prefix-cache page groups, compressed and
    then aborted while the step ran: the worker counts its pages past its shared
    blocks, and so must the expectation built from its reported head lengths."""
    planner = _planner(rate=4, protected_window=8, min_cache_tokens=16)
    a = _prefilled(planner, "a", 600)
    accounting = planner.accounting
    accounting.cache_groups(2)
    accounting.share_blocks("a", 2)
    planner.share_prefix(a, 2 * BLOCK)
    orders = _dispatch(planner, [a])
    assert orders["a"].compression.budget.protected_prefix == 2 * BLOCK
    lens = accounting.head_lens_of("a").copy()
    pages = -(-lens // BLOCK)
    for index in range(orders["a"].evict_pages):
        pages.flat[index % pages.size] -= 1
    shrunk = np.minimum(lens, pages * BLOCK)
    assert (shrunk >= 2 * BLOCK).all()  # the shared prefix stayed whole
    private = int(np.maximum(-(-shrunk // BLOCK) - 2, 0).sum())
    groups = 2 * LAYERS * HEADS
    report = WorkerReport(accounting.num_pages - private - groups, {"a": private}, {"a": shrunk})
    planner.on_released("a", accounting.release_by_rank("a"), shared_blocks=2)
    assert planner.adopt(report) is True
    assert planner.stats.mismatches == 0


def test_only_compressible_layers_count_toward_the_order_and_are_credited():
    """Sliding-window layers (issue 60) keep every KV: with 3 layers of which only layer 1
    compresses, the order is the budget rule over layer 1's heads alone (what a 1-layer
    model would be ordered), and with no compressible layer there is no order."""
    prompt, rate, window, min_cache = 1000, 4, 8, 16
    orders = {}
    for name, layers, compressible in (("three", 3, (1,)), ("one", 1, None), ("none", 3, ())):
        config = KVCompressConfig(enabled=True, rate=rate, protected_window=window, min_cache_tokens=min_cache)
        accounting = PageAccounting(4096, layers, HEADS, BLOCK, max_requests=8, compressible_layers=compressible)
        planner = CompressionPlanner(config, accounting)
        request = _prefilled(planner, "a", prompt)
        free_before = accounting.num_free_pages
        planner.begin_step()
        planner.compress_due([request])
        taken = planner.take_orders()
        orders[name] = taken["a"].evict_pages if "a" in taken else 0
        assert accounting.num_free_pages == free_before + orders[name]
    keep = max(min_cache, math.ceil(prompt / rate)) + window
    one_layer = HEADS * math.ceil(prompt / BLOCK) - math.ceil(keep * HEADS / BLOCK)
    assert orders == {"three": one_layer, "one": one_layer, "none": 0} and one_layer > 0
