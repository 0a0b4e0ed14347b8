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
    sink_tokens: int = 0
    """The first N tokens of a sequence are never evicted (``--kv-compress-sink-tokens``)."""
    metric: Literal["l2", "l1"] = "l2"
    """How attention becomes a KV's metric: squared (l2, the paper) or plain (l1) attention
    probabilities, summed over the query heads of the KV head's group (``--kv-compress-metric``)."""
    metric_queries: Literal["window", "full"] = "window"
    """Prompt queries that score keys: the last ``observation_window`` (KVC-w) or all later queries
    but the ``full_skip_nearest`` nearest (KVC-full, quadratic) (``--kv-compress-metric-queries``)."""
    observation_window: int = 8
    """w: prompt queries that score the keys in ``window`` mode (``--kv-compress-observation-window``)."""
    full_skip_nearest: int = 10
    """v: in ``full`` mode a query scores only keys at least v positions before it
    (``--kv-compress-full-skip-nearest``)."""
    pool_kernel: int = 7
    """Max-pool kernel over key positions applied to prompt metrics; 1 = off (``--kv-compress-pool-kernel``)."""
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
    def _non_negative_window(cls, value: int) -> int:
        if value < 0:
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
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value

    @field_validator("observation_window", "max_kv_per_iteration")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
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
    def _odd_kernel(cls, value: int) -> int:
        if value < 1 or value % 2 == 0:
            raise ValueError(f"must be an odd number >= 1 (1 = no pooling), got {value}")
        return value

    @property
    def metric_power(self) -> int:
        """Exponent applied to attention probabilities: 2 for l2, 1 for l1."""
        return 2 if self.metric == "l2" else 1

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
    "metric": "--kv-compress-metric",
    "metric_queries": "--kv-compress-metric-queries",
    "observation_window": "--kv-compress-observation-window",
    "full_skip_nearest": "--kv-compress-full-skip-nearest",
    "pool_kernel": "--kv-compress-pool-kernel",
    "block_cost": "--kv-compress-block-cost",
    "interval": "--kv-compress-interval",
    "max_kv_per_iteration": "--kv-compress-max-kv-per-iteration",
}
