"""Kernel layer: torch-only ops on the per-(layer, KV head) paged cache.

Importable without vLLM (the GPU machines have torch + triton but no vLLM).
"""

from kvcompress.ops.allocator import OutOfPagesError, PageAllocator
from kvcompress.ops.compress import CompressResult, compress_sequences, gather_logical
from kvcompress.ops.dispatch import KernelOps, resolve_ops
from kvcompress.ops.eviction import (
    EvictionPlan,
    evictable_blocks,
    protected_count,
    protected_slots,
    schedule_evictions,
)
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch
from kvcompress.ops.move_cache import move_cache, plan_moves
from kvcompress.ops.page_tables import fill_page_tables
from kvcompress.ops.reference_attention import reference_paged_attention, reference_write_kv
from kvcompress.ops.paged_cache import AppendPlan, PerHeadPagedCache, pages_for

__all__ = [
    "AppendPlan",
    "CompressResult",
    "EvictionPlan",
    "KVPool",
    "KernelOps",
    "MetricSink",
    "OutOfPagesError",
    "PageAllocator",
    "PagedBatch",
    "PerHeadPagedCache",
    "SlotBatch",
    "compress_sequences",
    "evictable_blocks",
    "fill_page_tables",
    "gather_logical",
    "move_cache",
    "pages_for",
    "reference_paged_attention",
    "plan_moves",
    "protected_count",
    "protected_slots",
    "resolve_ops",
    "schedule_evictions",
    "reference_write_kv",
]
