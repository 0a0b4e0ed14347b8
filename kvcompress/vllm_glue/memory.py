"""The per-head metadata inside the KV memory budget.

Besides the pages, a kvcompress engine keeps per-head page tables and lengths (per
sequence slot), a position and a metric per KV slot, the allocator's free stack and the
decode buffers. All of it is sized from the engine's limits and taken out of the KV
memory vLLM reports (``kv_cache_memory_bytes`` or the profiled free memory) BEFORE vLLM
counts its blocks, so ``--kv-cache-memory-bytes`` / ``--gpu-memory-utilization`` bound
everything the per-head cache holds. The formulas live next to the allocations
(``PerHeadPagedCache.metadata_bytes``, ``DecodeBuffers.nbytes_for``); docs/ARCHITECTURE.md
keeps the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

from kvcompress.ops.page_tables import chunk_pages_for
from kvcompress.page_accounting import cache_sequence_slots
from kvcompress.ops.paged_cache import PerHeadPagedCache
from kvcompress.vllm_glue.step import DecodeBuffers

logger = init_logger(f"vllm.{__name__}")

GIB = 1 << 30


@dataclass(frozen=True)
class PerHeadLayout:
    """The dimensions that size a kvcompress engine's pool and metadata.

    Attributes:
        num_layers, num_kv_heads, head_dim: the model's attention shape (this rank).
        dtype_bytes: bytes per K or V element.
        block_size: tokens per page.
        max_num_seqs: the scheduler's limit; the cache has slots for as many sequences
            or for as many as the pool gives one page per (layer, KV head), whichever
            is fewer (:meth:`sequence_slots`), and one more: the padding rows' empty one.
        max_model_len: the longest sequence (sizes each head's page table).
        max_rows: rows of the decode buffers (max_num_seqs or the largest CUDA graph).
        prefix_caching: prefix-cache hits copy page ids of shared prefixes into each
            holder's tables (``max_shared_pages_per_head``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_rows: int
    prefix_caching: bool = False

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "PerHeadLayout":
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        capture = vllm_config.compilation_config.max_cudagraph_capture_size or 0
        return cls(
            num_layers=model.get_num_layers(parallel),
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_dim=model.get_head_size(),
            dtype_bytes=model.dtype.itemsize,
            block_size=vllm_config.cache_config.block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=model.max_model_len,
            max_rows=max(max_num_seqs, capture),
            prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        )

    @property
    def page_bytes(self) -> int:
        """K and V of one page (one layer, one KV head, ``block_size`` tokens)."""
        return 2 * self.block_size * self.head_dim * self.dtype_bytes

    def sequence_slots(self, num_pages: int) -> int:
        """Sequence slots of the cache over a pool of ``num_pages`` pages (the runner's
        :func:`~kvcompress.page_accounting.cache_sequence_slots`)."""
        return cache_sequence_slots(num_pages, self.num_layers * self.num_kv_heads, self.max_num_seqs)

    @property
    def max_pages_per_head(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def max_shared_pages_per_head(self, kv_bytes: int) -> int:
        """The longest shared prefix a head can adopt (pages) in ``kv_bytes`` of KV
        memory: every token block of the pool, at most a whole sequence; 0 without
        prefix caching. The page tables have room for every sequence slot's copy."""
        if not self.prefix_caching:
            return 0
        blocks = kv_bytes // (self.page_bytes * self.num_layers * self.num_kv_heads)
        return min(self.max_pages_per_head, blocks)

    def metadata_bytes(self, num_pages: int, shared_pages_per_head: int = 0, max_seqs: int | None = None) -> int:
        """Everything but the pages, for a pool of ``num_pages`` allocatable pages and
        ``max_seqs`` sequence slots (default: :meth:`sequence_slots` of that pool)."""
        if max_seqs is None:
            max_seqs = self.sequence_slots(num_pages)
        cache = PerHeadPagedCache.metadata_bytes(
            num_pages, self.num_layers, self.num_kv_heads, self.block_size, max_seqs,
            self.max_pages_per_head, shared_pages_per_head,
        )
        buffers = DecodeBuffers.nbytes_for(self.num_layers, self.num_kv_heads, self.max_rows, max_seqs)
        return cache + buffers

    def slots_for_memory(self, available: int) -> int:
        """Sequence slots the tables are sized for in ``available`` bytes of KV memory:
        those of the most pages it could hold (the pool gets fewer once the metadata is
        taken out, and the worker's cache fewer or as many slots)."""
        return self.sequence_slots(available // self.page_bytes)

    def page_bytes_for(self, available: int) -> int:
        """Of ``available`` bytes of KV memory, what may go to pages so that the pages'
        own metadata fits in the rest; raises naming the flags when the fixed part (the
        page tables) does not fit at all."""
        shared = self.max_shared_pages_per_head(available)
        slots = self.slots_for_memory(available)
        fixed = self.metadata_bytes(0, shared, slots)
        # Linear but for whole chunks of page ids: the slope over one chunk bounds it.
        span = chunk_pages_for(self.max_pages_per_head)
        per_page = -(-(self.metadata_bytes(span, shared, slots) - fixed) // span)
        room = available - fixed
        # At least one page per (layer, KV head) and the scratch page.
        least = (self.num_layers * self.num_kv_heads + 1) * (self.page_bytes + per_page)
        if room < least:
            raise ValueError(
                f"--kv-compress: the per-head page tables for --max-num-seqs {self.max_num_seqs} x "
                f"--max-model-len {self.max_model_len} take {fixed / GIB:.2f} GiB, and the KV memory "
                f"is {available / GIB:.2f} GiB: lower --max-num-seqs or --max-model-len, or give "
                "more KV memory (--kv-cache-memory-bytes / --gpu-memory-utilization)"
            )
        return room * self.page_bytes // (self.page_bytes + per_page)


class PerHeadMemoryBudget:
    """Worker mixin: the KV memory vLLM counts blocks in is what is left for pages after
    the per-head metadata (``PerHeadLayout.page_bytes_for``)."""

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        layout = PerHeadLayout.from_vllm_config(self.vllm_config)
        for_pages = layout.page_bytes_for(available)
        logger.info(
            "kvcompress: %.3f GiB of the %.3f GiB KV memory hold per-head metadata (page tables "
            "for %d sequences x %d tokens, slot positions and metrics); %.3f GiB go to pages",
            (available - for_pages) / GIB, available / GIB, layout.slots_for_memory(available) - 1,
            layout.max_model_len, for_pages / GIB,
        )
        return for_pages
