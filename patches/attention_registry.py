"""Patch: route vLLM's attention-backend choice to the per-head paged backend.

CPU: ``CpuPlatform.get_attn_backend_cls`` ignores the user's backend choice and
always returns ``CPU_ATTN``; overriding that registry entry is the only way in.
The override is held only while a kvcompress worker builds its model, so a stock
engine in the same process keeps vLLM's own backend. The selector's cache is
cleared on both edges because it would otherwise remember either choice.

CUDA: the platform honours ``attention_config.backend``. kvcompress registers its
backend as ``AttentionBackendEnum.CUSTOM`` through vLLM's public
``register_backend`` (every process: the plugin runs in each) and the engine setup
selects ``CUSTOM`` for kvcompress engines only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from vllm.v1.attention import selector
from vllm.v1.attention.backends.registry import (
    _ATTN_OVERRIDES,
    AttentionBackendEnum,
    register_backend,
)

BACKEND_PATH = "kvcompress.vllm_glue.attention_backend.KVCompressAttentionBackend"


class AttentionBackendConflictError(RuntimeError):
    """Another package already registered vLLM's ``CUSTOM`` attention backend."""


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


def register_cuda_backend() -> None:
    """Register the per-head backend as ``CUSTOM`` (idempotent; refuses to replace
    another package's ``CUSTOM`` backend)."""
    member = AttentionBackendEnum.CUSTOM
    current = _ATTN_OVERRIDES.get(member)
    if current == BACKEND_PATH:
        return
    if current is not None:
        raise AttentionBackendConflictError(
            f"vLLM's CUSTOM attention backend is already registered as {current}; "
            "kvcompress registers its per-head paged backend there on CUDA. "
            "Remove the other registration to use --kv-compress."
        )
    register_backend(member, BACKEND_PATH)
    selector._cached_get_attn_backend.cache_clear()
