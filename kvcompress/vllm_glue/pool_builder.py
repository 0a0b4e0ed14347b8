"""The per-(layer, KV head) pool built over vLLM's KV buffer (``initialize_kv_cache``).

vLLM allocates one backing buffer for the KV cache; the worker views it as
``[2, buffer_pages, block_size, head_dim]`` pages (K region, then V region), the last page
being scratch for padding rows. Over those pages: the page cache (tables, allocator,
positions, metrics), the fixed-address decode buffers CUDA graphs replay, and the kernels
(``KernelOps``), chosen once for the engine's life. :func:`build_pool` returns them as one
:class:`BuiltPool`; the runner publishes its ``state`` for the attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

from kvcompress.ops import KernelOps, PerHeadPagedCache
from kvcompress.ops.dispatch import resolve_ops
from kvcompress.ops.expected_attention import RopeFrequencies, rope_frequencies
from kvcompress.page_accounting import cache_sequence_slots
from kvcompress.vllm_glue.kv_layout import (
    FP8_CACHE_DTYPES,
    MetadataRows,
    grant_pages_for,
    pages_in_pool,
    single_full_attention_group,
    with_pages_past_the_pool,
)
from kvcompress.vllm_glue.step import DecodeBuffers, WorkerCacheState

logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class PoolShape:
    """What vLLM's KV-cache configuration says about the pool: its layers (by vLLM's
    layer names), KV heads, page size (``block_size`` tokens of ``head_dim``), dtype,
    bytes per page (K and V), pages in the buffer, allocatable pages (those of vLLM's
    token blocks; the buffer holds the identity pages and the scratch page past them,
    ``kv_layout.with_pages_past_the_pool``) and where slot metadata lives (``rows``:
    the identity pages follow the allocatable ones)."""

    layer_names: tuple[str, ...]
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    page_bytes: int
    buffer_pages: int
    num_pages: int
    rows: MetadataRows = MetadataRows(None, 0)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def scratch_page(self) -> int:
        return self.buffer_pages - 1

    @classmethod
    def of(cls, kv_cache_config: KVCacheConfig, dtype: torch.dtype | None = None,
           rows: MetadataRows = MetadataRows(None, 0)) -> "PoolShape":
        """``dtype``: the pages' element type when it is not the spec's (FP8: vLLM's spec
        says bytes; :data:`~kvcompress.vllm_glue.kv_layout.FP8_CACHE_DTYPES`)."""
        group = single_full_attention_group(kv_cache_config)
        spec: FullAttentionSpec = group.kv_cache_spec
        dtype = spec.dtype if dtype is None else dtype
        if dtype.itemsize != spec.dtype.itemsize:
            raise ValueError(f"page dtype {dtype} does not match vLLM's KV-cache spec dtype {spec.dtype}")
        num_pages = pages_in_pool(kv_cache_config)[0]
        return cls(
            layer_names=tuple(group.layer_names), num_kv_heads=spec.num_kv_heads, block_size=spec.block_size,
            head_dim=spec.head_size, dtype=dtype, page_bytes=2 * spec.block_size * spec.head_size * dtype.itemsize,
            buffer_pages=num_pages + rows.pages_past_the_pool, num_pages=num_pages, rows=rows,
        )


@dataclass(frozen=True)
class BuiltPool:
    """The pool of one ``initialize_kv_cache``: its shape, the worker state the attention
    backend reads (cache, pool views, kernels, decode buffers, RoPE), and the padding
    rows' sequence slot."""

    shape: PoolShape
    state: WorkerCacheState
    pad_slot: int

    @property
    def cache(self) -> PerHeadPagedCache:
        return self.state.cache


def kv_pages(kv_cache: torch.Tensor, shape: PoolShape) -> torch.Tensor:
    """vLLM's KV buffer (any view of its backing storage) as ``[2, buffer_pages,
    block_size, head_dim]``: K region then V region, as vLLM's own caches (a head's
    pages, taken in ascending order by the allocator, read as two forward streams)."""
    flat = torch.empty(0, dtype=torch.int8, device=kv_cache.device)
    flat.set_(kv_cache.untyped_storage())
    needed = shape.buffer_pages * shape.page_bytes
    if needed > flat.numel():
        raise RuntimeError(
            f"KV buffer of {flat.numel()} bytes cannot hold {shape.buffer_pages} pages of {shape.page_bytes} bytes"
        )
    return flat[:needed].view(shape.dtype).view(2, shape.buffer_pages, shape.block_size, shape.head_dim)


