"""Checks that a vLLM KV-cache configuration fits the per-(layer, KV head) pool."""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)


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
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        raise ValueError(
            "--kv-compress does not support sliding-window or chunked-local attention"
        )
    return groups[0]


# The last page of vLLM's buffer is the scratch page: padding rows of decode steps
# (CUDA-graph batch padding) write their KVs there. It is never allocated.
SCRATCH_PAGES = 1


def pages_in_buffer(kv_cache_config: KVCacheConfig) -> int:
    """Pages of one (layer, KV head) that vLLM's KV buffer holds, scratch included."""
    group = single_full_attention_group(kv_cache_config)
    return kv_cache_config.num_blocks * len(group.layer_names) * group.kv_cache_spec.num_kv_heads


def pages_in_pool(kv_cache_config: KVCacheConfig) -> tuple[int, int, int]:
    """``(num_pages, num_layers, num_kv_heads)``: allocatable pages (the buffer's pages
    minus the scratch page), layers and KV heads. The scheduler and the worker both
    count from this."""
    group = single_full_attention_group(kv_cache_config)
    num_layers = len(group.layer_names)
    num_kv_heads = group.kv_cache_spec.num_kv_heads
    return pages_in_buffer(kv_cache_config) - SCRATCH_PAGES, num_layers, num_kv_heads
