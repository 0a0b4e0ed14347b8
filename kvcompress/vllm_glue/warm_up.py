"""JIT warm-up of steps with prompt rows, at engine start (CUDA).

vLLM arms its JIT monitor once its own warm-up and graph capture are done
(``Worker.compile_or_warm_up_model``): a Triton kernel compiled after that is logged
as a warning, or stops the step under ``--jit-monitor-mode error``. vLLM's warm-up
batches reach kvcompress's attention only decode-shaped (``warms_up_decode``), so
the first real step with prompt rows would compile vLLM's unified attention for
prompt chunks and the project's decode / reduce / metric kernels: seconds on the first
request's latency, after the monitor is armed.

:func:`warm_up_mixed_steps` runs such steps through the attention impl every layer
uses, over a scratch pool of its own with the engine's page shape, dtype and kernels
(``KernelOps``): the same kernel variants compile (Triton keys them on dtypes,
constexprs, pointer alignment and, for unannotated integers, divisibility by 16), and
the engine's pool (its pages, tables, free pages and metrics) is not touched. Later
steps may still compile a few variants (other partition sizes at long contexts, table
strides of other divisibility), as vLLM's own kernels may.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from kvcompress.ops import KernelOps, PerHeadPagedCache, pages_for
from kvcompress.ops.flattened import flat_query_starts
from kvcompress.vllm_glue import step as step_state
from kvcompress.vllm_glue.pool_builder import page_views
from kvcompress.vllm_glue.step import MetricQueries, PerHeadStep, StepTables, WorkerCacheState

# The name the warm-up's attention layer goes by in its scratch pool.
WARM_UP_LAYER = "kvcompress.warm_up"


@dataclass(frozen=True)
class WarmUpRow:
    """One batch row of a warm-up step: ``held`` tokens before the step, ``new`` this
    step (1: a decode row)."""

    held: int
    new: int


def warm_up_plans() -> tuple[tuple[WarmUpRow, ...], ...]:
    """Steps of two prompt chunks (a first and a later one) and two decode rows, the
    first of which adds to the metrics (:data:`METRIC_ROW`): heads within one decode
    partition, then a head past it (the split-softmax reduce kernel runs)."""
    from kvcompress.ops.triton_attention import DEFAULT_PARTITION_SIZE  # imports triton: lazily

    long_head = 2 * DEFAULT_PARTITION_SIZE + 3
    prompts = (WarmUpRow(0, 5), WarmUpRow(3, 4))
    return (
        (*prompts, WarmUpRow(9, 1), WarmUpRow(12, 1)),
        (*prompts, WarmUpRow(long_head, 1), WarmUpRow(12, 1)),
    )


METRIC_ROW = 2  # the first decode row of every plan


def mixed_warm_up_due(ops: KernelOps, vllm_config) -> bool:
    """On CUDA, unless vLLM's JIT warm-up is off (``kernel_config.enable_jit_warmup``:
    its monitor is not armed then, and the user chose a faster start)."""
    kernel_config = getattr(vllm_config, "kernel_config", None)
    return ops.device.type == "cuda" and getattr(kernel_config, "enable_jit_warmup", True)


def warm_up_mixed_steps(state: WorkerCacheState, num_q_heads: int, head_dim: int,
                        dtype: torch.dtype, metric_power: int) -> int:
    """Run every :func:`warm_up_plans` step through one layer's attention over a
    scratch pool (``state``'s kernels, KV heads and page size); returns the steps run.
    The worker state is ``state`` again afterwards."""
    for rows in warm_up_plans():
        _run_plan(state, rows, num_q_heads, head_dim, dtype, metric_power)
    return len(warm_up_plans())


def _run_plan(state: WorkerCacheState, rows: tuple[WarmUpRow, ...], num_q_heads: int,
              head_dim: int, dtype: torch.dtype, metric_power: int) -> None:
    from kvcompress.vllm_glue.attention_backend import KVCompressAttentionImpl, KVCompressAttentionMetadata

    scratch, step = _scratch_step(state, rows, head_dim, dtype, metric_power)
    num_kv_heads = scratch.cache.num_kv_heads
    impl = KVCompressAttentionImpl(num_q_heads, head_dim, head_dim ** -0.5, num_kv_heads, None, None, "auto")
    device = scratch.pool.device
    query = torch.zeros(step.num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(step.num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    output = torch.empty_like(query)
    metadata = KVCompressAttentionMetadata(num_actual_tokens=step.num_tokens, step=step)
    step_state.set_worker_state(scratch)
    try:
        impl.forward(SimpleNamespace(layer_name=WARM_UP_LAYER), query, kv, kv, None, metadata, output)
    finally:
        step_state.set_worker_state(state)


def _scratch_step(state: WorkerCacheState, rows: tuple[WarmUpRow, ...], head_dim: int,
                  dtype: torch.dtype, metric_power: int) -> tuple[WorkerCacheState, PerHeadStep]:
    """A one-layer pool holding ``rows``' earlier tokens, and the step adding their new
    ones (its decode row :data:`METRIC_ROW` adds to the metrics)."""
    engine = state.cache
    block_size, num_kv_heads, device = engine.block_size, engine.num_kv_heads, state.pool.device
    held = np.array([row.held for row in rows], dtype=np.int64)
    new = np.array([row.new for row in rows], dtype=np.int64)
    pages_per_head = int(pages_for(held + new, block_size).max())
    cache = PerHeadPagedCache(
        len(rows) * pages_per_head * num_kv_heads, 1, num_kv_heads, block_size, max_seqs=len(rows),
        max_pages_per_head=pages_per_head, device=device, ops=state.ops,
    )
    buffer = torch.zeros(2, cache.num_pages + 1, block_size, head_dim, dtype=dtype, device=device)
    slots = torch.tensor([cache.new_sequence() for _ in rows], dtype=torch.int64, device=device)
    earlier = held > 0
    cache.append(slots[torch.from_numpy(earlier).to(device)], torch.from_numpy(held[earlier]).to(device),
                 torch.cat([torch.arange(count) for count in held[earlier]]).to(device))
    positions = torch.cat([torch.arange(first, first + count) for first, count in zip(held, new)]).to(device)
    plan = cache.append(slots, torch.from_numpy(new).to(device), positions)
    query_start = [0, *np.cumsum(new).tolist()]
    tables, max_head_len = StepTables.for_rows(cache, slots, held + new)
    flags = torch.zeros(len(rows), dtype=torch.bool)
    flags[METRIC_ROW] = True
    step = PerHeadStep(
        num_reqs=len(rows), num_tokens=query_start[-1], query_start_loc=query_start,
        query_positions=positions, tables=tables, head_lens=cache.head_lens[slots],
        max_head_len=max_head_len, plan=plan,
        metrics=MetricQueries(prompt_rows=[], decode_seqs=flags.to(device), power=metric_power,
                              decode_seq_ids=np.array([METRIC_ROW], dtype=np.int64)),
        flat_query_start_loc=torch.from_numpy(flat_query_starts(query_start, num_kv_heads)).to(device),
    )
    scratch = WorkerCacheState(
        cache=cache, layer_index={WARM_UP_LAYER: 0}, pool=cache.kv_pool(*page_views(buffer, state.ops)),
        ops=state.ops,
    )
    return scratch, step
