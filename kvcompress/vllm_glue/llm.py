"""``kvcompress.LLM``: vLLM's offline ``LLM`` with kvcompress keyword arguments.

Equivalent to ``vllm.LLM(model, additional_config={"kvcompress": {...}})``. Also the
two engine helpers the benchmarks and tests share: ``page_stats`` and ``shutdown``.
"""

from __future__ import annotations

import gc
from typing import Any

from kvcompress.config import ADDITIONAL_CONFIG_KEY, FLAGS, KVCompressConfig

_PREFIX = "kv_compress_"


def LLM(model: str, *, kv_compress: bool = True, **kwargs: Any):  # noqa: N802 - reads like the class
    """Build a ``vllm.LLM`` whose KV cache is paged per (layer, KV head).

    Every setting of ``KVCompressConfig`` is a keyword ``kv_compress_<field>``
    (``kv_compress_rate=8``, ``kv_compress_protected_window=32``, ...); the rest go
    to ``vllm.LLM``. Settings are validated here (``KVCompressConfigError`` names the
    bad flag) before vLLM starts an engine.
    """
    from vllm import LLM as VllmLLM

    section: dict[str, Any] = {"enabled": kv_compress}
    for key in [k for k in kwargs if k.startswith(_PREFIX)]:
        field = key[len(_PREFIX):]
        if field not in FLAGS or field == "enabled":
            raise TypeError(f"kvcompress.LLM got an unknown setting {key!r}")
        value = kwargs.pop(key)
        if value is not None:
            section[field] = value
    KVCompressConfig.from_dict(section)
    additional = dict(kwargs.pop("additional_config", None) or {})
    additional[ADDITIONAL_CONFIG_KEY] = section
    return VllmLLM(model=model, additional_config=additional, **kwargs)


def page_stats(llm) -> dict:
    """Scheduler-side page counts and compression counters (engine-core process, or
    this one with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility("kvc_page_stats")
    return client.engine_core.kvc_page_stats()


def shutdown(llm) -> None:
    """Stop ``llm``'s engine core now (not at garbage collection) and collect."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()
