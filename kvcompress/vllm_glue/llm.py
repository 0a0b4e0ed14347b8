"""``kvcompress.LLM``: vLLM's offline ``LLM`` with kvcompress keyword arguments.

Equivalent to ``vllm.LLM(model, additional_config={"kvcompress": {...}})``.
"""

from __future__ import annotations

from typing import Any

from kvcompress.config import ADDITIONAL_CONFIG_KEY, KVCompressConfig


def LLM(  # noqa: N802 - reads like the class it builds
    model: str,
    *,
    kv_compress: bool = True,
    kv_compress_rate: float | None = None,
    kv_compress_max_cache_tokens: int | None = None,
    kv_compress_protected_window: int | None = None,
    kv_compress_block_size: int | None = None,
    **kwargs: Any,
):
    """Build a ``vllm.LLM`` whose KV cache is paged per (layer, KV head).

    Settings are validated here (``KVCompressConfigError`` names the bad flag)
    before vLLM starts an engine.
    """
    from vllm import LLM as VllmLLM

    section = {"enabled": kv_compress}
    for field, value in (
        ("rate", kv_compress_rate),
        ("max_cache_tokens", kv_compress_max_cache_tokens),
        ("protected_window", kv_compress_protected_window),
        ("block_size", kv_compress_block_size),
    ):
        if value is not None:
            section[field] = value
    KVCompressConfig.from_dict(section)
    additional = dict(kwargs.pop("additional_config", None) or {})
    additional[ADDITIONAL_CONFIG_KEY] = section
    return VllmLLM(model=model, additional_config=additional, **kwargs)
