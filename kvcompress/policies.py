"""Eviction policies: how metrics are computed and how a sequence's eviction budget
is split over its (layer, KV head) pairs (no vLLM, no torch).

Every policy runs on the same machinery: prompt metrics scored inside attention, the
block-eviction schedule, MoveCache and page freeing. The scheduler decides how many
pages ``E_s`` a sequence frees (``kvcompress.budget``, the same for every policy); the
policy decides which heads give them back and which KVs go:

============== ======================== ========================================= ===========
policy         metric (prompt queries)  budget split over (layer, head)           paper
============== ======================== ========================================= ===========
kvc            L2, last 8, max-pool 7   global: cheapest blocks across all layers KV-Compress
                                        and heads (block-eviction schedule)
snapkv         L1, last 32, max-pool 7  uniform: same count per head and layer    SnapKV
pyramidkv      L1, last 8, max-pool 7   per-layer arithmetic schedule (beta = 20),PyramidKV
                                        uniform heads
ada-snapkv     L1, last 32, max-pool 7  uniform layer totals; within a layer      Ada-KV
                                        top-k across heads + alpha = 0.5 floor
ada-pyramidkv  L1, last 32, max-pool 7  pyramid layer totals; Ada-KV within layer Ada-KV
xkv            L1, last 8, avg-pool 7   cross-layer top-N of layer-normalised     XKV
                                        scores (or a saved per-layer profile),
                                        uniform heads within a layer
h2o            L1, all queries, no pool uniform (heavy hitters + recent window)   H2O
streamingllm   position (oldest first)  uniform; 4 sink tokens + recent window    StreamingLLM
random         uniform random           uniform                                   (baseline)
============== ======================== ========================================= ===========

L1/L2: attention probabilities (or their squares) summed over the query heads of the KV
head's group (GQA); a sum and the papers' mean rank KVs identically. A ``--kv-compress-*``
metric flag given explicitly on the server overrides that setting for every policy.

Budgets are whole pages per (layer, head); see ``kvcompress.ops.budget_split`` for the
rounding rule. PyramidInfer is not offered: it drops tokens from the residual stream
during prefill (deeper layers never compute them), a change to the model forward rather
than a cache policy, and its nested per-layer sets need head-shared eviction.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

POLICY_NAMES = (
    "kvc",
    "snapkv",
    "pyramidkv",
    "ada-snapkv",
    "ada-pyramidkv",
    "xkv",
    "h2o",
    "streamingllm",
    "random",
)

Split = Literal["global", "uniform", "pyramid", "ada", "ada-pyramid", "xkv"]
MetricSource = Literal["attention", "position", "random"]


@dataclass(frozen=True)
class MetricSpec:
    """How a policy scores KVs.

    Attributes:
        source: ``attention`` (scored by queries), ``position`` (token position: the
            oldest KV is evicted first) or ``random``.
        power: attention probabilities are raised to this power (2 = L2, 1 = L1).
        queries: ``window`` (the last ``observation_window`` prompt queries) or ``full``
            (every prompt query, each skipping its ``skip_nearest`` nearest keys).
        observation_window: prompt queries that score keys in ``window`` mode.
        skip_nearest: ``full`` mode only.
        pool: ``max`` or ``avg`` pooling over key positions, once the prompt is scored.
        pool_kernel: odd pooling width in tokens; 1 = none.
    """

    source: MetricSource = "attention"
    power: int = 2
    queries: Literal["window", "full"] = "window"
    observation_window: int = 8
    skip_nearest: int = 10
    pool: Literal["max", "avg"] = "max"
    pool_kernel: int = 7

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt queries must score keys for this policy."""
        return self.source == "attention"


@dataclass(frozen=True)
class BudgetSplit:
    """How a policy splits a sequence's kept pages over its (layer, KV head) pairs.

    Attributes:
        kind: see the module table.
        pyramid_beta: PyramidKV's beta: the last layer keeps ``B / beta`` non-protected
            tokens per head, the first ``2B - B / beta`` (B = the average).
        ada_floor: Ada-KV's safeguard alpha: a head keeps
            ``alpha * B' + (1 - alpha) * f`` non-protected tokens (B' = the layer's
            per-head average, f = the head's winners of the layer's top-k).
        layer_profile: XKV with a saved profile: per-layer shares of the non-protected
            budget (normalised to sum 1) instead of the per-request allocation.
    """

    kind: Split = "global"
    pyramid_beta: float = 20.0
    ada_floor: float = 0.5
    layer_profile: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Policy:
    """A resolved eviction policy."""

    name: str
    metric: MetricSpec
    split: BudgetSplit
    sink_tokens: int = 0


