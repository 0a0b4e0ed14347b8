"""Checks that a vLLM KV-cache configuration fits the per-(layer, KV head) pool."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)

from kvcompress.ops.paged_cache import identity_pages_for, rows_per_page_for


def single_full_attention_group(kv_cache_config: KVCacheConfig) -> KVCacheGroupSpec:
    """The one KV-cache group of plain full attention, or a clear error."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ValueError(
            "--kv-compress supports models whose layers all use full attention "
            f"(one KV-cache group); this model has {len(groups)} groups: {kinds}"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec):
        raise ValueError(
            f"--kv-compress does not support KV-cache spec {type(spec).__name__} "
            "(sliding-window, MLA and hybrid layers are not per-head pageable)"
        )
    # A sliding window on the group's spec comes from sliding-window layers vLLM promoted
    # to full-attention allocation (kvcompress turns the hybrid KV cache manager off for
    # them): every layer's KVs are paged here, its window applied by attention.
    if spec.attention_chunk_size is not None:
        raise ValueError("--kv-compress does not support chunked-local attention")
    return groups[0]


# Opt-in for sliding-window models on CUDA: their window is applied by kvcompress's
# Triton kernels (checked in Triton's CPU interpreter), but no such model has run on a GPU
# yet (the GPU kit's ``windows`` case sets it).
CUDA_SLIDING_WINDOW_ENV = "KVCOMPRESS_CUDA_SLIDING_WINDOW"


def sliding_windows_allowed(platform=None) -> bool:
    """Whether kvcompress takes sliding-window layers here: on CPU (vLLM's CPU kernel and
    the reference apply the window), and on CUDA with ``KVCOMPRESS_CUDA_SLIDING_WINDOW=1``
    (the Triton kernels do; the CUDA extension's decode hands such layers to them)."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    return platform.is_cpu() or os.environ.get(CUDA_SLIDING_WINDOW_ENV) == "1"


def model_layer_windows(model_config, layer_indices) -> tuple[int | None, ...]:
    """The sliding window (tokens) of each of the model's layers ``layer_indices``, None
    for full attention, from its config as vLLM's models read it: ``sliding_window`` on
    the layers ``layer_types`` calls ``sliding_attention`` (every layer when the config
    has a window and no ``layer_types``)."""
    layer_indices = list(layer_indices)
    window = model_config.get_sliding_window()
    if window is None:
        return (None,) * len(layer_indices)
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    if not layer_types:
        return (int(window),) * len(layer_indices)
    return tuple(int(window) if layer_types[i] == "sliding_attention" else None for i in layer_indices)


def layer_windows(vllm_config, layer_names: list[str]) -> tuple[int | None, ...]:
    """:func:`model_layer_windows` of the pool's layers (vLLM's attention layer names)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return model_layer_windows(vllm_config.model_config, (extract_layer_index(name) for name in layer_names))


def layer_windows_checked(vllm_config, layer_names: list[str]) -> tuple[int | None, ...]:
    """:func:`layer_windows`, checked against the window each layer's attention was
    built with (the worker has the layers): the scheduler counts pages from the config
    alone, so the two must agree."""
    windows = layer_windows(vllm_config, layer_names)
    context = vllm_config.compilation_config.static_forward_context
    for name, window in zip(layer_names, windows):
        built = getattr(getattr(context.get(name), "impl", None), "sliding_window", window)
        if built != window:
            raise ValueError(
                f"--kv-compress: layer {name} attends within a window of {built} tokens but the "
                f"model config says {window}; kvcompress cannot tell which layers to compress"
            )
    return windows


def compressible_layers(windows: tuple[int | None, ...]) -> tuple[int, ...]:
    """The pool layers compression may shrink: the full-attention ones (a sliding-window
    layer keeps every KV, so that its slots hold consecutive positions)."""
    return tuple(layer for layer, window in enumerate(windows) if window is None)


# The last page of the KV buffer is the scratch page: padding rows of decode steps
# (CUDA-graph batch padding) write their KVs there. It is never allocated.
SCRATCH_PAGES = 1


def pages_in_pool(kv_cache_config: KVCacheConfig) -> tuple[int, int, int]:
    """``(num_pages, num_layers, num_kv_heads)``: allocatable pages (every page of vLLM's
    token blocks: ``num_blocks x L x H``), layers and KV heads. The scheduler and the
    worker both count from this."""
    group = single_full_attention_group(kv_cache_config)
    num_layers = len(group.layer_names)
    num_kv_heads = group.kv_cache_spec.num_kv_heads
    return kv_cache_config.num_blocks * num_layers * num_kv_heads, num_layers, num_kv_heads


