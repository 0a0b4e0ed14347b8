"""The vLLM engine arguments the SmolLM2 benchmarks (and their tests) share.

Every comparison runs stock vLLM and kvcompress with the same arguments, so what differs
between scripts is only how large a run is; this module holds the rest, once.
"""

from __future__ import annotations

from typing import Any


def eager_float32_engine_args(**sized: Any) -> dict[str, Any]:
    """``dtype="float32"`` (SmolLM2's bf16 checkpoint upcast: bf16 matmuls are slow on CPUs
    without AMX), eager, then ``sized`` (the run's ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``kv_cache_memory_bytes`` in bytes), then no prefix caching
    (every prompt computed, the same for both engines) and ``seed=0``.

    The keys keep that order: results files record these arguments as given.
    """
    return dict(dtype="float32", enforce_eager=True, **sized, enable_prefix_caching=False, seed=0)


def stock_cache_dtype(kv_cache_dtype: str) -> str:
    """Stock vLLM's ``--kv-cache-dtype`` beside kvcompress's: the same, unless that is FP8
    and vLLM's CPU kernel refuses FP8 caches here (then the model's dtype)."""
    if kv_cache_dtype == "auto":
        return "auto"
    from kvcompress.ops import cpu_attention

    return "auto" if cpu_attention.fp8_unavailable_reason() else kv_cache_dtype
