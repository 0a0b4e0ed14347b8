"""Which requests to compress, when, and by how many pages (no vLLM).

The scheduler (``kvcompress.vllm_glue.scheduler``) is a thin adapter that calls this
planner from vLLM's hooks. The planner owns the scheduler-side page counts
(``PageAccounting``) and one :class:`PlannedRequest` per request.

Compression is ordered (and executed by the worker at the start of the step):

- after a request's prefill completes (it is then "due"), and every
  ``--kv-compress-interval`` steps if set (:meth:`CompressionPlanner.compress_due`;
  requests at least half an interval past their last compression join one falling
  due, so the running batch is compressed in few batched calls);
- when a running request cannot grow: running requests not yet scheduled this
  step (the ones vLLM would preempt) are compressed first
  (:meth:`CompressionPlanner.relieve`); only if that frees too little does vLLM's own
  preemption run, which frees every page of the victim. A preempted request is
  compressed again once its recomputed prefill completes;
- while a waiting request cannot be admitted for want of pages: running requests are
  recompressed as with an interval of ``PRESSURE_INTERVAL`` steps
  (:meth:`CompressionPlanner.make_room`), so the batch refills while its requests run
  instead of only as they finish.

Each step at most ``--kv-compress-max-kv-per-iteration`` KVs are sorted; never-
compressed requests go first, then the least recently compressed. The pages a
compression frees are known exactly from head lengths (``budget.blocks_to_evict``)
and credited at once; the per-head lengths arrive with the worker's report.

Requests are duck-typed like vLLM's ``Request``: ``request_id``,
``num_computed_tokens``, ``num_prompt_tokens``, ``num_tokens`` and
``sampling_params`` (with ``extra_args``, or None).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import numpy as np

from kvcompress.budget import RequestBudget, RequestFieldError, blocks_to_evict, request_budget
from kvcompress.config import KVCompressConfig
from kvcompress.contract import CompressionOrder, RequestCompression, WorkerReport
from kvcompress.engine_stats import KVCompressStats, PolicyTotals
from kvcompress.page_accounting import PageAccounting, row_pages_for
from kvcompress.policies import POLICY_NAMES, Policy

logger = logging.getLogger(f"vllm.{__name__}")


class PlannableRequest(Protocol):
    """The parts of vLLM's ``Request`` the planner reads."""

    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def sampling_params(self): ...


@dataclass
class PlannedRequest:
    """Scheduler-side compression state of one request.

    Attributes:
        compression: its budget and policy, resolved once.
        last_compressed_step: the step of its last compression (None: not since its
            last (re)computed prefill).
        recompress_due: preempted after a compression: compressing it again after
            its recomputed prefill counts as a re-compression.
    """

    compression: RequestCompression
    last_compressed_step: int | None = None
    recompress_due: bool = False


@dataclass
class PlannerStats:
    """Counters for tests, logs and benchmarks (``kvc_page_stats``)."""

    steps_checked: int = 0
    mismatches: int = 0
    compressions: int = 0
    compressions_after_prefill: int = 0
    compressions_instead_of_preemption: int = 0
    compressions_on_interval: int = 0
    compressions_to_admit: int = 0
    pages_freed: int = 0
    max_running: int = 0
    max_decoding: int = 0
    preempted_after_compression: int = 0
    recompressed_after_preemption: int = 0
    num_preemptions: int = 0
    # pages sliding-window heads gave back behind their windows (drop_behind_windows)
    window_pages_freed: int = 0
    # requests released (aborted) while the worker ran the step: its report still
    # counts their pages, the cross-check accounts for them
    released_in_flight: int = 0
    # policy -> compressions ordered (all reasons)
    compressions_by_policy: dict[str, int] = field(default_factory=dict)
    # policy -> what the worker reported having done (WorkerReport.compressions)
    reported: dict[str, PolicyTotals] = field(default_factory=dict)
    # worker steps that freed other than the ordered pages (WorkerReport.evict_mismatches)
    evict_mismatches: int = 0


# While requests wait for pages, running requests are recompressed at least this often
# (steps; CompressionPlanner.make_room). 64 = the CPU page size: a head takes a new page
# about every 64 tokens.
PRESSURE_INTERVAL = 64

# Steps between per-request page checks of the worker's report (see report_pages_held).
PAGES_HELD_CHECK_INTERVAL = 16

# Seconds the KV gauges of take_metrics may lag decode growth (nothing else): summing
# the head lengths costs ~45 us a step (tiny model, batch 2: 2% of its decode step).
KV_GAUGES_MAX_AGE_S = 0.25


