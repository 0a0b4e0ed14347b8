"""User-facing settings of kvcompress (no vLLM import).

The same settings arrive three ways and end up in one place,
``VllmConfig.additional_config["kvcompress"]``, which vLLM ships to every process:

- ``vllm serve`` / ``vllm bench throughput`` flags ``--kv-compress*`` (see ``FLAGS``);
- ``LLM(..., additional_config={"kvcompress": {"enabled": True, "rate": 8}})``;
- ``kvcompress.LLM(..., kv_compress=True, kv_compress_rate=8)``.
"""

from __future__ import annotations

from typing import Any

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

    @field_validator("protected_window")
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
}
