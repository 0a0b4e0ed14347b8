"""kvcompress's Prometheus metrics on vLLM's ``/metrics``.

The figures are made in the engine-core process (``CompressionPlanner``: its orders, its
page accounting, the worker's ``WorkerReport``) and published by the API-server process.
They take vLLM's own path for scheduler stats:

1. ``KVCompressScheduler.make_stats()`` returns :class:`KVCompressSchedulerStats`, vLLM's
   ``SchedulerStats`` with one declared field more, ``kvcompress``
   (``kvcompress.engine_stats.KVCompressStats``). vLLM puts it in
   ``EngineCoreOutputs.scheduler_stats``; msgspec encodes a dataclass by its own
   fields, so the field travels.
2. The front end decodes ``EngineCoreOutputs`` by the declared field types, which would
   drop it: ``patches/metrics.py`` builds the engine-core client's decoder for
   :class:`KVCompressEngineCoreOutputs` (``scheduler_stats`` typed as the subclass).
3. vLLM's ``StatLoggerManager`` hands each ``SchedulerStats`` to every stat logger;
   ``patches/metrics.py`` adds :class:`KVCompressPrometheusLogger` through ``AsyncLLM``'s
   public ``stat_loggers`` argument, for kvcompress engines with stats on only.

Names and labels follow vLLM's (``vllm:`` -> ``kvcompress:``; ``model_name``,
``engine``). Counters add the deltas each ``SchedulerStats`` carries; gauges are set
with ``multiprocess_mode="mostrecent"`` as vLLM's are, so ``--api-server-count N``
(vLLM's Prometheus multiprocess mode) sums the counters of all API servers.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder

from kvcompress.config import KVCompressConfig, KVCompressConfigError
from kvcompress.engine_stats import COMPRESSION_REASONS, KVCompressStats

COMPRESSION_SECONDS_BUCKETS = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
]


@dataclass
class KVCompressSchedulerStats(SchedulerStats):
    """vLLM's ``SchedulerStats`` + kvcompress's figures of the same step."""

    kvcompress: KVCompressStats | None = None


class KVCompressEngineCoreOutputs(
    EngineCoreOutputs,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    """``EngineCoreOutputs`` as the front end decodes them for a kvcompress engine:
    the same fields in the same order, ``scheduler_stats`` typed as
    :class:`KVCompressSchedulerStats` (plain ``SchedulerStats`` decode with
    ``kvcompress=None``)."""

    scheduler_stats: KVCompressSchedulerStats | None = None


class KVCompressOutputsDecoder(MsgpackDecoder):
    """vLLM's ``MsgpackDecoder``, decoding ``EngineCoreOutputs`` as
    :class:`KVCompressEngineCoreOutputs`."""

    def __init__(self, t=None, *args, **kwargs) -> None:
        super().__init__(KVCompressEngineCoreOutputs if t is EngineCoreOutputs else t, *args, **kwargs)


def with_kvcompress_stats(
    stats: SchedulerStats, figures: KVCompressStats | None
) -> KVCompressSchedulerStats:
    """``stats`` as a :class:`KVCompressSchedulerStats` carrying ``figures`` (its
    attributes shared, not copied: vLLM makes a new ``SchedulerStats`` every step)."""
    combined = KVCompressSchedulerStats.__new__(KVCompressSchedulerStats)
    combined.__dict__.update(stats.__dict__)  # every step: __init__ costs ~6x more
    combined.kvcompress = figures
    return combined


def kvcompress_settings(vllm_config: VllmConfig) -> KVCompressConfig | None:
    """The engine's kvcompress settings; None for an engine without kvcompress."""
    try:
        settings = KVCompressConfig.from_additional_config(vllm_config.additional_config)
    except KVCompressConfigError:
        return None  # the engine setup refuses it; not ours to report
    return settings if settings.enabled else None


# Collectors this module registered in prometheus_client's default registry: a new
# logger (a second AsyncLLM in the process) replaces them, as vLLM's logger does its own.
_REGISTERED: list = []


def _unregister_previous() -> None:
    while _REGISTERED:
        try:
            REGISTRY.unregister(_REGISTERED.pop())
        except KeyError:
            pass


