"""kvcompress's figures for vLLM's stat loggers (no vLLM import).

The scheduler (engine-core process) counts, the front end (API-server process)
publishes: ``CompressionPlanner`` fills one :class:`KVCompressStats` between two of
vLLM's ``SchedulerStats`` (``Scheduler.make_stats()``, once per engine step while vLLM
logs stats), the scheduler hands it over with them and starts a new one
(``kvcompress.vllm_glue.metrics`` declares the field on vLLM's type and publishes it
on ``/metrics``).

Counts are deltas since the previous :class:`KVCompressStats`, as vLLM sends its own
prefix-cache counts: vLLM hands each ``SchedulerStats`` to one front end only, so with
several API-server processes every front end adds what it received and Prometheus'
multiprocess collector sums them. Gauges are the values at the end of the step, except
that the KV gauges may lag decode growth (and nothing else) by up to 0.25 s
(``compression_planner.KV_GAUGES_MAX_AGE_S``).

Plain dataclasses of ints, floats, strings and dicts: msgspec carries them between the
processes as vLLM carries its own stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcompress.contract import CompressionRecord

COMPRESSION_REASONS = ("after_prefill", "instead_of_preemption", "on_interval", "to_admit")
"""Why the scheduler ordered a compression (``CompressionPlanner.try_compress``)."""


@dataclass
class PolicyTotals:
    """What the worker reported for the compressions of one policy.

    Attributes:
        compressions: requests compressed.
        pages_freed: pages they gave back to the free-page stack.
        kvs_before: KVs (over layers and KV heads) they held just before.
        kvs_evicted: KVs evicted from them.
        seconds: wall time of the batched compressions (schedule, MoveCache, frees).
    """

    compressions: int = 0
    pages_freed: int = 0
    kvs_before: int = 0
    kvs_evicted: int = 0
    seconds: float = 0.0

    def add(self, record: CompressionRecord) -> None:
        self.compressions += record.requests
        self.pages_freed += record.pages_freed
        self.kvs_before += record.kvs_before
        self.kvs_evicted += record.kvs_evicted
        self.seconds += record.seconds


@dataclass
class KVCompressStats:
    """One engine's kvcompress figures between two of vLLM's ``SchedulerStats``.

    Gauges (at the end of the step, scheduler's page accounting; ``kvs_*`` recounted
    after any admission, compression or release, else at most 0.25 s old):
        pages_total: pages of the per-(layer, KV head) pool (the scratch page not
            counted).
        pages_free: pages no request holds.
        kvs_held: KVs the live requests hold, summed over layers and KV heads.
        kvs_logical: KVs the live requests would hold uncompressed: their tokens x
            layers x KV heads.

    Counts since the previous ``KVCompressStats`` of this engine:
        compressions: reason (``COMPRESSION_REASONS``) -> policy -> compressions the
            scheduler ordered.
        by_policy: policy -> what the worker reported for its compressions.
        compression_seconds: policy -> wall time of each batched compression the
            worker ran (one per policy present in a step's orders).
        preemptions: requests vLLM preempted.
        preemptions_after_compression: of those, requests compressed before (their
            compression did not save them; they are compressed again after their
            recomputed prefill).
        window_pages_freed: pages sliding-window heads gave back behind their windows
            (scheduler-ordered, like vLLM's own sliding-window manager's frees).
        steps_checked: worker reports whose page counts the scheduler cross-checked.
        page_mismatches: of those, reports whose free / held pages differ from the
            scheduler's counts (a bug if not 0).
        evict_mismatches: worker steps whose freed pages differ from the pages the
            scheduler ordered evicted (a bug if not 0).
    """

    pages_total: int = 0
    pages_free: int = 0
    kvs_held: int = 0
    kvs_logical: int = 0
    compressions: dict[str, dict[str, int]] = field(default_factory=dict)
    by_policy: dict[str, PolicyTotals] = field(default_factory=dict)
    compression_seconds: dict[str, list[float]] = field(default_factory=dict)
    preemptions: int = 0
    preemptions_after_compression: int = 0
    window_pages_freed: int = 0
    steps_checked: int = 0
    page_mismatches: int = 0
    evict_mismatches: int = 0

    @property
    def pages_held(self) -> int:
        return self.pages_total - self.pages_free

    @property
    def kvs_kept_ratio(self) -> float:
        """KVs the live requests hold / KVs they would hold uncompressed; 1 with no
        live request."""
        return self.kvs_held / self.kvs_logical if self.kvs_logical else 1.0

    def count_order(self, reason: str, policy: str) -> None:
        by_policy = self.compressions.setdefault(reason, {})
        by_policy[policy] = by_policy.get(policy, 0) + 1

    def count_record(self, record: CompressionRecord) -> None:
        self.by_policy.setdefault(record.policy, PolicyTotals()).add(record)
        self.compression_seconds.setdefault(record.policy, []).append(record.seconds)
