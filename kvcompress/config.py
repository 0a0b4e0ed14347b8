"""User-facing settings of kvcompress (no vLLM import).

The same settings arrive three ways and end up in one place,
``VllmConfig.additional_config["kvcompress"]``, which vLLM ships to every process:

- ``vllm serve`` / ``vllm bench throughput`` flags ``--kv-compress*`` (see ``FLAGS``:
  setting ``x_y`` is the flag ``--kv-compress-x-y``, ``enabled`` is ``--kv-compress``);
- ``LLM(..., additional_config={"kvcompress": {"enabled": True, "rate": 8}})``;
- ``kvcompress.LLM(..., kv_compress=True, kv_compress_rate=8)``.

Each setting is declared once below: its type and pydantic ``Field`` constraints, its
default, and its docstring, which is also its ``--help`` text (``flag_help``, which adds
what the policy registry knows: per-policy defaults, the policies a knob affects).

Validated once: the front end validates (``from_dict``) and stores the normalised
values with a digest of them (``to_additional_config``); the scheduler, the workers
and the request checks load that section without validating again
(``from_additional_config``). A section without a matching digest, e.g. one written
by hand and handed to vLLM past the front end's check, is validated in full.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcompress.policies import (
    ADA_FLOOR,
    POLICIES,
    POLICY_NAMES,
    POLICY_SETTINGS,
    PYRAMID_BETA,
    Policy,
    default_summary,
    load_layer_profile,
    policies_using,
    policy_definition,
)

ADDITIONAL_CONFIG_KEY = "kvcompress"
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
VALIDATED_KEY = "_validated"
"""Key of ``additional_config["kvcompress"]`` holding the digest of validated values."""

WORD_SPAN_RULES = ("whitespace", "alnum")
"""Names of the word-span rules (what each does: ``kvcompress.ops.word_spans.SPAN_RULES``)."""

SPLIT_SETTINGS = {"pyramid_beta": "pyramid_beta", "ada_floor": "ada_floor", "xkv_profile": "layer_profile"}
"""Settings read by budget splits -> the split knob each sets (``BudgetSplit.knobs``)."""


def compresses(enabled: bool, rate: float, max_cache_tokens: int | None) -> bool:
    """Whether settings evict any KV: kvcompress on, and a compression rate above 1 or a
    per-request cap of cached tokens. The one definition the server settings
    (``KVCompressConfig``) and each request's (``budget.RequestBudget``) use."""
    return enabled and (rate > 1.0 or max_cache_tokens is not None)


class KVCompressConfigError(ValueError):
    """A kvcompress setting is invalid; the message names the flag."""