def page_views(buffer: torch.Tensor, ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
    """K / V ``[num_pages, block_size, head_dim]`` views of ``buffer [2, N, b, D]``: in
    vLLM's CPU kernel layout when the attention runs on it, else row-major."""
    if ops.kernel_page_layout:
        from kvcompress.ops import cpu_attention

        return cpu_attention.pool_views(buffer)
    return buffer[0], buffer[1]


def metadata_views(pages: torch.Tensor, shape: PoolShape) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions int32, metrics float32)`` ``[(num_pages + identity_pages) *
    rows_per_page, block_size]``: the metadata rows carved from the K / V bytes of the
    allocatable and identity pages of ``pages [2, N, b, D]`` (row ``p * R + k`` is the
    ``k``-th ``block_size`` words of page ``p``)."""
    count = shape.num_pages + shape.rows.identity_pages
    rows = count * shape.rows.rows_per_page
    raw = pages[:, :count].view(torch.uint8)  # [2, count, b, D * itemsize], contiguous
    return (raw[0].view(torch.int32).reshape(rows, shape.block_size),
            raw[1].view(torch.float32).reshape(rows, shape.block_size))


def build_cache(shape: PoolShape, vllm_config, ops, device: torch.device,
                metadata: tuple[torch.Tensor, torch.Tensor] | None = None) -> PerHeadPagedCache:
    """The page cache: as many sequence slots as the scheduler admits (the budget's
    tables were sized for them), heads of up to ``max_model_len`` tokens, and, with
    prefix caching, room for shared pages within what ``PerHeadLayout`` reserved;
    ``metadata``: its rows carved from the pages (:func:`metadata_views`) when
    ``shape.rows`` says so."""
    max_pages_per_head = -(-vllm_config.model_config.max_model_len // shape.block_size)
    heads = shape.num_layers * shape.num_kv_heads
    shared_pages = 0
    if vllm_config.cache_config.enable_prefix_caching:
        shared_pages = min(max_pages_per_head, shape.num_pages // heads)
    identity_rows = shape.rows.rows_per_page is not None
    if identity_rows and not all(ops.backend(op).meta_rows for op in ops.backends):
        raise RuntimeError(f"kvcompress: identity metadata rows on {device} need ops that read them (resolved: {ops})")
    return PerHeadPagedCache(
        num_pages=shape.num_pages,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        block_size=shape.block_size,
        max_seqs=cache_sequence_slots(shape.num_pages, heads, vllm_config.scheduler_config.max_num_seqs),
        max_pages_per_head=max_pages_per_head,
        device=device,
        ops=ops,
        max_shared_pages_per_head=shared_pages,
        identity_rows=identity_rows,
        rows_per_page=shape.rows.rows_per_page or 1,
        metadata=metadata,
        grant_pages=grant_pages_for(shape.block_size, device),
    )


def buffer_config(kv_cache_config: KVCacheConfig, vllm_config, device_type) -> KVCacheConfig:
    """The configuration the runner hands vLLM's ``initialize_kv_cache``: the KV buffer grown
    by the pages past the pool (identity pages, scratch page:
    ``kv_layout.with_pages_past_the_pool``), which :func:`build_pool` then finds there."""
    rows = MetadataRows.of(kv_cache_config, vllm_config.model_config.max_model_len, device_type)
    return with_pages_past_the_pool(kv_cache_config, rows)


def build_pool(kv_cache: torch.Tensor, kv_cache_config: KVCacheConfig, vllm_config, *,
               metric_power: int, rope: RopeFrequencies | None) -> BuiltPool:
    """Pages over ``kv_cache``'s storage, the cache over them, the decode buffers (rows
    for the larger of ``max_num_seqs`` and the largest CUDA-graph batch) and the worker
    state; ``metric_power``: the decode metric power of the server's policy."""
    rows = MetadataRows.of(kv_cache_config, vllm_config.model_config.max_model_len, kv_cache.device.type)
    shape = PoolShape.of(kv_cache_config, FP8_CACHE_DTYPES.get(vllm_config.cache_config.cache_dtype), rows)
    pages = kv_pages(kv_cache, shape)
    ops = resolve_ops(pages.device)  # CUDA extension > Triton > reference, for the engine's life
    metadata = metadata_views(pages, shape) if rows.rows_per_page is not None else None
    cache = build_cache(shape, vllm_config, ops, pages.device, metadata)
    pad_slot = cache.new_sequence()
    capture_sizes = vllm_config.compilation_config.max_cudagraph_capture_size or 0
    decode_buffers = DecodeBuffers.allocate(
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        max_rows=max(vllm_config.scheduler_config.max_num_seqs, capture_sizes),
        num_slots=cache.max_seqs,
        pad_slot=pad_slot,
        scratch_page=shape.scratch_page,
        max_head_len=cache.max_pages_per_head * shape.block_size,
        block_size=shape.block_size,
        metric_power=metric_power,
        device=pages.device,
    )
    state = WorkerCacheState(
        cache=cache,
        pool=cache.kv_pool(*page_views(pages, ops)),
        ops=ops,
        layer_index={name: i for i, name in enumerate(shape.layer_names)},
        decode_buffers=decode_buffers,
        rope=None if rope is None else rope.to(pages.device),
    )
    return BuiltPool(shape=shape, state=state, pad_slot=pad_slot)


def model_rope(model) -> RopeFrequencies | None:
    """The model's RoPE frequencies and pairing, read from its first vLLM rotary
    embedding (``cos_sin_cache``, ``rotary_dim``, ``is_neox_style``), for the ``kvc-ea``
    policy's estimate; None (with a warning) when it has none that vLLM's base class
    describes, and ``kvc-ea`` then ranks by kvc's metrics alone."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase) and getattr(module, "cos_sin_cache", None) is not None:
            return RopeFrequencies(
                rope_frequencies(module.cos_sin_cache, module.rotary_dim), bool(module.is_neox_style),
            )
    logger.warning("kvcompress: no rotary embedding found in the model; --kv-compress-policy kvc-ea "
                   "ranks by kvc's metrics alone")
    return None
