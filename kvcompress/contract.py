"""What the scheduler tells the worker each step, and what the worker answers (no vLLM).

The scheduler (engine-core process) decides; the model runner (worker process) acts.
Per step the scheduler sends one :class:`StepCompression` with vLLM's scheduler output
and the worker returns one :class:`WorkerReport` with its model-runner output
(``kvcompress.vllm_glue.outputs`` declares the vLLM output types that carry them).
Everything is resolved on the scheduler side: the worker never reads request fields
or server settings to decide how a request is compressed.

All are plain picklable dataclasses (they cross a process boundary with the mp
executor).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvcompress.budget import RequestBudget
from kvcompress.policies import Policy


@dataclass(frozen=True)
class RequestCompression:
    """How one request is compressed, resolved once by the scheduler.

    Attributes:
        budget: the server settings overridden by the request's ``kv_compress*`` fields.
        policy: the request's eviction policy with its metric settings resolved (the
            request's ``kv_compress_observation_window`` applied).
    """

    budget: RequestBudget
    policy: Policy

    @property
    def compresses(self) -> bool:
        """Whether this request is ever compressed (its queries score its KVs)."""
        return self.budget.compresses


@dataclass(frozen=True)
class CompressionOrder:
    """Compress one request at the start of this step.

    Attributes:
        evict_pages_by_rank: ``E_s,r``, pages the worker of TP rank r frees from the
            request's heads on that rank (the scheduler already credited them to that
            rank's pool: ``budget.blocks_to_evict`` over the rank's heads); one entry
            without tensor parallelism.
        context_len: ``L_c``, tokens in the request's context (sinks and the
            protected window are counted from it).
        compression: the request's resolved budget and policy.
    """

    evict_pages_by_rank: tuple[int, ...]
    context_len: int
    compression: RequestCompression

    @property
    def evict_pages(self) -> int:
        """``E_s``: pages freed over all ranks."""
        return sum(self.evict_pages_by_rank)

    def evict_pages_on(self, rank: int) -> int:
        """Pages the worker of ``rank`` frees."""
        return self.evict_pages_by_rank[rank]


@dataclass(frozen=True)
class CachedBlocks:
    """vLLM's prefix cache took blocks of a request this step: columns
    ``first_column ..`` of its heads become the page groups of ``block_ids``."""

    request_id: str
    first_column: int
    block_ids: tuple[int, ...]


@dataclass
class PrefixCacheStep:
    """What vLLM's prefix cache did since the last step (prefix caching on).

    Attributes:
        hits: admitted request -> the cached blocks it starts with (vLLM block ids, in
            column order): its first columns point at their page groups.
        cached: blocks the cache took this step, in the order vLLM cached them.
        uncached: blocks whose hashes vLLM evicted since the last step (idle: no
            request holds them): the cache lets go of their page groups. Applied
            before ``cached`` (vLLM may reuse a block id at once).
    """

    hits: dict[str, tuple[int, ...]] = field(default_factory=dict)
    cached: list[CachedBlocks] = field(default_factory=list)
    uncached: list[int] = field(default_factory=list)


@dataclass
class StepCompression:
    """Scheduler -> worker, once per step.

    Attributes:
        admitted: requests whose pages the worker (re)builds this step (first
            scheduled, or resumed after a preemption) -> how they are compressed.
        orders: requests to compress before this step's forward -> their order.
        window_drops: request -> ``[num_layers]`` int64 pages every KV head of each
            layer gives back from its front before this step's forward (its sliding
            window has passed them; 0 on other layers). The scheduler credited them
            already (``PageAccounting.drop_behind_windows``).
        report_pages_held: the worker reports every live request's pages this step
            (``WorkerReport.pages_held``); free pages are reported every step.
        prefix_cache: the prefix cache's changes (None: prefix caching off).
    """

    admitted: dict[str, RequestCompression] = field(default_factory=dict)
    orders: dict[str, CompressionOrder] = field(default_factory=dict)
    window_drops: dict[str, np.ndarray] = field(default_factory=dict)
    report_pages_held: bool = True
    prefix_cache: PrefixCacheStep | None = None


@dataclass
class CompressionRecord:
    """One batched compression the worker ran: the ordered requests of one policy in
    one step (``compress_sequences``).

    Attributes:
        policy: the policy's name.
        requests: requests compressed.
        pages_freed: pages given back to the free-page stack.
        kvs_before: KVs (over layers and KV heads) the requests held just before.
        kvs_evicted: KVs evicted.
        seconds: wall time of the compression (schedule, MoveCache, page frees).
    """

    policy: str
    requests: int
    pages_freed: int
    kvs_before: int
    kvs_evicted: int
    seconds: float


@dataclass
class WorkerReport:
    """Worker -> scheduler, once per step, after the step's pages were allocated.

    Attributes:
        free_pages: pages on the worker's free-page stack.
        pages_held: request id -> pages its heads hold past their prefix-cache page
            groups, for every live request; None on steps whose
            ``StepCompression.report_pages_held`` was False.
        head_lens: request id -> ``[layers, kv_heads]`` int64 KVs per head, for the
            requests compressed this step (the scheduler adopts them).
        compressions: the step's batched compressions, one per policy (metrics).
        evict_mismatches: 1 if the step's compressions freed other than the pages the
            scheduler ordered (logged by the worker; a bug), else 0.
    """

    free_pages: int
    pages_held: dict[str, int] | None = field(default_factory=dict)
    head_lens: dict[str, np.ndarray] = field(default_factory=dict)
    compressions: list[CompressionRecord] = field(default_factory=list)
    evict_mismatches: int = 0