class KVCompressConfig(BaseModel):
    """Settings of the per-(layer, KV head) paged cache and its compression."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Keep the KV cache in pages that each hold one (layer, KV head), so heads can be
    compressed at their own rates and freed pages return to the scheduler. Implied by
    any other --kv-compress-* flag."""
    rate: float = Field(1.0, ge=1.0)
    """Target compression rate: keep ~1/rate of each sequence's KVs."""
    max_cache_tokens: int | None = Field(None, ge=1)
    """Keep at most this many tokens' worth of KVs per sequence."""
    protected_window: int = Field(64, ge=0)
    """The last N tokens of a sequence are never evicted."""
    block_size: Literal[SUPPORTED_BLOCK_SIZES] | None = None
    """Tokens per page; each page holds one (layer, KV head). Default: 64 on CPU, 16 on
    GPUs."""
    # Why 64 on CPU: engine_setup.default_block_size (measured in
    # benchmarks/results/kernel-page-size-cpu.md).
    min_cache_tokens: int = Field(128, ge=0)
    """Rate budgets never go below this many tokens per sequence."""
    sink_tokens: int | None = Field(None, ge=0)
    """The first N tokens of a sequence are never evicted."""
    policy: Literal[POLICY_NAMES] = "kvc"
    """Eviction policy: how KVs are scored and how the budget is split over layers and
    heads."""
    metric: Literal["l2", "l1"] | None = None
    """How attention becomes a KV's metric: squared (l2) or plain (l1) attention
    probabilities, summed over the query heads of the KV head's group."""
    metric_queries: Literal["window", "full"] | None = None
    """Prompt queries that score keys: the last ``observation_window`` (window) or all
    later queries but the ``full_skip_nearest`` nearest (full, quadratic)."""
    observation_window: int | None = Field(None, ge=1)
    """w: prompt queries that score the keys in window mode."""
    full_skip_nearest: int | None = Field(None, ge=0)
    """v: in full mode a query scores only keys at least v positions before it."""
    pool: Literal["max", "avg"] | None = None
    """Pooling of prompt metrics over neighbouring key positions."""
    pool_kernel: int | None = Field(None, ge=1)
    """Pooling width in tokens (odd), 1 = off."""
    pool_words: bool | None = None
    """Then pool over word spans: every token of a word (the digits of a number, the
    pieces of a long word, an identifier; see --kv-compress-word-spans) gets the word's
    largest metric, so words are kept or evicted whole whatever the tokenizer (needs the
    tokenizer)."""
    word_spans: Literal[WORD_SPAN_RULES] = "whitespace"
    """Where a word span ends, when metrics are pooled over words: at whitespace
    (a number with its punctuation, a UUID or a hyphenated name is one span; cut at 64
    tokens), or alnum: where letters and digits meet anything else (cut at 16 tokens)."""
    # Why whitespace: RULER's UUID needles, benchmarks/results/README.md (RULER).
    pyramid_beta: float = Field(PYRAMID_BETA, ge=1.0)
    """PyramidKV's beta: the last layer keeps 1/beta of the average per-head budget, the
    first layer 2 - 1/beta of it."""
    ada_floor: float = Field(ADA_FLOOR, ge=0.0, le=1.0)
    """Ada-KV's safeguard alpha: each head keeps at least alpha of its layer's per-head
    average budget."""
    xkv_profile: str | None = None
    """JSON file of per-layer budget shares (benchmarks/quality/xkv_profile.py writes one) used
    instead of each request's own allocation."""
    block_cost: Literal["max", "sum"] = "max"
    """Cost of evicting a candidate block: its largest metric (the paper's schedule,
    minimax) or the sum of its metrics (exact minimum of total evicted metric)."""
    interval: int = Field(0, ge=0)
    """Also compress every running sequence every N engine steps; 0 = only after prefill
    and instead of preemption."""
    decode_metric_stride: int = Field(8, ge=1)
    """A decoding sequence's query adds its attention to the eviction metrics every N
    tokens (prompt metrics are scaled by 1/N to match, so rankings estimate those of
    every query); 1 = every decode query."""
    # The default's measurement (quality against stride, and the metric pass's cost on
    # kernels that return no probabilities): benchmarks/results/quality-metric-stride-smollm2-cpu.md.
    shared_prefix_tokens: int = Field(0, ge=0)
    """With --enable-prefix-caching: the first N prompt tokens of a compressed request
    that misses the prefix cache (whole blocks; e.g. a system prompt's length) stay
    uncompressed and cached for later requests; blocks a request hits always stay
    shared. The rate then applies to the rest of the context. Requests not compressed
    cache every full block, as stock vLLM."""
    max_kv_per_iteration: int = Field(5_000_000, ge=1)
    """Cap on the KVs (summed over layers and heads) sorted in one compression step;
    sequences never compressed, then least recently compressed, go first."""

    @field_validator("pool_kernel")
    @classmethod
    def _odd_kernel(cls, value: int | None) -> int | None:
        if value is not None and value % 2 == 0:
            raise ValueError(f"must be an odd number >= 1 (1 = no pooling), got {value}")
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
        return policy_definition(name or self.policy).resolve(
            {setting: getattr(self, setting) for setting in POLICY_SETTINGS},
            pyramid_beta=self.pyramid_beta,
            ada_floor=self.ada_floor,
            layer_profile=_cached_profile(self.xkv_profile) if self.xkv_profile else None,
        )

    @property
    def compresses(self) -> bool:
        """Whether any KV is ever evicted with these settings (:func:`compresses`)."""
        return compresses(self.enabled, self.rate, self.max_cache_tokens)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "KVCompressConfig":
        """Validate, turning pydantic errors into messages that name the flag."""
        values = {k: v for k, v in (values or {}).items() if k != VALIDATED_KEY}
        try:
            return cls(**values)
        except ValidationError as error:
            problems = []
            for item in error.errors():
                field = str(item["loc"][0]) if item["loc"] else "?"
                problems.append(f"{FLAGS.get(field, field)}: {describe_error(item)}")
            raise KVCompressConfigError(
                "invalid kvcompress setting(s): " + "; ".join(problems)
            ) from None

    def to_additional_config(self) -> dict[str, Any]:
        """The ``additional_config["kvcompress"]`` section of these (validated) settings:
        their values and a digest of them, so later loads need not validate again."""
        values = self.model_dump()
        return {**values, VALIDATED_KEY: _digest(values)}

    @classmethod
    def from_additional_config(
        cls, additional_config: dict[str, Any] | None
    ) -> "KVCompressConfig":
        """The settings in vLLM's ``additional_config``: a section written by
        ``to_additional_config`` (digest matching its values) is trusted as it is,
        anything else is validated (``KVCompressConfigError`` names the flag)."""
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if isinstance(section, KVCompressConfig):
            return section
        if isinstance(section, dict) and VALIDATED_KEY in section:
            values = {k: v for k, v in section.items() if k != VALIDATED_KEY}
            if section[VALIDATED_KEY] == _digest(values) and set(values) == set(cls.model_fields):
                return cls.model_construct(**values)
        return cls.from_dict(section)


