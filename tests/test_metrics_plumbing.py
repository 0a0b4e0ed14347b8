"""The way kvcompress's figures take to ``/metrics``, without an engine: vLLM's wire
format between engine core and front end, and the Prometheus logger's output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcompress.config import KVCompressConfig
from kvcompress.engine_stats import KVCompressStats, PolicyTotals


def _figures() -> KVCompressStats:
    return KVCompressStats(
        pages_total=1000, pages_free=700, kvs_held=1500, kvs_logical=6000,
        compressions={"after_prefill": {"kvc": 2}, "instead_of_preemption": {"h2o": 1}},
        by_policy={"kvc": PolicyTotals(2, 40, 5000, 3000, 0.02), "h2o": PolicyTotals(1, 9, 900, 600, 0.5)},
        compression_seconds={"kvc": [0.002, 0.018], "h2o": [0.5]},
        preemptions=3, preemptions_after_compression=1, window_pages_freed=5, steps_checked=7,
    )


def test_figures_survive_vllms_wire_only_with_the_kvcompress_decoder():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from kvcompress.vllm_glue.metrics import KVCompressOutputsDecoder, with_kvcompress_stats

    stats = with_kvcompress_stats(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25), _figures())
    frames = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats, finished_requests={"x"}))

    decoded = KVCompressOutputsDecoder(EngineCoreOutputs).decode(frames)
    assert isinstance(decoded, EngineCoreOutputs) and decoded.finished_requests == {"x"}
    assert isinstance(decoded.scheduler_stats, SchedulerStats)
    assert decoded.scheduler_stats.num_running_reqs == 2
    assert decoded.scheduler_stats.kvcompress == _figures()
    # vLLM's own decoder drops the field (why patches/metrics.py swaps the decoder) ...
    assert not hasattr(MsgpackDecoder(EngineCoreOutputs).decode(frames).scheduler_stats, "kvcompress")
    # ... and plain SchedulerStats (a stock engine core) decode with no figures.
    plain = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats()))
    assert KVCompressOutputsDecoder(EngineCoreOutputs).decode(plain).scheduler_stats.kvcompress is None


def _vllm_config(kvcompress: dict | None):
    additional = {} if kvcompress is None else {"kvcompress": kvcompress}
    return SimpleNamespace(additional_config=additional,
                           model_config=SimpleNamespace(served_model_name="m"))


def test_only_kvcompress_engines_with_stats_get_the_logger():
    from kvcompress.vllm_glue.metrics import KVCompressPrometheusLogger, stat_loggers_for

    assert stat_loggers_for(_vllm_config(None), log_stats=True) == []
    assert stat_loggers_for(_vllm_config({"enabled": False}), log_stats=True) == []
    assert stat_loggers_for(_vllm_config({"enabled": True}), log_stats=False) == []
    assert stat_loggers_for(_vllm_config({"enabled": True}), log_stats=True) == [KVCompressPrometheusLogger]


def _samples() -> dict[tuple, float]:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name.startswith("kvcompress:"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted({"model_name": "m", "engine": "0", **labels}.items())))]


def test_logger_publishes_gauges_and_adds_deltas():
    from kvcompress.vllm_glue.metrics import KVCompressPrometheusLogger, with_kvcompress_stats
    from vllm.v1.metrics.stats import SchedulerStats

    settings = KVCompressConfig(enabled=True, rate=4, policy="kvc", block_size=16).to_additional_config()
    logger = KVCompressPrometheusLogger(_vllm_config(settings), [0])
    before = _samples()
    # Configured, nothing happened yet: the info gauge and zero series of the policy.
    assert _value(before, "kvcompress:config_info", enabled="true", policy="kvc", rate="4",
                  max_cache_tokens="", min_cache_tokens="128", protected_window="64",
                  interval="0", block_size="16") == 1
    assert _value(before, "kvcompress:compressions_total", reason="instead_of_preemption", policy="kvc") == 0
    assert _value(before, "kvcompress:page_mismatches_total") == 0

    logger.record(SchedulerStats(), None)  # stats of an engine core that sends no figures
    for _ in range(2):
        logger.record(with_kvcompress_stats(SchedulerStats(), _figures()), None, engine_idx=0)
    logger.record(with_kvcompress_stats(SchedulerStats(), _figures()), None, engine_idx=5)  # not ours
    samples = _samples()
    assert _value(samples, "kvcompress:pages_total") == 1000
    assert _value(samples, "kvcompress:pages_free") == 700
    assert _value(samples, "kvcompress:pages_held") == 300
    assert _value(samples, "kvcompress:kvs_kept_ratio") == pytest.approx(0.25)
    assert _value(samples, "kvcompress:compressions_total", reason="after_prefill", policy="kvc") == 4
    assert _value(samples, "kvcompress:compressions_total", reason="instead_of_preemption", policy="h2o") == 2
    assert _value(samples, "kvcompress:pages_freed_total", policy="kvc") == 80
    assert _value(samples, "kvcompress:pages_freed_total", policy="h2o") == 18
    assert _value(samples, "kvcompress:kvs_evicted_total", policy="kvc") == 6000
    assert _value(samples, "kvcompress:kvs_before_compression_total", policy="h2o") == 1800
    assert _value(samples, "kvcompress:compression_seconds_count", policy="kvc") == 4
    assert _value(samples, "kvcompress:compression_seconds_bucket", policy="kvc", le="0.0025") == 2
    assert _value(samples, "kvcompress:compression_seconds_sum", policy="h2o") == pytest.approx(1.0)
    assert _value(samples, "kvcompress:preemptions_total") == 6
    assert _value(samples, "kvcompress:preemptions_after_compression_total") == 2
    assert _value(samples, "kvcompress:window_pages_freed_total") == 10
    assert _value(samples, "kvcompress:steps_checked_total") == 14
    assert _value(samples, "kvcompress:evict_mismatches_total") == 0

    # A second logger (a new AsyncLLM in the process) replaces the first one's metrics.
    KVCompressPrometheusLogger(_vllm_config(settings), [0])
    assert _value(_samples(), "kvcompress:pages_freed_total", policy="kvc") == 0
