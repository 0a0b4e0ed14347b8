"""Per-sequence eviction budgets and per-request overrides (no vLLM, no torch).

The scheduler computes, for a sequence of ``context_len`` tokens whose heads hold
``held_pages`` pages over ``L`` layers x ``H`` KV heads (``b`` tokens per page):

- ``protected``: tokens never evicted: the first ``max(sink_tokens, S)`` (``S`` =
  ``shared_prefix_tokens``, a prefix held in prefix-cache page groups, 0 without) and
  the last ``protected_window``: ``min(context_len, max(sink_tokens, S) + protected_window)``.
- ``keep``: tokens' worth of KVs kept per (layer, head) on average:
  rate ``r > 1``: ``max(min_cache_tokens, ceil((context_len - S) / r)) + protected``
  (the rate applies to the private part; the shared prefix is kept whole);
  max cache tokens ``C``: ``max(C, protected)`` (C counts the protected tokens);
  both given: the smaller; never more than ``context_len``.
- target pages ``ceil(keep * L * H / b)``; blocks to evict
  ``E_s = max(0, held_pages - target)``, capped by what the block schedule can
  evict without touching a protected KV (``evictable_blocks``).

Per-request overrides arrive in ``SamplingParams.extra_args`` (the OpenAI field
``vllm_xargs``): see ``RequestFields`` (pydantic constraints; its docstrings are
``REQUEST_FIELDS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvcompress.config import KVCompressConfig, compresses, describe_error
from kvcompress.policies import POLICY_NAMES


class RequestFieldError(ValueError):
    """A per-request kvcompress field is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _number(value: Any) -> Any:
    """JSON booleans are not numbers here (pydantic would read true as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r}")
    return value


def _switch(value: Any) -> Any:
    """true/false, 1/0 (also as strings, any case); pydantic reads the rest."""
    if isinstance(value, str):
        if value.strip().lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"must be true or false, got {value!r}")
        return value.strip().lower()
    return value


def _name(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


Number = BeforeValidator(_number)


class RequestFields(BaseModel):
    """The kvcompress keys of ``SamplingParams.extra_args`` (OpenAI ``vllm_xargs``);
    absent = the server's setting. Each docstring is the field's documentation."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    kv_compress: Annotated[bool, BeforeValidator(_switch)] = None
    """false turns compression off for this request (true keeps the server's)"""
    kv_compress_rate: Annotated[float, Field(ge=1, allow_inf_nan=False), Number] = None
    """compression rate >= 1 for this request (1 = no eviction)"""
    kv_compress_max_cache_tokens: Annotated[int, Field(ge=1), Number] = None
    """keep at most this many tokens' worth of KVs (>= 1)"""
    kv_compress_protected_window: Annotated[int, Field(ge=0), Number] = None
    """the last N tokens of this request are never evicted (>= 0)"""
    kv_compress_policy: Annotated[Literal[POLICY_NAMES], BeforeValidator(_name)] = Field(
        None, description="eviction policy for this request: " + ", ".join(POLICY_NAMES)
    )
    kv_compress_observation_window: Annotated[int, Field(ge=1), Number] = None
    """prompt queries that score keys in window mode (>= 1)"""
    kv_compress_shared_prefix_tokens: Annotated[int, Field(ge=0), Number] = None
    """with prefix caching: the first N prompt tokens (whole blocks) stay uncompressed and cached for later requests (>= 0)"""


REQUEST_FIELDS = {name: field.description for name, field in RequestFields.model_fields.items()}
"""Keys of ``SamplingParams.extra_args`` / OpenAI ``vllm_xargs`` that kvcompress reads."""


@dataclass(frozen=True)
class RequestBudget:
    """The compression settings that apply to one request."""

    enabled: bool
    rate: float
    max_cache_tokens: int | None
    protected_window: int
    sink_tokens: int
    min_cache_tokens: int
    policy: str = "kvc"
    observation_window: int | None = None
    # Prompt tokens to keep uncompressed and cached when a request misses the prefix
    # cache (``--kv-compress-shared-prefix-tokens``); the scheduler then sets
    # ``shared_prefix_tokens`` to the prefix the request really shares.
    cache_prefix_tokens: int = 0
    shared_prefix_tokens: int = 0

    @property
    def compresses(self) -> bool:
        """Whether this request's KVs are ever evicted (``config.compresses``)."""
        return compresses(self.enabled, self.rate, self.max_cache_tokens)

    @property
    def protected_prefix(self) -> int:
        """Leading tokens never evicted: the sinks, or the shared prefix if longer."""
        return max(self.sink_tokens, self.shared_prefix_tokens)


