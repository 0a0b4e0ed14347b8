"""The per-head metadata inside the KV memory budget.

Besides the pages, a kvcompress engine keeps per-head page tables and lengths (per
sequence slot), a position and a metric per KV slot, the allocator's free stack and the
decode buffers. All of it is sized from the engine's limits and taken out of the KV
memory vLLM reports (``kv_cache_memory_bytes`` or the profiled free memory) BEFORE vLLM
counts its blocks, so ``--kv-cache-memory-bytes`` / ``--gpu-memory-utilization`` bound
everything the per-head cache holds. The formulas live next to the allocations
(``PerHeadPagedCache.metadata_bytes``, ``DecodeBuffers.nbytes_for``); docs/ARCHITECTURE.md
keeps the table.

On a GPU whose KV memory vLLM profiled, the workspaces of one attention layer call
(``PerHeadLayout.transient_attention_bytes``) come out of it too: vLLM's profile run
builds no attention metadata, so it never sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

from kvcompress.ops.flattened import flat_prompt_workspace_bytes
from kvcompress.ops.page_tables import chunk_pages_for
from kvcompress.ops.paged_cache import SLOT_METADATA_BYTES, PerHeadPagedCache
from kvcompress.ops.triton_attention import decode_workspace_bytes
from kvcompress.ops.unified_attention import split_kv_workspace_bytes
from kvcompress.page_accounting import cache_sequence_slots
from kvcompress.vllm_glue.kv_layout import SCRATCH_PAGES, MetadataRows, page_dtype, uses_identity_rows
from kvcompress.vllm_glue.step import DecodeBuffers, StepTables

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
        num_q_heads: query heads (this rank; None: as many as KV heads).
        max_num_batched_tokens: the scheduler's tokens per step (None:
            ``max_model_len``); with ``num_q_heads`` it sizes the attention workspaces
            (:meth:`transient_attention_bytes`).
        identity_rows: the cache carves slot metadata from pages (on CPU:
            ``kv_layout.uses_identity_rows``): none outside the pool, the identity pages
            and compressing requests' row pages inside it (:attr:`identity_pages`).
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
    num_q_heads: int | None = None
    max_num_batched_tokens: int | None = None
    identity_rows: bool = False

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "PerHeadLayout":
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        capture = vllm_config.compilation_config.max_cudagraph_capture_size or 0
        return cls(
            num_layers=model.get_num_layers(parallel),
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_dim=model.get_head_size(),
            dtype_bytes=page_dtype(vllm_config.cache_config.cache_dtype, model.dtype).itemsize,
            block_size=vllm_config.cache_config.block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=model.max_model_len,
            max_rows=max(max_num_seqs, capture),
            prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
            num_q_heads=model.get_num_attention_heads(parallel),
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            identity_rows=uses_identity_rows(vllm_config.device_config.device_type),
        )

    @property
    def page_bytes(self) -> int:
        """K and V of one page (one layer, one KV head, ``block_size`` tokens)."""
        return 2 * self.block_size * self.head_dim * self.dtype_bytes

    @property
    def rows(self) -> MetadataRows:
        """Where slot metadata lives, counted as the runner's pool counts it
        (``MetadataRows.of``, from the same shape)."""
        return MetadataRows.for_shape(self.head_dim, self.dtype_bytes, self.max_pages_per_head, self.identity_rows)

    @property
    def identity_pages(self) -> int:
        """Pages past the pool the identity rows take (0 without ``identity_rows``)."""
        return self.rows.identity_pages

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

    @property
    def pages_past_the_pool(self) -> int:
        """Pages the KV buffer holds past the allocatable ones: the identity pages and the
        scratch page (``kv_layout.with_pages_past_the_pool``)."""
        return self.rows.pages_past_the_pool

    def metadata_bytes(self, num_pages: int, shared_pages_per_head: int = 0, max_seqs: int | None = None) -> int:
        """Everything but the allocatable pages, for a pool of ``num_pages`` of them and
        ``max_seqs`` sequence slots (default: :meth:`sequence_slots` of that pool): the
        cache's tables, the decode buffers and the pages past the pool."""
        if max_seqs is None:
            max_seqs = self.sequence_slots(num_pages)
        cache = PerHeadPagedCache.metadata_bytes(
            num_pages, self.num_layers, self.num_kv_heads, self.block_size, max_seqs,
            self.max_pages_per_head, shared_pages_per_head, self.identity_rows,
            self.rows.rows_per_page or 1,
        )
        buffers = DecodeBuffers.nbytes_for(self.num_layers, self.num_kv_heads, self.max_rows, max_seqs)
        return cache + buffers + self.pages_past_the_pool * self.page_bytes

    def metadata_breakdown(self, available: int) -> dict[str, int]:
        """Where ``available`` bytes of KV memory go (:meth:`page_bytes_for`): ``pages``
        (K and V, whole pages), ``slot_metadata`` (each KV slot's position and metric,
        8 bytes; with ``identity_rows`` the identity pages only: compressing requests'
        row pages are pool pages they hold), ``tables`` (page tables, head lengths, the
        allocator's free stack and page shares; on CPU also the page-to-row map and each
        sequence slot's row-page list),
        ``decode_buffers`` (with the scratch page their padding rows write) and ``unused``
        (vLLM counts whole token blocks of ``L x H`` pages). What stock vLLM gives to KVs
        alone, kvcompress splits this way."""
        shared = self.max_shared_pages_per_head(available)
        slots = self.slots_for_memory(available)
        block_pages = self.num_layers * self.num_kv_heads
        num_pages = self.page_bytes_for(available) // (self.page_bytes * block_pages) * block_pages
        if self.identity_rows:
            slot_metadata = self.identity_pages * self.page_bytes
        else:
            slot_metadata = num_pages * self.block_size * SLOT_METADATA_BYTES
        decode_buffers = (DecodeBuffers.nbytes_for(self.num_layers, self.num_kv_heads, self.max_rows, slots)
                          + SCRATCH_PAGES * self.page_bytes)
        tables = self.metadata_bytes(num_pages, shared, slots) - slot_metadata - decode_buffers
        pages = num_pages * self.page_bytes
        return {
            "pages": pages, "slot_metadata": slot_metadata, "tables": tables, "decode_buffers": decode_buffers,
            "unused": available - pages - slot_metadata - tables - decode_buffers,
        }  # fmt: skip

    def transient_attention_bytes(self) -> int:
        """Upper bound of the workspaces one attention layer call allocates (and frees)
        on the CUDA path, whatever the step: a mixed step's gathered tables
        (``StepTables.layer``) and flattened prompt call (vLLM's unified attention), a
        decode launch (a mixed step's metric pass or its decode rows on the project's
        Triton, or an eager decode-only step of up to ``max_rows`` rows) with its metric
        flags, and the split-KV scratch of vLLM's kernel. Worst case: every sequence in
        one step of ``max_num_batched_tokens`` rows, heads of ``max_model_len``."""
        tokens = self.max_num_batched_tokens or self.max_model_len
        q_heads = self.num_q_heads or self.num_kv_heads
        seqs = min(self.max_num_seqs, tokens)  # a sequence has at least one row
        pages = self.max_pages_per_head
        tables = StepTables.layer_nbytes(seqs, self.num_kv_heads, pages, chunk_pages_for(pages))
        prompt = flat_prompt_workspace_bytes(
            tokens, seqs, self.num_kv_heads, q_heads, self.head_dim, self.dtype_bytes, pages,
        )
        decode = decode_workspace_bytes(max(seqs, self.max_rows), q_heads, self.head_dim) + seqs
        split_kv = split_kv_workspace_bytes(max(1, q_heads // self.num_kv_heads), self.head_dim)
        return tables + prompt + decode + split_kv

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
        # At least one page per (layer, KV head) (the scratch page is in ``fixed``).
        least = self.num_layers * self.num_kv_heads * (self.page_bytes + per_page)
        if room < least:
            raise ValueError(
                f"--kv-compress: the per-head page tables for --max-num-seqs {self.max_num_seqs} x "
                f"--max-model-len {self.max_model_len} take {fixed / GIB:.2f} GiB, and the KV memory "
                f"is {available / GIB:.2f} GiB: lower --max-num-seqs or --max-model-len, or give "
                "more KV memory (--kv-cache-memory-bytes / --gpu-memory-utilization)"
            )
        return room * self.page_bytes // (self.page_bytes + per_page)


def profiled_on_gpu(vllm_config) -> bool:
    """Whether vLLM measured the KV memory in a profile run on a GPU, rather than being
    given it (``kv_cache_memory_bytes``: vLLM then leaves activations to the user, and
    so does kvcompress; CPU engines are always given theirs)."""
    return vllm_config.device_config.device_type == "cuda" and not vllm_config.cache_config.kv_cache_memory_bytes


class KVCompressWorkerMemory:
    """Worker mixin: the KV memory vLLM counts blocks in is what is left for pages after
    the per-head metadata (``PerHeadLayout.page_bytes_for``) and, where vLLM profiled it
    on a GPU, the attention workspaces its profile run does not see
    (``PerHeadLayout.transient_attention_bytes``)."""

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        layout = PerHeadLayout.from_vllm_config(self.vllm_config)
        workspace = layout.transient_attention_bytes() if profiled_on_gpu(self.vllm_config) else 0
        for_pages = layout.page_bytes_for(available - workspace)
        logger.info(
            "kvcompress: %.3f GiB of the %.3f GiB KV memory hold per-head metadata (page tables "
            "for %d sequences x %d tokens, slot positions and metrics), %.3f GiB are left for "
            "attention workspaces; %.3f GiB go to pages",
            (available - workspace - for_pages) / GIB, available / GIB,
            layout.slots_for_memory(available - workspace) - 1, layout.max_model_len, workspace / GIB,
            for_pages / GIB,
        )
        return for_pages
