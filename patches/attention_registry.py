"""Patch: point vLLM's ``CPU_ATTN`` backend at the per-head paged backend.

Why: on CPU, ``CpuPlatform.get_attn_backend_cls`` ignores the user's backend choice
and always returns ``CPU_ATTN``; overriding that registry entry is the only way in.
The override is held only while a kvcompress worker builds its model, so a stock
engine in the same process keeps vLLM's own backend. The selector's cache is
cleared on both edges because it would otherwise remember either choice.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from vllm.v1.attention import selector
from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

BACKEND_PATH = "kvcompress.vllm_glue.attention_backend.PerHeadAttentionBackend"


@contextlib.contextmanager
def per_head_attention_backend() -> Iterator[None]:
    member = AttentionBackendEnum.CPU_ATTN
    previous = _ATTN_OVERRIDES.get(member)
    _ATTN_OVERRIDES[member] = BACKEND_PATH
    selector._cached_get_attn_backend.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            _ATTN_OVERRIDES.pop(member, None)
        else:
            _ATTN_OVERRIDES[member] = previous
        selector._cached_get_attn_backend.cache_clear()