def page_bytes_of(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one page (K and V of one layer's KV head, ``block_size`` tokens)."""
    spec = single_full_attention_group(kv_cache_config).kv_cache_spec
    return spec.page_size_bytes // spec.num_kv_heads


def with_pages_past_the_pool(kv_cache_config: KVCacheConfig, rows: "MetadataRows") -> KVCacheConfig:
    """vLLM's KV-cache configuration with its backing buffer grown by the pages kvcompress
    keeps past the pool: the identity pages (``rows``) and the scratch page. The KV memory
    budget paid for them beside the tables (``memory.PerHeadLayout.metadata_bytes``), so
    every page of vLLM's token blocks is allocatable; vLLM's own views of the buffer
    (its first ``num_blocks`` blocks) are unchanged. A copy: the caller's is untouched."""
    grown = copy.deepcopy(kv_cache_config)
    extra = rows.pages_past_the_pool * page_bytes_of(kv_cache_config)
    for tensor in grown.kv_cache_tensors:
        tensor.size += extra
    return grown


def uses_identity_rows(device_type: torch.device | str) -> bool:
    """Whether the engine keeps slot metadata in rows carved from pages, never-compressing
    requests on identity rows (``PerHeadPagedCache(identity_rows=True)``): on CPU, whose
    ops all read ``page_meta_row``; not on CUDA, whose kernels index metadata by page id
    until a GPU run has checked them reading rows (docs/design-61-metadata-rows.md)."""
    return torch.device(device_type).type == "cpu"


# Stock vLLM's default block size (tokens) where kvcompress runs: what a request that never
# compresses is counted in (grant_pages_for), so that it is admitted and preempted when it
# would be without kvcompress.
STOCK_BLOCK_SIZES = {"cpu": 128}
STOCK_BLOCK_SIZE_ELSEWHERE = 16


def grant_pages_for(block_size: int, device_type) -> int:
    """Pages of ``block_size`` tokens a never-compressing request's heads are counted in
    (``PageAccounting(grant_pages=)``, ``PerHeadPagedCache(grant_pages=)``): stock vLLM's
    block on this device over the page, at least 1 (CPU: 128 / 64 = 2; CUDA: 16 / 16)."""
    stock = STOCK_BLOCK_SIZES.get(torch.device(device_type).type, STOCK_BLOCK_SIZE_ELSEWHERE)
    return max(1, stock // block_size)


@dataclass(frozen=True)
class MetadataRows:
    """Where slot positions and metrics live, as the scheduler and the worker both count
    it: ``rows_per_page`` rows carved from each page (None: a row of their own per page,
    outside the pool) and ``identity_pages`` of the pool holding the identity rows."""

    rows_per_page: int | None
    identity_pages: int

    @property
    def pages_past_the_pool(self) -> int:
        """Pages the KV buffer holds past the allocatable ones: the identity pages and the
        scratch page (:func:`with_pages_past_the_pool`)."""
        return self.identity_pages + SCRATCH_PAGES

    @classmethod
    def for_shape(cls, head_dim: int, dtype_bytes: int, max_pages_per_head: int, identity_rows: bool) -> "MetadataRows":
        """The rows of pages of ``head_dim`` x ``dtype_bytes`` K / V values, with identity
        rows for a head of ``max_pages_per_head`` pages (none without ``identity_rows``)."""
        if not identity_rows:
            return cls(None, 0)
        per_page = rows_per_page_for(head_dim, dtype_bytes)
        return cls(per_page, identity_pages_for(max_pages_per_head, per_page))

    @classmethod
    def of(cls, kv_cache_config: KVCacheConfig, max_model_len: int, device_type) -> "MetadataRows":
        spec = single_full_attention_group(kv_cache_config).kv_cache_spec
        return cls.for_shape(
            spec.head_size, spec.dtype.itemsize, -(-max_model_len // spec.block_size), uses_identity_rows(device_type)
        )


# vLLM's --kv-cache-dtype values kvcompress pages hold, as the element type of the pages
# (vLLM allocates FP8 caches as bytes; "fp8" is E4M3, as on vLLM's CUDA and CPU kernels).
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def page_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the pages for vLLM's ``cache_config.cache_dtype``: the model's
    dtype for "auto", a float8 type for the FP8 values (:data:`FP8_CACHE_DTYPES`)."""
    problem = kv_cache_dtype_problem(cache_dtype)
    if problem:
        raise ValueError(f"--kv-compress does not support {problem}")
    return model_dtype if cache_dtype == "auto" else FP8_CACHE_DTYPES[cache_dtype]


def kv_cache_dtype_problem(cache_dtype: str) -> str | None:
    """Why the pages cannot hold ``--kv-cache-dtype cache_dtype``, or None. FP8 pages (unit
    scales) are read on CPU by the PyTorch reference attention, on CUDA by vLLM's Triton
    unified attention and the project's Triton kernels (the CUDA C++ decode kernel takes
    only pages of the query's dtype and leaves FP8 to them). Asked by the engine setup
    (before any worker starts) and by the attention backend's ``supports_kv_cache_dtype``."""
    if cache_dtype == "auto" or cache_dtype in FP8_CACHE_DTYPES:
        return None
    return f"--kv-cache-dtype {cache_dtype} (kvcompress pages hold auto, {', '.join(FP8_CACHE_DTYPES)})"