def request_fields(extra_args: dict[str, Any] | None) -> RequestFields:
    """The request's ``kv_compress*`` keys, validated; other keys are ignored.

    Raises ``RequestFieldError`` naming the first (in the request's order) unknown
    ``kv_compress*`` key or invalid value.
    """
    given = {key: value for key, value in (extra_args or {}).items() if key.startswith("kv_compress")}
    try:
        return RequestFields(**given)
    except ValidationError as error:
        problems = {str(item["loc"][0]): item for item in error.errors() if item["loc"]}
        key = next(key for key in given if key in problems)
        item = problems[key]
        if item["type"] == "extra_forbidden":
            message = f"unknown kvcompress field (known: {sorted(REQUEST_FIELDS)})"
        else:
            message = describe_error(item)
        raise RequestFieldError(key, message) from None


def request_budget(
    settings: KVCompressConfig, extra_args: dict[str, Any] | None
) -> RequestBudget:
    """Server settings overridden by the request's kvcompress fields.

    Raises ``RequestFieldError`` naming the field on an unknown ``kv_compress*`` key
    or an invalid value.
    """
    fields = request_fields(extra_args)
    if not settings.enabled and fields.model_fields_set:
        raise RequestFieldError(
            next(k for k in extra_args if k.startswith("kv_compress")),
            "this server was started without --kv-compress",
        )

    def chosen(value: Any, server: Any) -> Any:
        return server if value is None else value

    policy = chosen(fields.kv_compress_policy, settings.policy)
    return RequestBudget(
        enabled=settings.enabled and fields.kv_compress is not False,
        rate=float(chosen(fields.kv_compress_rate, settings.rate)),
        max_cache_tokens=chosen(fields.kv_compress_max_cache_tokens, settings.max_cache_tokens),
        protected_window=chosen(fields.kv_compress_protected_window, settings.protected_window),
        sink_tokens=settings.policy_for(policy).sink_tokens,
        min_cache_tokens=settings.min_cache_tokens,
        policy=policy,
        observation_window=fields.kv_compress_observation_window,
        cache_prefix_tokens=chosen(fields.kv_compress_shared_prefix_tokens, settings.shared_prefix_tokens),
    )


def protected_tokens(context_len: int, protected_window: int, sink_tokens: int) -> int:
    """Tokens of a ``context_len``-token sequence that may never be evicted."""
    return min(context_len, sink_tokens + protected_window)


def kept_per_head(context_len: int, budget: RequestBudget) -> int:
    """Tokens' worth of KVs kept per (layer, KV head) on average (module docstring)."""
    if not budget.compresses:
        return context_len
    protected = protected_tokens(context_len, budget.protected_window, budget.protected_prefix)
    private = max(0, context_len - budget.shared_prefix_tokens)
    keep = context_len
    if budget.rate > 1.0:
        keep = min(keep, max(budget.min_cache_tokens, math.ceil(private / budget.rate)) + protected)
    if budget.max_cache_tokens is not None:
        keep = min(keep, max(budget.max_cache_tokens, protected))
    return min(keep, context_len)


def target_pages(context_len: int, budget: RequestBudget, num_heads: int, block_size: int) -> int:
    """Pages a sequence may hold after compression; ``num_heads`` = layers x KV heads."""
    return -(-kept_per_head(context_len, budget) * num_heads // block_size)


def evictable_blocks(head_lens: np.ndarray, protected: int, block_size: int) -> int:
    """Blocks the schedule can evict without touching a protected KV.

    ``head_lens``: ``[layers, kv_heads]`` KVs held; every head holds the ``protected``
    KVs (they were never evictable). A head's k-th cheapest block is its k*b lowest
    entries, the empty slots of its partial last page counting first, so head h can
    lose ``floor((empty_h + head_len_h - protected) / b)`` blocks.
    """
    lens = np.asarray(head_lens, dtype=np.int64)
    empty = (-lens) % block_size
    return int(np.maximum((empty + lens - protected) // block_size, 0).sum())


def blocks_to_evict(
    head_lens: np.ndarray, context_len: int, budget: RequestBudget, block_size: int
) -> int:
    """``E_s``: pages the next compression of this sequence frees (0 if none)."""
    if not budget.compresses:
        return 0
    lens = np.asarray(head_lens, dtype=np.int64)
    held = int(((lens + block_size - 1) // block_size).sum())
    target = target_pages(context_len, budget, lens.size, block_size)
    wanted = held - target
    if wanted <= 0:
        return 0
    protected = protected_tokens(context_len, budget.protected_window, budget.protected_prefix)
    return min(wanted, evictable_blocks(lens, protected, block_size))