class KVCompressPrometheusLogger(AggregateStatLoggerBase):
    """Publishes each engine's :class:`KVCompressStats` as ``kvcompress:*`` metrics."""

    _BASE_LABELS = ("model_name", "engine")  # vLLM's labels of its own metrics

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        _unregister_previous()
        self.engine_indexes = engine_indexes if engine_indexes is not None else [0]
        self.settings = kvcompress_settings(vllm_config) or KVCompressConfig()
        model_name = vllm_config.model_config.served_model_name
        self.labels = {idx: (model_name, str(idx)) for idx in self.engine_indexes}
        self._declare_pool_metrics()
        self._declare_compression_metrics()
        self._declare_check_counters()
        self._publish_settings()

    def _gauge(self, name: str, documentation: str, extra: tuple[str, ...] = ()) -> Gauge:
        return self._register(Gauge(
            f"kvcompress:{name}", documentation, labelnames=[*self._BASE_LABELS, *extra],
            multiprocess_mode="mostrecent",
        ))

    def _counter(self, name: str, documentation: str, extra: tuple[str, ...] = ()) -> Counter:
        return self._register(Counter(
            f"kvcompress:{name}", documentation, labelnames=[*self._BASE_LABELS, *extra]
        ))

    def _declare_pool_metrics(self) -> None:
        """The pool's gauges."""
        gauge = self._gauge
        self.pages_total = gauge(
            "pages_total",
            "Pages of the per-(layer, KV head) KV pool; a page holds block_size tokens of "
            "one layer and KV head.")
        self.pages_free = gauge("pages_free", "Pool pages no request holds.")
        self.pages_held = gauge("pages_held", "Pool pages held by requests.")
        self.kvs_kept_ratio = gauge(
            "kvs_kept_ratio",
            "KVs the live requests hold / KVs they would hold uncompressed (tokens x "
            "layers x KV heads); 1 with no live request.")

    def _declare_compression_metrics(self) -> None:
        """The compressions' counters and timings, by policy."""
        counter = self._counter
        self.compressions = counter(
            "compressions",
            "Compressions ordered by the scheduler, by reason (after_prefill, "
            "instead_of_preemption, on_interval, to_admit) and policy.", ("reason", "policy"))
        self.pages_freed = counter(
            "pages_freed", "Pages freed by compressions (worker-reported), by policy.", ("policy",))
        self.kvs_before = counter(
            "kvs_before_compression",
            "KVs (over layers and KV heads) compressed requests held just before "
            "their compression, by policy.", ("policy",))
        self.kvs_evicted = counter(
            "kvs_evicted", "KVs evicted by compressions, by policy.", ("policy",))
        self.compression_seconds = self._register(Histogram(
            "kvcompress:compression_seconds",
            "Wall time of one batched compression (one policy's requests of one step: "
            "schedule, MoveCache, page frees), by policy.",
            labelnames=[*self._BASE_LABELS, "policy"], buckets=COMPRESSION_SECONDS_BUCKETS,
        ))

    def _declare_check_counters(self) -> None:
        """Preemptions and the scheduler's cross-checks of the worker's pages."""
        counter = self._counter
        self.preemptions = counter(
            "preemptions", "Requests vLLM preempted in a kvcompress engine (compression "
            "could not free enough pages).")
        self.preemptions_after_compression = counter(
            "preemptions_after_compression",
            "Preempted requests that had been compressed before.")
        self.window_pages_freed = counter(
            "window_pages_freed",
            "Pages sliding-window layers' heads gave back behind their windows.")
        self.steps_checked = counter(
            "steps_checked",
            "Steps whose worker page counts the scheduler cross-checked.")
        self.page_mismatches = counter(
            "page_mismatches",
            "Cross-checked steps whose worker free/held pages differ from the scheduler's "
            "(must stay 0).")
        self.evict_mismatches = counter(
            "evict_mismatches",
            "Worker steps whose compressions freed other than the pages the scheduler "
            "ordered (must stay 0).")

    def _publish_settings(self) -> None:
        """``config_info`` (the server's settings as labels, value 1), and zero series of
        every counter for the server's policy, so "configured, not compressing" shows."""
        settings = self.settings
        info = {
            "enabled": str(settings.enabled).lower(),
            "policy": settings.policy,
            "rate": f"{settings.rate:g}",
            "max_cache_tokens": "" if settings.max_cache_tokens is None else str(settings.max_cache_tokens),
            "min_cache_tokens": str(settings.min_cache_tokens),
            "protected_window": str(settings.protected_window),
            "interval": str(settings.interval),
            "block_size": "" if settings.block_size is None else str(settings.block_size),
        }
        config_info = self._gauge(
            "config_info",
            "kvcompress settings of the server (1); compare with "
            "kvcompress:compressions_total to see that compression happens.",
            tuple(info))
        for labels in self.labels.values():
            config_info.labels(*labels, *info.values()).set(1)
            for reason in COMPRESSION_REASONS:
                self.compressions.labels(*labels, reason, settings.policy)
            for metric in (self.pages_freed, self.kvs_before, self.kvs_evicted,
                           self.compression_seconds):
                metric.labels(*labels, settings.policy)
            for metric in (self.preemptions, self.preemptions_after_compression, self.window_pages_freed,
                           self.steps_checked, self.page_mismatches, self.evict_mismatches):
                metric.labels(*labels)

    @staticmethod
    def _register(metric):
        _REGISTERED.append(metric)
        return metric

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        figures: KVCompressStats | None = getattr(scheduler_stats, "kvcompress", None)
        labels = self.labels.get(engine_idx)
        if figures is None or labels is None:
            return
        self.pages_total.labels(*labels).set(figures.pages_total)
        self.pages_free.labels(*labels).set(figures.pages_free)
        self.pages_held.labels(*labels).set(figures.pages_held)
        self.kvs_kept_ratio.labels(*labels).set(figures.kvs_kept_ratio)
        for reason, by_policy in figures.compressions.items():
            for policy, count in by_policy.items():
                self.compressions.labels(*labels, reason, policy).inc(count)
        for policy, totals in figures.by_policy.items():
            self.pages_freed.labels(*labels, policy).inc(totals.pages_freed)
            self.kvs_before.labels(*labels, policy).inc(totals.kvs_before)
            self.kvs_evicted.labels(*labels, policy).inc(totals.kvs_evicted)
        for policy, seconds in figures.compression_seconds.items():
            histogram = self.compression_seconds.labels(*labels, policy)
            for value in seconds:
                histogram.observe(value)
        for metric, count in (
            (self.preemptions, figures.preemptions),
            (self.preemptions_after_compression, figures.preemptions_after_compression),
            (self.window_pages_freed, figures.window_pages_freed),
            (self.steps_checked, figures.steps_checked),
            (self.page_mismatches, figures.page_mismatches),
            (self.evict_mismatches, figures.evict_mismatches),
        ):
            if count:
                metric.labels(*labels).inc(count)

    def log_engine_initialized(self) -> None:
        pass


def stat_loggers_for(vllm_config: VllmConfig, log_stats: bool) -> list[type]:
    """Stat loggers kvcompress adds to an ``AsyncLLM``: none for an engine without
    kvcompress or with stats off (``--disable-log-stats``)."""
    if not log_stats or kvcompress_settings(vllm_config) is None:
        return []
    return [KVCompressPrometheusLogger]
