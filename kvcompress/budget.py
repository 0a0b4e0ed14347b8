"""Per-sequence eviction budgets and per-request overrides (no vLLM, no torch).

The scheduler computes, for a sequence of ``context_len`` tokens whose heads hold
``held_pages`` pages over ``L`` layers x ``H`` KV heads (``b`` tokens per page):

- ``protected``: tokens never evicted: the first ``sink_tokens`` and the last
  ``protected_window``: ``min(context_len, sink_tokens + protected_window)``.
- ``keep``: tokens' worth of KVs kept per (layer, head) on average:
  rate ``r > 1``: ``max(min_cache_tokens, ceil(context_len / r)) + protected``;
  max cache tokens ``C``: ``max(C, protected)`` (C counts the protected tokens);
  both given: the smaller; never more than ``context_len``.
- target pages ``ceil(keep * L * H / b)``; blocks to evict
  ``E_s = max(0, held_pages - target)``, capped by what the block schedule can
  evict without touching a protected KV (``evictable_blocks``).

Per-request overrides arrive in ``SamplingParams.extra_args`` (the OpenAI field
``vllm_xargs``): see ``REQUEST_FIELDS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcompress.config import KVCompressConfig
from kvcompress.policies import POLICY_NAMES


class RequestFieldError(ValueError):
    """A per-request kvcompress field is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


REQUEST_FIELDS = {
    "kv_compress": "false turns compression off for this request (true keeps the server's)",
    "kv_compress_rate": "compression rate >= 1 for this request (1 = no eviction)",
    "kv_compress_max_cache_tokens": "keep at most this many tokens' worth of KVs (>= 1)",
    "kv_compress_protected_window": "the last N tokens of this request are never evicted (>= 0)",
    "kv_compress_policy": "eviction policy for this request: " + ", ".join(POLICY_NAMES),
    "kv_compress_observation_window": "prompt queries that score keys in window mode (>= 1)",
}
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

    @property
    def compresses(self) -> bool:
        return self.enabled and (self.rate > 1.0 or self.max_cache_tokens is not None)


def _as_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise RequestFieldError(field, f"must be true or false, got {value!r}")


def _as_number(field: str, value: Any, kind: type, minimum: float) -> Any:
    if isinstance(value, bool) or value is None:
        raise RequestFieldError(field, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RequestFieldError(field, f"must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise RequestFieldError(field, f"must be finite, got {value!r}")
    if kind is int:
        if number != int(number):
            raise RequestFieldError(field, f"must be an integer, got {value!r}")
        number = int(number)
    if number < minimum:
        raise RequestFieldError(field, f"must be >= {minimum:g}, got {value!r}")
    return number


def request_budget(
    settings: KVCompressConfig, extra_args: dict[str, Any] | None
) -> RequestBudget:
    """Server settings overridden by the request's kvcompress fields.

    Raises ``RequestFieldError`` naming the field on an unknown ``kv_compress*`` key
    or an invalid value.
    """
    enabled = settings.enabled
    rate = settings.rate
    max_cache = settings.max_cache_tokens
    window = settings.protected_window
    policy = settings.policy
    observation_window = None
    for key, value in (extra_args or {}).items():
        if not key.startswith("kv_compress"):
            continue
        if key == "kv_compress":
            enabled = enabled and _as_bool(key, value)
        elif key == "kv_compress_rate":
            rate = _as_number(key, value, float, 1.0)
        elif key == "kv_compress_max_cache_tokens":
            max_cache = _as_number(key, value, int, 1)
        elif key == "kv_compress_protected_window":
            window = _as_number(key, value, int, 0)
        elif key == "kv_compress_policy":
            if not isinstance(value, str) or value.strip().lower() not in POLICY_NAMES:
                raise RequestFieldError(
                    key, f"must be one of {', '.join(POLICY_NAMES)}, got {value!r}"
                )
            policy = value.strip().lower()
        elif key == "kv_compress_observation_window":
            observation_window = _as_number(key, value, int, 1)
        else:
            raise RequestFieldError(
                key, f"unknown kvcompress field (known: {sorted(REQUEST_FIELDS)})"
            )
    if not settings.enabled and any(k.startswith("kv_compress") for k in extra_args or {}):
        raise RequestFieldError(
            next(k for k in extra_args if k.startswith("kv_compress")),
            "this server was started without --kv-compress",
        )
    return RequestBudget(
        enabled=enabled,
        rate=rate,
        max_cache_tokens=max_cache,
        protected_window=window,
        sink_tokens=settings.policy_for(policy).sink_tokens,
        min_cache_tokens=settings.min_cache_tokens,
        policy=policy,
        observation_window=observation_window,
    )


def protected_tokens(context_len: int, protected_window: int, sink_tokens: int) -> int:
    """Tokens of a ``context_len``-token sequence that may never be evicted."""
    return min(context_len, sink_tokens + protected_window)


def keep_tokens(context_len: int, budget: RequestBudget) -> int:
    """Tokens' worth of KVs kept per (layer, KV head) on average (module docstring)."""
    if not budget.compresses:
        return context_len
    protected = protected_tokens(context_len, budget.protected_window, budget.sink_tokens)
    keep = context_len
    if budget.rate > 1.0:
        keep = min(keep, max(budget.min_cache_tokens, math.ceil(context_len / budget.rate)) + protected)
    if budget.max_cache_tokens is not None:
        keep = min(keep, max(budget.max_cache_tokens, protected))
    return min(keep, context_len)


def target_pages(context_len: int, budget: RequestBudget, num_heads: int, block_size: int) -> int:
    """Pages a sequence may hold after compression; ``num_heads`` = layers x KV heads."""
    return -(-keep_tokens(context_len, budget) * num_heads // block_size)


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
    protected = protected_tokens(context_len, budget.protected_window, budget.sink_tokens)
    return min(wanted, evictable_blocks(lens, protected, block_size))
