"""Kernel layer: torch-only ops on the per-(layer, KV head) paged cache.

Importable without vLLM (the GPU machines have torch + triton but no vLLM).
"""

from kvcompress.ops.allocator import OutOfPagesError, PageAllocator
from kvcompress.ops.eviction import (
    EvictionPlan,
    evictable_blocks,
    protected_count,
    protected_slots,
    schedule_evictions,
)
from kvcompress.ops.move_cache import (
    CompressResult,
    compress_sequences,
    gather_logical,
    move_cache,
    plan_moves,
)
from kvcompress.ops.paged_attention import paged_attention, write_kv
from kvcompress.ops.paged_cache import AppendPlan, PerHeadPagedCache, fill_page_tables, pages_for

__all__ = [
    "AppendPlan",
    "CompressResult",
    "EvictionPlan",
    "OutOfPagesError",
    "PageAllocator",
    "PerHeadPagedCache",
    "compress_sequences",
    "evictable_blocks",
    "fill_page_tables",
    "gather_logical",
    "move_cache",
    "pages_for",
    "paged_attention",
    "plan_moves",
    "protected_count",
    "protected_slots",
    "schedule_evictions",
    "write_kv",
]
