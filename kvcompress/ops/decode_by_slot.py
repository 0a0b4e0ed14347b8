"""Decode attention that reads the page tables of all sequence slots (graph-capturable).

The batched decode of :func:`kvcompress.ops.reference_attention.reference_paged_attention` takes
tables gathered for the step's batch and a host-side ``query_start_loc``; both
change every step. A CUDA graph needs every tensor it reads at a fixed address and
every launch shape fixed. Here the kernel reads the cache's own per-slot state
through a small index instead (a :class:`~kvcompress.ops.kv_pool.SlotBatch`):

- ``block_tables``: ``[num_slots, num_kv_heads, P]`` page ids of ONE layer for every
  sequence slot, or, with ``chunks``, the engine's two-level tables: chunk ids (a strided
  view of ``PerHeadPagedCache.tables.chunk_tables[:, layer]``) and the page-id chunks;
- ``head_lens``: ``[num_slots, num_kv_heads]`` (a view of ``head_lens[:, layer]``);
- ``seq_slots``: ``[B]`` int32, query row ``b`` belongs to sequence slot ``seq_slots[b]``
  (padding rows point at a slot whose heads are empty, so they read nothing and
  get zeros);
- ``max_head_len``: a fixed upper bound of the head lengths (``max_model_len``), so
  the partition grid does not depend on the step;

and a :class:`~kvcompress.ops.kv_pool.MetricSink` over the slots: ``[num_slots]``
int8/bool, slots whose decode query adds its attention to the eviction metrics
(continual compression).

Nothing here reads a device value on the host. The Triton version
(:func:`kvcompress.ops.triton_attention.paged_decode_by_slot_triton`) launches the
same decode / reduce / metric kernels as the general Triton path; this module's
reference is its oracle and the CPU path.
"""

from __future__ import annotations

import torch

from kvcompress.ops.kv_pool import KVPool, MetricSink, SlotBatch
from kvcompress.ops.reference_attention import reference_paged_attention


MAX_GRAPH_PARTITIONS = 64


WIDE_BATCH_HEAD_ROWS = 512
"""(row, KV head) pairs of a decode batch from which 2048-key partitions replace 512-key
ones: the rows alone fill the GPU and fewer partitions cut the split-softmax work. H200,
Llama-3.1-8B layer, bf16, every head at full length, graph replay: batch 256 x 32K
8.18 vs 9.05 ms (stock vLLM's kernel 8.72), 256 x 4K 1.09 vs 1.16 (stock 1.11), 64 x 4K
0.307 vs 0.311 (stock 0.289)."""


def graph_partition_size(max_head_len: int, block_size: int, head_rows: int = 0) -> int:
    """Keys per decode partition for a grid sized by ``max_head_len``: 512, or 2048 for
    batches of at least ``WIDE_BATCH_HEAD_ROWS`` (row, KV head) pairs (``head_rows``,
    fixed per captured graph); whole pages, and at most ``MAX_GRAPH_PARTITIONS``
    partitions per head whatever ``max_model_len`` is (most of a fixed grid's programs
    exit at once)."""
    base = 2048 if head_rows >= WIDE_BATCH_HEAD_ROWS else 512
    partition = max(base, -(-max_head_len // MAX_GRAPH_PARTITIONS))
    return -(-partition // block_size) * block_size


def paged_decode_by_slot_reference(
    query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None,
) -> torch.Tensor:
    """One query token per row over slot-indexed page tables (PyTorch reference).

    Args:
        query: ``[B, num_q_heads, D]``, row ``b`` is the decode query of slot
            ``batch.seq_slots[b]``.
        pool: the page pool (K, V ``[num_pages, block_size, D]``, slot positions and
            metrics).
        batch: ``block_tables [num_slots, num_kv_heads, P]`` and ``head_lens
            [num_slots, num_kv_heads]`` of this layer for all slots, ``seq_slots [B]``,
            ``query_positions [B]`` (its ``max_head_len`` / ``row_index`` only shape
            the kernels' launches and are ignored here).
        scale: softmax scale.
        out: optional ``[B, num_q_heads, D]`` output.
        metrics: optional; rows whose slot is set in ``metrics.selected``
            (``[num_slots]``) add to ``pool.slot_metrics``.

    Returns:
        ``[B, num_q_heads, D]`` in ``query.dtype`` (``out`` if given).
    """
    rows = batch.seq_slots.to(torch.int64)
    num_rows = rows.numel()
    if out is None:
        out = torch.empty_like(query)
    if num_rows == 0:
        return out
    # Rows sharing a (padding) slot read nothing, so per-row metrics stay exact.
    gathered = batch.gathered(pool.block_size)
    row_metrics = None if metrics is None else MetricSink(metrics.selected[rows], metrics.power)
    reference_paged_attention(query[:num_rows], pool, gathered, scale, out=out[:num_rows], metrics=row_metrics)
    return out