@dataclass
class _Step:
    """What the planner decided so far in the current step.

    Attributes:
        number: steps since the engine started.
        orders: compressions ordered this step.
        window_drops: request id -> ``[L]`` pages each head of a sliding-window layer
            drops from its front this step (``StepCompression.window_drops``).
        kvs_sorted: KVs the ordered compressions sort (the per-step cap).
        dispatched: the step went to the worker (vLLM's ``schedule()`` returned).
        released_in_flight: request id -> ``[num_ranks]`` pages the scheduler released
            after the step was dispatched and before the workers' reports were adopted
            (vLLM processes aborts there); the workers still held them when they reported.
        released_shared_blocks: request id -> its prefix-cache blocks (same requests).
    """

    number: int = 0
    orders: dict[str, CompressionOrder] = field(default_factory=dict)
    window_drops: dict[str, np.ndarray] = field(default_factory=dict)
    kvs_sorted: int = 0
    dispatched: bool = False
    released_in_flight: dict[str, np.ndarray] = field(default_factory=dict)
    released_shared_blocks: dict[str, int] = field(default_factory=dict)


class CompressionPlanner:
    """Compression decisions and page counts of the scheduler side."""

    def __init__(self, settings: KVCompressConfig, accounting: PageAccounting) -> None:
        self.settings = settings
        self.accounting = accounting
        self.stats = PlannerStats()
        # Counts since vLLM last took stats (None: vLLM does not log stats).
        self.metrics: KVCompressStats | None = None
        # (accounting.changes, time, kvs_held, kvs_logical) of the last KV gauges.
        self._kv_gauges: tuple[int, float, int, int] = (-1, 0.0, 0, 0)
        self.requests: dict[str, PlannedRequest] = {}
        # Compressing requests not compressed since their (re)computed prefill: with no
        # compression interval, the only ones compress_due looks at.
        self.due: set[str] = set()
        self.step = _Step()
        # Pages a waiting request lacked when vLLM last refused to admit it (0: none;
        # make_room acts on it at the next step's start), and the first step at which
        # make_room may find a running request due.
        self.admission_short = 0
        self.pressure_check_step = 0
        # Resolved once: the server's policy settings are fixed for the engine's life.
        self._policies = {name: settings.policy_for(name) for name in POLICY_NAMES}

    # ------------------------------------------------------------------ requests

    def resolve(self, extra_args: dict | None) -> RequestCompression:
        """The request's budget and policy from the server settings and its fields.

        Raises ``RequestFieldError`` naming an invalid field.
        """
        budget = request_budget(self.settings, extra_args)
        policy: Policy = self._policies[budget.policy]
        if budget.observation_window is not None:
            policy = dataclasses.replace(
                policy,
                metric=dataclasses.replace(policy.metric, observation_window=budget.observation_window),
            )
        return RequestCompression(budget=budget, policy=policy)

    def state(self, request: PlannableRequest) -> PlannedRequest:
        """The request's state, created (and its compression resolved) on first use."""
        planned = self.requests.get(request.request_id)
        if planned is None:
            extra_args = getattr(request.sampling_params, "extra_args", None)
            try:
                compression = self.resolve(extra_args)
            except RequestFieldError as error:
                # The front end rejects these with HTTP 400; a direct engine-core
                # client may not: keep serving with the server's settings.
                logger.warning("kvcompress: request %s: %s; using server settings",
                               request.request_id, error)
                compression = self.resolve(None)
            planned = self.requests[request.request_id] = PlannedRequest(compression)
            if compression.budget.compresses:
                self.due.add(request.request_id)
        return planned

    def budget(self, request: PlannableRequest) -> RequestBudget:
        return self.state(request).compression.budget

    def share_prefix(self, request: PlannableRequest, tokens: int) -> None:
        """The request's first ``tokens`` tokens are prefix-cache page groups, kept whole
        by its compressions (set at each admission)."""
        planned = self.state(request)
        budget = planned.compression.budget
        if budget.shared_prefix_tokens != tokens:
            planned.compression = dataclasses.replace(
                planned.compression,
                budget=dataclasses.replace(budget, shared_prefix_tokens=tokens),
            )

    # ------------------------------------------------------------------ decisions

    def begin_step(self) -> None:
        self.step = _Step(number=self.step.number + 1)

    def drop_behind_windows(self) -> None:
        """Order every sliding-window head's pages behind its window given back this
        step (``PageAccounting.drop_behind_windows``, credited at once): call as the step
        begins, before vLLM schedules (the pages help admit and grow this step)."""
        drops = self.accounting.drop_behind_windows()
        if not drops:
            return
        self.step.window_drops.update(drops)
        pages = sum(int(d.sum()) for d in drops.values()) * self.accounting.num_kv_heads
        self.stats.window_pages_freed += pages
        if self.metrics is not None:
            self.metrics.window_pages_freed += pages

    def compressible(self, request: PlannableRequest) -> bool:
        # Caught up: the prompt (or, after a preemption, the recomputed prompt and
        # outputs) is in the cache; only the last sampled token is not.
        # (the budget first: most requests at rate 1 stop there, every step)
        accounting = self.accounting
        return (
            self.budget(request).compresses
            and request.num_computed_tokens >= max(request.num_prompt_tokens, request.num_tokens - 1)
            and accounting.logical_len(request.request_id) > 0
            and not accounting.is_pending(request.request_id)
        )

    def candidates(self, requests: Iterable[PlannableRequest]) -> list[PlannableRequest]:
        """Compressible requests, never compressed first, then least recently."""
        ready = [r for r in requests if self.compressible(r)]

        def last(request):
            step = self.requests[request.request_id].last_compressed_step
            return -1 if step is None else step

        return sorted(ready, key=last)

    def try_compress(self, request: PlannableRequest, reason: str) -> int:
        """Order a compression of ``request`` this step if it frees pages; returns the
        pages freed on the rank that gains the fewest (with one rank: the pages freed).

        ``reason``: ``after_prefill``, ``instead_of_preemption``, ``on_interval`` or
        ``to_admit``.
        """
        accounting = self.accounting
        request_id = request.request_id
        # Only the compressible layers are sorted and shrunk (sliding-window layers keep every KV).
        head_lens = accounting.head_lens_of(request_id)[accounting.compressible_layers]
        kvs = int(head_lens.sum())
        step = self.step
        if step.kvs_sorted and step.kvs_sorted + kvs > self.settings.max_kv_per_iteration:
            return 0
        planned = self.state(request)
        context_len = accounting.logical_len(request_id)
        evict_by_rank = self._evict_by_rank(head_lens, context_len, planned)
        evict = sum(evict_by_rank)
        planned.last_compressed_step = step.number
        self.due.discard(request_id)
        if planned.recompress_due:
            planned.recompress_due = False
            self.stats.recompressed_after_preemption += 1
        if evict <= 0:
            return 0
        step.kvs_sorted += kvs
        accounting.mark_compressed(request_id, evict_by_rank)
        step.orders[request_id] = CompressionOrder(
            evict_pages_by_rank=evict_by_rank, context_len=context_len,
            compression=planned.compression,
        )
        stats = self.stats
        stats.compressions += 1
        setattr(stats, f"compressions_{reason}", getattr(stats, f"compressions_{reason}") + 1)
        stats.pages_freed += evict
        policy = planned.compression.policy.name
        stats.compressions_by_policy[policy] = stats.compressions_by_policy.get(policy, 0) + 1
        if self.metrics is not None:
            self.metrics.count_order(reason, policy)
        return min(evict_by_rank)

    def _evict_by_rank(self, head_lens: np.ndarray, context_len: int, planned: PlannedRequest) -> tuple[int, ...]:
        """E_s,r per rank over that rank's heads (``head_lens``: the compressible layers),
        each held to the same per-head budget: every rank frees exactly what is credited to
        its own pool."""
        accounting = self.accounting
        heads = accounting.heads_per_rank
        return tuple(
            blocks_to_evict(
                head_lens[:, rank * heads:(rank + 1) * heads], context_len,
                planned.compression.budget, accounting.block_size,
            )
            for rank in range(accounting.num_ranks)
        )

    def compress_due(self, running: Iterable[PlannableRequest], all_resolved: bool = False) -> None:
        """Order compressions of requests whose prefill completed, and on the interval.

        ``all_resolved``: the caller knows every request of ``running`` was resolved
        (:meth:`state`) already, as the scheduler does at admission; with no interval and
        none due there is then nothing to look at (no scan of the running batch)."""
        interval = self.settings.interval
        if not interval:
            due = self.due
            if all_resolved and not due:
                return
            # Only requests awaiting their first compression (or not yet resolved).
            known = self.requests
            running = [r for r in running if r.request_id in due or r.request_id not in known]
        self._compress_stale(self.candidates(running), interval, "on_interval")

    def _compress_stale(self, candidates: list[PlannableRequest], interval: int, reason: str) -> None:
        """Compress ``candidates`` never compressed since their prefill, and, once one of
        them is ``interval`` steps past its last compression (0: never), every one at
        least half that: one batched compression instead of one per step (each costs
        ~1 ms however few sequences it holds), and the requests stay in step afterwards.
        No request waits longer than the interval."""
        since = [self._steps_since_compressed(r) for r in candidates]
        joins = interval and any(s is not None and s >= interval for s in since)
        for request, steps in zip(candidates, since):
            if steps is None:
                self.try_compress(request, "after_prefill")
            elif joins and steps >= max(1, interval // 2):
                self.try_compress(request, reason)

    def _steps_since_compressed(self, request: PlannableRequest) -> int | None:
        last = self.requests[request.request_id].last_compressed_step
        return None if last is None else self.step.number - last

    def relieve(
        self, request: PlannableRequest, not_yet_scheduled: list[PlannableRequest], pages_short: int
    ) -> None:
        """Compress ``not_yet_scheduled`` running requests (vLLM would preempt them
        next) and ``request`` itself, until ``pages_short`` pages are freed."""
        waiting_turn = list(not_yet_scheduled)
        if request not in waiting_turn:
            waiting_turn.append(request)
        freed = 0
        for candidate in self.candidates(waiting_turn):
            freed += self.try_compress(candidate, "instead_of_preemption")
            if freed >= pages_short:
                break

    def note_admission_short(self, pages_short: int) -> None:
        """vLLM refused to admit a waiting request: ``pages_short`` pages were missing
        (on the rank shortest of them). :meth:`make_room` acts on it at the next step's
        start, before any request grows (the worker compresses before it appends)."""
        if pages_short > self.admission_short:
            self.admission_short = pages_short

    def make_room(self, running: Iterable[PlannableRequest]) -> None:
        """A waiting request was refused pages last step: recompress the running requests
        as ``--kv-compress-interval`` would with an interval of ``PRESSURE_INTERVAL``
        steps (the flag's, if shorter; :meth:`_compress_stale`).

        Compressing a request frees little at once (a compressed head ends on a page
        boundary, so its next token takes a page per head again); what it saves is its
        growth afterwards, ~1/rate of a page per page of tokens instead of a page. So a
        batch that is recompressed while requests wait for memory admits them while it
        runs, instead of only as its requests finish (or are preempted)."""
        short, self.admission_short = self.admission_short, 0
        step = self.step.number
        if short <= 0 or step < self.pressure_check_step:
            return
        interval = min(self.settings.interval or PRESSURE_INTERVAL, PRESSURE_INTERVAL)
        candidates = self.candidates(running)
        self._compress_stale(candidates, interval, "to_admit")
        # None falls due before the least recently compressed is an interval past its
        # compression (requests compressed later, or admitted later, come after it).
        lasts = [self.requests[r.request_id].last_compressed_step for r in candidates]
        self.pressure_check_step = min((s for s in lasts if s is not None), default=step) + interval

    def take_orders(self) -> dict[str, CompressionOrder]:
        """This step's orders, as the step goes to the worker; those of requests
        preempted since they were ordered are void (their pages are gone)."""
        self.step.dispatched = True
        return {
            request_id: order
            for request_id, order in self.step.orders.items()
            if self.accounting.is_pending(request_id)
        }

    def take_window_drops(self) -> dict[str, np.ndarray]:
        """This step's window drops (:meth:`drop_behind_windows`) of the requests still
        holding pages (a preempted one gave back all of them)."""
        held = self.accounting.holds
        return {r: d for r, d in self.step.window_drops.items() if held(r)}

    # ------------------------------------------------------------------ lifecycle

    def on_preempted(self, request_id: str) -> None:
        """Recomputed from scratch: due for compression again after its new prefill."""
        self.stats.num_preemptions += 1
        metrics = self.metrics
        if metrics is not None:
            metrics.preemptions += 1
        planned = self.requests.get(request_id)
        if planned is not None and planned.last_compressed_step is not None:
            planned.last_compressed_step = None
            planned.recompress_due = True
            if planned.compression.budget.compresses:
                self.due.add(request_id)
            self.stats.preempted_after_compression += 1
            if metrics is not None:
                metrics.preemptions_after_compression += 1
        self.step.orders.pop(request_id, None)

    def on_finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.due.discard(request_id)

    def on_released(self, request_id: str, pages, shared_blocks: int = 0) -> None:
        """The scheduler gave back the ``pages`` of ``request_id`` (finished, aborted
        or preempted): an int with one rank, else ``[num_ranks]`` per rank's pool; its
        first ``shared_blocks`` token blocks were prefix-cache page groups (not in
        ``pages``). Between dispatch and the report, the workers still hold them."""
        by_rank = np.asarray(pages, np.int64).reshape(-1)
        # Nothing held: it never ran (a request whose pages are all shared did).
        if self.step.dispatched and (by_rank.any() or shared_blocks):
            self.step.released_in_flight[request_id] = by_rank
            self.step.released_shared_blocks[request_id] = shared_blocks
            self.stats.released_in_flight += 1

    def note_batch(self, running: Sequence[PlannableRequest]) -> None:
        """Peaks of the running batch and of its rows past their prompt (decoding)."""
        stats = self.stats
        stats.max_running = max(stats.max_running, len(running))
        if len(running) > stats.max_decoding:  # else the count cannot raise the peak
            decoding = sum(1 for r in running if r.num_computed_tokens >= r.num_prompt_tokens)
            stats.max_decoding = max(stats.max_decoding, decoding)

    def reset_peaks(self) -> None:
        self.stats.max_running = 0
        self.stats.max_decoding = 0

    # ------------------------------------------------------------------ worker report

    def adopt(self, report: WorkerReport | Sequence[WorkerReport]) -> bool:
        """Take the workers' head lengths of compressed requests and cross-check every
        page count of every rank; returns whether the counts agree.

        ``report``: one worker's, or one per tensor-parallel rank in rank order (each
        with the ``[layers, heads of its rank]`` lengths of its own heads)."""
        reports = [report] if isinstance(report, WorkerReport) else list(report)
        accounting = self.accounting
        if len(reports) != accounting.num_ranks:
            raise ValueError(f"{len(reports)} worker reports for {accounting.num_ranks} ranks")
        if self._adopt_plain_step(reports):
            return True
        for request_id in reports[0].head_lens:
            accounting.adopt(request_id, np.concatenate(
                [np.asarray(r.head_lens[request_id], np.int64) for r in reports], axis=1
            ))
        for request_id in accounting.pending_request_ids():
            logger.error("kvcompress: no head lengths reported for compressed request %s",
                         request_id)
        self.stats.steps_checked += 1
        agree = True
        for rank, rank_report in enumerate(reports):
            held, free = self.expected_worker_pages(rank_report, rank)
            if rank_report.free_pages == free and (
                rank_report.pages_held is None or rank_report.pages_held == held
            ):
                continue
            agree = False
            accounting = self.accounting
            logger.error(
                "kvcompress: worker pages of rank %d (free %d, held %s) differ from the "
                "scheduler's (free %d, held %s; shared blocks %s, pending %s, cached groups %d, "
                "released in flight %s)",
                rank, rank_report.free_pages, rank_report.pages_held, free, held,
                {r: accounting.shared_blocks_of(r) for r in accounting.request_ids()},
                accounting.pending_request_ids(), accounting.cached_groups,
                list(self.step.released_in_flight),
            )
        self._count_reports(reports, agree)
        if not agree:
            self.stats.mismatches += 1
        return agree

    def _adopt_plain_step(self, reports: list[WorkerReport]) -> bool:
        """:meth:`adopt` of most decode steps in a few attribute reads: one rank, nothing
        compressed, reported per request or released while the step ran, and its free
        pages as counted here (False: take the full path, which also logs)."""
        if len(reports) != 1:
            return False
        report = reports[0]
        if (
            report.head_lens or report.compressions or report.evict_mismatches
            or report.pages_held is not None or self.step.released_in_flight
            or report.free_pages != self.accounting.free_pages.item(0) or self.accounting.num_pending
        ):
            return False
        self.stats.steps_checked += 1
        if self.metrics is not None:
            self.metrics.steps_checked += 1
        return True

    def _count_reports(self, reports: list[WorkerReport], agree: bool) -> None:
        stats, metrics = self.stats, self.metrics
        # Every rank compressed the same requests: count them once, pages and KVs of all.
        records = [
            record if rank == 0 else dataclasses.replace(record, requests=0)
            for rank, report in enumerate(reports)
            for record in report.compressions
        ]
        evict_mismatches = sum(report.evict_mismatches for report in reports)
        stats.evict_mismatches += evict_mismatches
        for record in records:
            stats.reported.setdefault(record.policy, PolicyTotals()).add(record)
        if metrics is not None:
            metrics.steps_checked += 1
            metrics.page_mismatches += 0 if agree else 1
            metrics.evict_mismatches += evict_mismatches
            for record in records:
                metrics.count_record(record)

    # ------------------------------------------------------------------ metrics

    def enable_metrics(self) -> None:
        """Count for vLLM's stat loggers from now on (the scheduler calls it when vLLM
        logs stats): :meth:`take_metrics` hands the counts over."""
        self.metrics = KVCompressStats()

    def take_metrics(self, now: float | None = None) -> KVCompressStats | None:
        """The counts since the last call, with the page gauges of now (KV gauges: see
        :meth:`_kv_gauges_at`); counting starts again from zero. None unless
        :meth:`enable_metrics` was called. ``now``: ``time.monotonic()`` (tests pass it)."""
        metrics = self.metrics
        if metrics is None:
            return None
        self.metrics = KVCompressStats()
        accounting = self.accounting
        metrics.pages_total = accounting.total_pages
        metrics.pages_free = accounting.num_free_pages
        metrics.kvs_held, metrics.kvs_logical = self._kv_gauges_at(time.monotonic() if now is None else now)
        return metrics

    def _kv_gauges_at(self, now: float) -> tuple[int, int]:
        """``(kvs_held, kvs_logical)``: recounted after any admission, compression or
        release, else at most ``KV_GAUGES_MAX_AGE_S`` old (decode growth lags by that)."""
        accounting = self.accounting
        changes, taken, held, logical = self._kv_gauges
        if changes != accounting.changes or now - taken >= KV_GAUGES_MAX_AGE_S:
            accounting.sync()
            held = int(accounting.head_lens.sum())  # rows of released requests are zero
            logical = int(accounting.logical_lens.sum()) * accounting.pages_per_token_block
            self._kv_gauges = (accounting.changes, now, held, logical)
        return held, logical

    def report_pages_held(self) -> bool:
        """Whether the worker reports every request's pages this step: on steps that
        compress and every ``PAGES_HELD_CHECK_INTERVAL`` steps (free pages, the sum of
        the same counts, are checked every step; a dict per step costs ~0.15 ms of
        host time at 256 requests)."""
        step = self.step
        return bool(step.orders or step.window_drops) or step.number % PAGES_HELD_CHECK_INTERVAL == 0

    def expected_worker_pages(
        self, report: WorkerReport, rank: int = 0
    ) -> tuple[dict[str, int] | None, int]:
        """``(pages held per request, free pages)`` the worker of ``rank`` must have
        reported: the scheduler's counts of that rank's pool plus the requests released
        while the step ran (the first None when the report holds no per-request
        counts). A request compressed this step and then released is counted from its
        reported head lengths (the scheduler had only an upper bound for its growth)."""
        accounting = self.accounting
        held = None if report.pages_held is None else accounting.pages_held_by_request(rank)
        free = int(accounting.free_pages[rank])
        for request_id, by_rank in self.step.released_in_flight.items():
            pages = int(by_rank[rank])
            lens = report.head_lens.get(request_id)
            if lens is not None:  # pages past its shared blocks, from the reported lengths
                head_pages = (np.asarray(lens, np.int64) + accounting.block_size - 1) // accounting.block_size
                shared = self.step.released_shared_blocks.get(request_id, 0)
                own = int(np.maximum(head_pages - shared, 0).sum())
                # It compressed, so it held the metadata pages of its own pages too.
                pages = own + int(row_pages_for(own, accounting.rows_per_page))
            if held is not None:
                held[request_id] = pages
            free -= pages
        return held, free

    def page_stats(self) -> dict:
        """Scheduler-side page counts per request and the counters."""
        accounting = self.accounting
        accounting.check_consistent()
        return {
            "num_pages": accounting.total_pages,  # over all ranks' pools
            "num_free": accounting.num_free_pages,
            "num_ranks": accounting.num_ranks,
            "free_by_rank": accounting.free_pages.tolist(),
            "block_size": accounting.block_size,
            "num_layers": accounting.num_layers,
            "num_kv_heads": accounting.num_kv_heads,
            "requests": {
                request_id: {
                    "pages_held": accounting.pages_held(request_id),
                    "head_lens": accounting.head_lens_of(request_id).tolist(),
                    "logical_len": accounting.logical_len(request_id),
                }
                for request_id in accounting.request_ids()
            },
            **dataclasses.asdict(self.stats),
        }
