"""Kernel layer: torch-only ops on the per-(layer, KV head) paged cache.

Importable without vLLM (the GPU machines have torch + triton but no vLLM).
"""

from kvcompress.ops.allocator import OutOfPagesError, PageAllocator
from kvcompress.ops.paged_attention import paged_attention, write_kv
from kvcompress.ops.paged_cache import AppendPlan, PerHeadPagedCache, pages_for

__all__ = [
    "AppendPlan",
    "OutOfPagesError",
    "PageAllocator",
    "PerHeadPagedCache",
    "pages_for",
    "paged_attention",
    "write_kv",
]