def _flag(setting: str) -> str:
    return "--kv-compress" if setting == "enabled" else "--kv-compress-" + setting.replace("_", "-")


FLAGS: dict[str, str] = {setting: _flag(setting) for setting in KVCompressConfig.model_fields}
"""Setting -> CLI flag, used in error messages and by the argument parser."""


def flag_help(setting: str) -> str:
    """``--help`` text of a setting: its docstring, what the policy registry adds
    (the policies, each policy's default, the policies a split knob affects) and its
    default."""
    field = KVCompressConfig.model_fields[setting]
    text = " ".join((field.description or setting).split()).rstrip(".")
    if setting == "policy":
        text += ": " + ", ".join(f"{name} ({definition.paper})" for name, definition in POLICIES.items())
    if setting in SPLIT_SETTINGS:
        text += f" ({', '.join(policies_using(SPLIT_SETTINGS[setting]))} only)"
    if setting in POLICY_SETTINGS:
        return f"{text}; default: the policy's ({default_summary(setting)})."
    if field.annotation is bool:
        return text + "."  # a switch
    if setting == "block_size":
        return text + "."  # the docstring says the per-platform default
    default = "none" if field.default is None else field.default
    return f"{text}. (default: {default})"


def setting_type(setting: str) -> tuple[type, list | None]:
    """(value type, choices) of a setting, for a command-line parser; ``X | None``
    parses as X, a ``Literal`` gives its choices."""
    annotation = KVCompressConfig.model_fields[setting].annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        choices = list(typing.get_args(annotation))
        return type(choices[0]), choices
    return annotation, None


_MESSAGES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "literal_error": "must be one of {expected}",
    "finite_number": "must be finite",
    "int_from_float": "must be an integer",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "extra_forbidden": "unknown setting",
}


def describe_error(item: dict[str, Any]) -> str:
    """One pydantic error as ``"must be >= 1, got 0.5"`` (a validator's own message
    as it is)."""
    ctx = item.get("ctx") or {}
    template = _MESSAGES.get(item["type"])
    if template is None:
        return str(ctx["error"]) if "error" in ctx else item["msg"]
    return template.format(**ctx) + f", got {item.get('input')!r}"


def _digest(values: dict[str, Any]) -> str:
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(f"kvcompress-settings-1:{text}".encode()).hexdigest()[:32]


_PROFILES: dict[str, tuple[float, ...]] = {}


def _cached_profile(path: str) -> tuple[float, ...]:
    if path not in _PROFILES:
        _PROFILES[path] = load_layer_profile(path)
    return _PROFILES[path]
