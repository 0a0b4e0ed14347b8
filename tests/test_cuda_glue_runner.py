"""The CUDA model runner's pool life cycle, checked on CPU (issue 56): the per-head pool
built by the real ``_kvc_build_pool`` on a runner that vLLM did not construct (its
``__init__`` needs a device), with vLLM's own methods where they run on CPU."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from kvcompress.config import ADDITIONAL_CONFIG_KEY, KVCompressConfig

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 8, 64, 16


def _kv_cache_config(num_blocks: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    names = [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def _vllm_config(prefix_caching: bool):
    settings = KVCompressConfig(enabled=True, rate=8, block_size=BLOCK)
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=512, seed=0, get_num_attention_heads=lambda parallel: Q_HEADS),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, num_gpu_blocks=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=4, static_forward_context={}),
        additional_config={ADDITIONAL_CONFIG_KEY: settings.model_dump()},
    )


def pool_runner(num_blocks: int = 16, prefix_caching: bool = True):
    """A ``KVCompressGPUModelRunner`` holding a per-head pool over a CPU KV buffer, as
    ``initialize_kv_cache`` leaves it (vLLM's part of it: ``kv_caches``, ``kv_cache_config``)."""
    from kvcompress.vllm_glue.gpu_worker import KVCompressGPUModelRunner

    runner = KVCompressGPUModelRunner.__new__(KVCompressGPUModelRunner)
    config = _kv_cache_config(num_blocks)
    runner.vllm_config = _vllm_config(prefix_caching)
    runner.cache_config = runner.vllm_config.cache_config
    runner.compilation_config = runner.vllm_config.compilation_config
    runner.model = torch.nn.Linear(1, 1)  # no rotary embedding: kvc-ea's estimate is off
    page_bytes = 2 * BLOCK * HEAD_DIM * 4
    runner.kv_caches = [torch.zeros(num_blocks * LAYERS * KV_HEADS * page_bytes, dtype=torch.int8)]
    runner.kv_cache_config = config
    runner.attn_groups = []
    runner._kvc_build_pool(config)
    return runner


@pytest.fixture
def no_accelerator_sync(monkeypatch):
    """vLLM's cleanup synchronises and empties the accelerator's cache: none here."""
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda *args, **kwargs: None)


def test_profiling_cleanup_releases_the_pool_and_its_kv_buffer(no_accelerator_sync):
    """Item 6: vLLM's CUDA-graph memory profiling builds a minimal KV cache, then
    ``_cleanup_profiling_kv_cache`` drops vLLM's references and empties the allocator's
    cache. The worker state's pool views and the prefix groups' cache kept the buffer
    and the per-head tables alive until the real KV cache was built."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from kvcompress.vllm_glue import step as step_state

    runner = pool_runner()
    try:
        assert runner.kvc_prefix_groups is not None
        storage = StorageWeakRef(runner.kv_caches[0].untyped_storage())
        cache = weakref.ref(runner.kvc_cache)
        runner._cleanup_profiling_kv_cache()
        gc.collect()
        assert cache() is None, "the per-head cache outlived vLLM's cleanup"
        assert storage.expired(), "the KV buffer outlived vLLM's cleanup"
        assert runner.kvc_prefix_groups is None and step_state.get_worker_state() is None
    finally:
        step_state.set_worker_state(None)
        step_state.set_current_step(None)