# Each policy's paper defaults: metric settings, split, attention sinks.
_DEFAULTS: dict[str, dict] = {
    "kvc": dict(metric=MetricSpec(power=2, observation_window=8, pool="max"), split="global"),
    "snapkv": dict(metric=MetricSpec(power=1, observation_window=32, pool="max"), split="uniform"),
    "pyramidkv": dict(metric=MetricSpec(power=1, observation_window=8, pool="max"), split="pyramid"),
    "ada-snapkv": dict(metric=MetricSpec(power=1, observation_window=32, pool="max"), split="ada"),
    "ada-pyramidkv": dict(
        metric=MetricSpec(power=1, observation_window=32, pool="max"), split="ada-pyramid"
    ),
    "xkv": dict(metric=MetricSpec(power=1, observation_window=8, pool="avg"), split="xkv"),
    "h2o": dict(
        metric=MetricSpec(power=1, queries="full", skip_nearest=0, pool_kernel=1), split="uniform"
    ),
    "streamingllm": dict(metric=MetricSpec(source="position", pool_kernel=1), split="uniform", sinks=4),
    "random": dict(metric=MetricSpec(source="random", pool_kernel=1), split="uniform"),
}


def policy_defaults(name: str) -> dict:
    """The paper defaults of a policy, as the values its flags would take."""
    if name not in _DEFAULTS:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    spec = _DEFAULTS[name]
    metric: MetricSpec = spec["metric"]
    return {
        "metric": "l2" if metric.power == 2 else "l1",
        "metric_queries": metric.queries,
        "observation_window": metric.observation_window,
        "full_skip_nearest": metric.skip_nearest,
        "pool": metric.pool,
        "pool_kernel": metric.pool_kernel,
        "sink_tokens": spec.get("sinks", 0),
    }


def resolve_policy(
    name: str,
    *,
    metric: str | None = None,
    metric_queries: str | None = None,
    observation_window: int | None = None,
    full_skip_nearest: int | None = None,
    pool: str | None = None,
    pool_kernel: int | None = None,
    sink_tokens: int | None = None,
    pyramid_beta: float = 20.0,
    ada_floor: float = 0.5,
    layer_profile: tuple[float, ...] | None = None,
) -> Policy:
    """The policy ``name`` with its paper defaults, overridden by any value not None."""
    defaults = policy_defaults(name)
    chosen = {
        "metric": metric, "metric_queries": metric_queries,
        "observation_window": observation_window, "full_skip_nearest": full_skip_nearest,
        "pool": pool, "pool_kernel": pool_kernel, "sink_tokens": sink_tokens,
    }
    values = {key: defaults[key] if value is None else value for key, value in chosen.items()}
    spec = MetricSpec(
        source=_DEFAULTS[name]["metric"].source,
        power=2 if values["metric"] == "l2" else 1,
        queries=values["metric_queries"],
        observation_window=int(values["observation_window"]),
        skip_nearest=int(values["full_skip_nearest"]),
        pool=values["pool"],
        pool_kernel=int(values["pool_kernel"]),
    )
    split = BudgetSplit(
        kind=_DEFAULTS[name]["split"],
        pyramid_beta=float(pyramid_beta),
        ada_floor=float(ada_floor),
        layer_profile=layer_profile if _DEFAULTS[name]["split"] == "xkv" else None,
    )
    return Policy(name=name, metric=spec, split=split, sink_tokens=int(values["sink_tokens"]))


def load_layer_profile(path: str | Path) -> tuple[float, ...]:
    """Read an XKV per-layer allocation profile.

    The file is JSON: either a list of per-layer weights or an object with a
    ``"layer_shares"`` list (what ``benchmarks/xkv_profile.py`` writes). Weights are
    non-negative, finite, not all zero; they are normalised to sum 1.

    Raises ``ValueError`` naming the file and the problem.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read XKV profile {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"XKV profile {path} is not JSON: {error}") from None
    shares = data.get("layer_shares") if isinstance(data, dict) else data
    if not isinstance(shares, list) or not shares:
        raise ValueError(
            f"XKV profile {path}: expected a non-empty list of per-layer weights "
            "(or an object with 'layer_shares')"
        )
    values = []
    for index, value in enumerate(shares):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"XKV profile {path}: layer {index} weight {value!r} is not a finite number >= 0")
        values.append(float(value))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"XKV profile {path}: all layer weights are 0")
    return tuple(v / total for v in values)
