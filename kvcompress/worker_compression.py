"""The worker's half of a compression step, vLLM-free: run the scheduler's orders on the
pool and count what they freed (the scheduler's half is ``compression_planner.py``).

The orders of one step are grouped by policy; each group is one batched
``compress_sequences`` (block-eviction schedule over the metrics, MoveCache, trailing pages
freed). Pending decode metric queries of those sequences are scored first (``flush``), a
test recorder may read the inputs (``record``), and the pages freed are checked against the
pages the scheduler ordered and already credited (``CompressionOutcome.mismatch``): the
report of the step then corrects the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcompress.contract import CompressionOrder, CompressionRecord, WorkerReport
from kvcompress.ops import compress_sequences
from kvcompress.worker_requests import WorkerRequests


@dataclass
class WorkerStats:
    """Worker-side counters (``kvc_pages_used``: tests, benchmarks)."""

    max_pages_used: int = 0
    compressions: int = 0
    pages_freed: int = 0
    kvs_evicted: int = 0
    compress_seconds: float = 0.0
    step_seconds: float = 0.0
    # compressions whose freed pages differ from the pages the scheduler ordered
    evict_mismatches: int = 0
    # pages sliding-window heads gave back behind their windows (scheduler-ordered)
    window_pages_freed: int = 0
    # steps whose attention read the fixed-address DecodeBuffers
    decode_only_steps: int = 0
    pages_freed_by_policy: dict[str, int] = field(default_factory=dict)
    # policy -> [layers]: unprotected KVs kept after its compressions.
    kept_unprotected_by_layer: dict[str, list[int]] = field(default_factory=dict)

    def add_policy_result(self, policy: str, pages_freed: int, kept_by_layer: list[int]) -> None:
        by_policy = self.pages_freed_by_policy
        by_policy[policy] = by_policy.get(policy, 0) + pages_freed
        previous = self.kept_unprotected_by_layer.get(policy, [0] * len(kept_by_layer))
        self.kept_unprotected_by_layer[policy] = [a + b for a, b in zip(previous, kept_by_layer)]


@dataclass(frozen=True)
class CompressionOutcome:
    """What one step's orders did: the requests compressed, one record per batched
    compression (the report's), pages freed against pages the scheduler ordered."""

    request_ids: list[str]
    records: list[CompressionRecord]
    pages_freed: int
    pages_ordered: int

    @property
    def mismatch(self) -> bool:
        return self.pages_freed != self.pages_ordered


NO_COMPRESSION = CompressionOutcome([], [], 0, 0)


@dataclass(frozen=True)
class CompressionRun:
    """What running orders needs besides them: the page cache and pool views, the
    kernels, this worker's TP rank (orders are per rank), the schedule's block cost, the
    random policy's generator, and two callbacks: ``flush(slots)`` scores pending decode
    metric queries of those sequence slots, ``record(request_ids, orders)`` (optional)
    reads a group's inputs before it is compressed; ``layers``: the layers compressions
    may shrink (None: all; sliding-window layers are left out)."""

    cache: object
    pool: object
    ops: object
    rank: int
    block_cost: str
    generator: Callable[[], torch.Generator]
    flush: Callable[[list[int]], None]
    record: Callable[[list[str], dict[str, CompressionOrder]], None] | None = None
    layers: torch.Tensor | None = None


def run_orders(run: CompressionRun, orders: dict[str, CompressionOrder], slots: dict[str, int],
               stats: WorkerStats) -> CompressionOutcome:
    """Compress the ordered requests that hold a sequence slot (``slots``: request id ->
    slot); counts go to ``stats``."""
    request_ids = [r for r in orders if r in slots]
    if not request_ids:
        return NO_COMPRESSION
    started = time.perf_counter()
    ordered = sum(orders[r].evict_pages_on(run.rank) for r in request_ids)
    run.flush([slots[r] for r in request_ids])
    by_policy: dict[str, list[str]] = {}
    for request_id in request_ids:
        by_policy.setdefault(orders[request_id].compression.policy.name, []).append(request_id)
    records = [_compress_group(run, group, orders, slots, stats) for group in by_policy.values()]
    freed = sum(record.pages_freed for record in records)
    stats.compressions += len(request_ids)
    stats.pages_freed += freed
    stats.kvs_evicted += sum(record.kvs_evicted for record in records)
    if freed != ordered:
        stats.evict_mismatches += 1
    stats.compress_seconds += time.perf_counter() - started
    return CompressionOutcome(request_ids, records, freed, ordered)


def _compress_group(run: CompressionRun, group: list[str], orders: dict[str, CompressionOrder],
                    slots: dict[str, int], stats: WorkerStats) -> CompressionRecord:
    """One batched compression of requests sharing a policy."""
    policy = orders[group[0]].compression.policy
    if run.record is not None:
        run.record(group, orders)
    started = time.perf_counter()

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=run.cache.device)

    result = compress_sequences(
        run.cache,
        run.pool,
        column([slots[r] for r in group]),
        column([orders[r].evict_pages_on(run.rank) for r in group]),
        column([orders[r].context_len for r in group]),
        column([orders[r].compression.budget.protected_window for r in group]),
        column([orders[r].compression.budget.protected_prefix for r in group]),
        block_cost=run.block_cost,
        policy=policy,
        generator=run.generator(),
        ops=run.ops,
        layers=run.layers,
    )
    seconds = time.perf_counter() - started
    kvs_kept = int(result.new_head_lens.sum().item())
    stats.add_policy_result(policy.name, int(result.pages_freed), result.kept_unprotected_by_layer.tolist())
    return CompressionRecord(
        policy=policy.name,
        requests=len(group),
        pages_freed=int(result.pages_freed),
        kvs_before=kvs_kept + int(result.kvs_evicted),
        kvs_evicted=int(result.kvs_evicted),
        seconds=seconds,
    )


def step_report(cache, requests: WorkerRequests, outcome: CompressionOutcome, with_pages_held: bool,
                stats: WorkerStats) -> WorkerReport:
    """Worker-side truth for the scheduler after this step's appends: free pages, the
    step's compressions and the per-head lengths of the requests they compressed, and
    (``with_pages_held``) every live request's pages past its prefix-cache page groups.
    Updates ``stats.max_pages_used``."""
    live = requests.live_slots
    held = None
    if with_pages_held and live:
        slots = list(live.values())
        pages = np.asarray(cache.pages_held_per_sequence(slots), np.int64)
        # Pages of prefix-cache groups are the cache's, not the request's.
        pages -= requests.shared_pages[slots] * cache.num_layers * cache.num_kv_heads
        held = dict(zip(live, pages.tolist()))
    elif with_pages_held:
        held = {}
    report = WorkerReport(
        free_pages=cache.counted_free_pages(),
        pages_held=held,
        compressions=list(outcome.records),
        evict_mismatches=int(outcome.mismatch),
    )
    if live:
        for request_id in outcome.request_ids:
            if request_id in live:
                report.head_lens[request_id] = cache.head_lens[live[request_id]].cpu().numpy().copy()
    stats.max_pages_used = max(stats.max_pages_used, cache.allocator.num_used)
    return report
