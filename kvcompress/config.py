"""User-facing settings of kvcompress (no vLLM import).

The same settings arrive three ways and end up in one place,
``VllmConfig.additional_config["kvcompress"]``, which vLLM ships to every process:

- ``vllm serve`` / ``vllm bench throughput`` flags ``--kv-compress*`` (see ``FLAGS``);
- ``LLM(..., additional_config={"kvcompress": {"enabled": True, "rate": 8}})``;
- ``kvcompress.LLM(..., kv_compress=True, kv_compress_rate=8)``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from kvcompress.policies import POLICY_NAMES, Policy, load_layer_profile, resolve_policy

ADDITIONAL_CONFIG_KEY = "kvcompress"
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


class KVCompressConfigError(ValueError):
    """A kvcompress setting is invalid; the message names the flag."""


class KVCompressConfig(BaseModel):
    """Settings of the per-(layer, KV head) paged cache and its compression."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Keep the KV cache in per-(layer, KV head) pages (``--kv-compress``)."""
    rate: float = 1.0
    """Target compression rate: keep ~1/rate of each sequence's KVs (``--kv-compress-rate``)."""
    max_cache_tokens: int | None = None
    """Keep at most this many tokens' worth of KVs per sequence (``--kv-compress-max-cache-tokens``)."""
    protected_window: int = 64
    """The last N tokens of a sequence are never evicted (``--kv-compress-protected-window``)."""
    block_size: int = 16
    """Tokens per page; each page holds one (layer, KV head) (``--kv-compress-block-size``)."""
    min_cache_tokens: int = 128
    """Rate budgets never go below this many tokens per sequence (``--kv-compress-min-cache-tokens``)."""
    sink_tokens: int | None = None
    """The first N tokens of a sequence are never evicted; default: the policy's (4 for
    streamingllm, else 0) (``--kv-compress-sink-tokens``)."""
    policy: Literal[POLICY_NAMES] = "kvc"
    """Eviction policy: how KVs are scored and how the budget is split over layers and heads:
    kvc (the paper), snapkv, pyramidkv, ada-snapkv, ada-pyramidkv, xkv, h2o, streamingllm, random
    (``--kv-compress-policy``)."""
    metric: Literal["l2", "l1"] | None = None
    """How attention becomes a KV's metric: squared (l2) or plain (l1) attention probabilities,
    summed over the query heads of the KV head's group; default: the policy's (l2 for kvc, l1 for
    the others) (``--kv-compress-metric``)."""
    metric_queries: Literal["window", "full"] | None = None
    """Prompt queries that score keys: the last ``observation_window`` (window) or all later
    queries but the ``full_skip_nearest`` nearest (full, quadratic); default: the policy's (full
    for h2o) (``--kv-compress-metric-queries``)."""
    observation_window: int | None = None
    """w: prompt queries that score the keys in window mode; default: the policy's (8 for kvc,
    pyramidkv, xkv; 32 for snapkv, ada-*) (``--kv-compress-observation-window``)."""
    full_skip_nearest: int | None = None
    """v: in full mode a query scores only keys at least v positions before it; default: the
    policy's (10 for kvc, 0 for h2o) (``--kv-compress-full-skip-nearest``)."""
    pool: Literal["max", "avg"] | None = None
    """Pooling of prompt metrics over neighbouring key positions; default: the policy's (avg for
    xkv, else max) (``--kv-compress-pool``)."""
    pool_kernel: int | None = None
    """Pooling width in tokens (odd), 1 = off; default: the policy's (7; 1 for h2o, streamingllm,
    random) (``--kv-compress-pool-kernel``)."""
    pyramid_beta: float = 20.0
    """PyramidKV's beta (pyramidkv, ada-pyramidkv): the last layer keeps 1/beta of the average
    per-head budget, the first layer 2 - 1/beta of it (``--kv-compress-pyramid-beta``)."""
    ada_floor: float = 0.5
    """Ada-KV's safeguard alpha (ada-*): each head keeps at least alpha of its layer's
    per-head average budget (``--kv-compress-ada-floor``)."""
    xkv_profile: str | None = None
    """xkv only: JSON file of per-layer budget shares (benchmarks/xkv_profile.py writes one) used
    instead of each request's own allocation (``--kv-compress-xkv-profile``)."""
    block_cost: Literal["max", "sum"] = "max"
    """Cost of evicting a candidate block: its largest metric (the paper's schedule, minimax) or the
    sum of its metrics (exact minimum of total evicted metric) (``--kv-compress-block-cost``)."""
    interval: int = 0
    """Also compress every running sequence every N engine steps; 0 = only after prefill and
    instead of preemption (``--kv-compress-interval``)."""
    max_kv_per_iteration: int = 5_000_000
    """Cap on the KVs (summed over layers and heads) sorted in one compression step; sequences
    never compressed, then least recently compressed, go first (``--kv-compress-max-kv-per-iteration``)."""

    @field_validator("rate")
    @classmethod
    def _rate_at_least_one(cls, value: float) -> float:
        if not value >= 1.0:
            raise ValueError(f"must be >= 1 (1 keeps everything), got {value}")
        return value

    @field_validator("max_cache_tokens")
    @classmethod
    def _positive_cache(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("protected_window", "sink_tokens")
    @classmethod
    def _non_negative_window(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value

    @field_validator("block_size")
    @classmethod
    def _supported_block(cls, value: int) -> int:
        if value not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"must be one of {SUPPORTED_BLOCK_SIZES}, got {value}")
        return value

    @field_validator("min_cache_tokens", "full_skip_nearest")
    @classmethod
    def _non_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value

    @field_validator("observation_window", "max_kv_per_iteration")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("interval")
    @classmethod
    def _interval(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"must be >= 0 (0 = off), got {value}")
        return value

    @field_validator("pool_kernel")
    @classmethod
    def _odd_kernel(cls, value: int | None) -> int | None:
        if value is not None and (value < 1 or value % 2 == 0):
            raise ValueError(f"must be an odd number >= 1 (1 = no pooling), got {value}")
        return value

    @field_validator("pyramid_beta")
    @classmethod
    def _beta(cls, value: float) -> float:
        if not value >= 1.0:
            raise ValueError(f"must be >= 1 (1 = uniform layers), got {value}")
        return value

    @field_validator("ada_floor")
    @classmethod
    def _floor(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"must be in [0, 1], got {value}")
        return value

    @field_validator("xkv_profile")
    @classmethod
    def _profile(cls, value: str | None) -> str | None:
        if value is not None:
            load_layer_profile(value)  # fails now, naming the file, not at the first request
        return value

    def policy_for(self, name: str | None = None) -> Policy:
        """Policy ``name`` (default: ``policy``) with its paper defaults, overridden by every
        metric setting given explicitly here."""
        return resolve_policy(
            name or self.policy,
            metric=self.metric,
            metric_queries=self.metric_queries,
            observation_window=self.observation_window,
            full_skip_nearest=self.full_skip_nearest,
            pool=self.pool,
            pool_kernel=self.pool_kernel,
            sink_tokens=self.sink_tokens,
            pyramid_beta=self.pyramid_beta,
            ada_floor=self.ada_floor,
            layer_profile=_cached_profile(self.xkv_profile) if self.xkv_profile else None,
        )

    @property
    def compresses(self) -> bool:
        """Whether any KV is ever evicted with these settings."""
        return self.enabled and (self.rate > 1.0 or self.max_cache_tokens is not None)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "KVCompressConfig":
        """Validate, turning pydantic errors into messages that name the flag."""
        try:
            return cls(**(values or {}))
        except ValidationError as error:
            problems = []
            for item in error.errors():
                field = str(item["loc"][0]) if item["loc"] else "?"
                flag = FLAGS.get(field, field)
                problems.append(f"{flag}: {item['msg']}")
            raise KVCompressConfigError(
                "invalid kvcompress setting(s): " + "; ".join(problems)
            ) from None

    @classmethod
    def from_additional_config(
        cls, additional_config: dict[str, Any] | None
    ) -> "KVCompressConfig":
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if isinstance(section, KVCompressConfig):
            return section
        return cls.from_dict(section)


# Field -> CLI flag, used in error messages and by the argument parser.
FLAGS: dict[str, str] = {
    "enabled": "--kv-compress",
    "rate": "--kv-compress-rate",
    "max_cache_tokens": "--kv-compress-max-cache-tokens",
    "protected_window": "--kv-compress-protected-window",
    "block_size": "--kv-compress-block-size",
    "min_cache_tokens": "--kv-compress-min-cache-tokens",
    "sink_tokens": "--kv-compress-sink-tokens",
    "policy": "--kv-compress-policy",
    "metric": "--kv-compress-metric",
    "metric_queries": "--kv-compress-metric-queries",
    "observation_window": "--kv-compress-observation-window",
    "full_skip_nearest": "--kv-compress-full-skip-nearest",
    "pool": "--kv-compress-pool",
    "pool_kernel": "--kv-compress-pool-kernel",
    "pyramid_beta": "--kv-compress-pyramid-beta",
    "ada_floor": "--kv-compress-ada-floor",
    "xkv_profile": "--kv-compress-xkv-profile",
    "block_cost": "--kv-compress-block-cost",
    "interval": "--kv-compress-interval",
    "max_kv_per_iteration": "--kv-compress-max-kv-per-iteration",
}


_PROFILES: dict[str, tuple[float, ...]] = {}


def _cached_profile(path: str) -> tuple[float, ...]:
    if path not in _PROFILES:
        _PROFILES[path] = load_layer_profile(path)
    return _PROFILES[path]
