"""Decode attention that reads the page tables of all sequence slots (graph-capturable).

The batched decode of :func:`kvcompress.ops.paged_attention.paged_attention` takes
tables gathered for the step's batch and a host-side ``query_start_loc``; both
change every step. A CUDA graph needs every tensor it reads at a fixed address and
every launch shape fixed. Here the kernel reads the cache's own per-slot state
through a small index instead:

- ``block_tables``: ``[num_slots, num_kv_heads, P]`` page ids of ONE layer for every
  sequence slot (a strided view of ``PerHeadPagedCache.page_tables[:, layer]``);
- ``head_lens``: ``[num_slots, num_kv_heads]`` (a view of ``head_lens[:, layer]``);
- ``seq_slots``: ``[B]`` int32, query row ``b`` belongs to sequence slot ``seq_slots[b]``
  (padding rows point at a slot whose heads are empty, so they read nothing and
  get zeros);
- ``metric_slots``: ``[num_slots]`` int8/bool, slots whose decode query adds its
  attention to the eviction metrics (continual compression);
- ``max_head_len``: a fixed upper bound of the head lengths (``max_model_len``), so
  the partition grid does not depend on the step.

Nothing here reads a device value on the host. The Triton version
(:func:`kvcompress.ops.triton_attention.paged_decode_by_slot_triton`) launches the
same decode / reduce / metric kernels as the general Triton path; this module's
reference is its oracle and the CPU path.
"""

from __future__ import annotations

import torch

from kvcompress.ops.paged_attention import paged_attention


MAX_GRAPH_PARTITIONS = 64


def graph_partition_size(max_head_len: int, block_size: int) -> int:
    """Keys per decode partition for a grid sized by ``max_head_len``: at least 512,
    whole pages, and at most ``MAX_GRAPH_PARTITIONS`` partitions per head whatever
    ``max_model_len`` is (most of a fixed grid's programs exit at once)."""
    partition = max(512, -(-max_head_len // MAX_GRAPH_PARTITIONS))
    return -(-partition // block_size) * block_size


def paged_decode_by_slot_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_positions: torch.Tensor,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    seq_slots: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    slot_metrics: torch.Tensor | None = None,
    metric_slots: torch.Tensor | None = None,
    metric_power: int = 2,
    max_head_len: int | None = None,
) -> torch.Tensor:
    """One query token per row over slot-indexed page tables (PyTorch reference).

    Args:
        query: ``[B, num_q_heads, D]``, row ``b`` is the decode query of slot ``seq_slots[b]``.
        key_cache, value_cache: ``[num_pages, block_size, D]``.
        slot_positions: ``[num_pages, block_size]`` token position of each slot.
        block_tables: ``[num_slots, num_kv_heads, P]`` page ids of this layer, all slots.
        head_lens: ``[num_slots, num_kv_heads]`` KVs held per head.
        seq_slots: ``[B]`` int sequence slot of each row (distinct for real rows;
            padding rows may share an empty slot).
        query_positions: ``[B]`` token position of each query.
        scale: softmax scale.
        out: optional ``[B, num_q_heads, D]`` output.
        slot_metrics: optional ``[num_pages, block_size]`` float32 metrics, updated for
            rows whose slot is set in ``metric_slots`` (``[num_slots]``).
        metric_power: 2 (L2) or 1 (L1) of the attention probabilities.
        max_head_len: accepted for signature parity with the kernels (unused).

    Returns:
        ``[B, num_q_heads, D]`` in ``query.dtype`` (``out`` if given).
    """
    del max_head_len
    rows = seq_slots.to(torch.int64)
    num_rows = rows.numel()
    if out is None:
        out = torch.empty_like(query)
    if num_rows == 0:
        return out
    block_size = key_cache.shape[1]
    lens = head_lens[rows]  # [B, H]
    # Only the pages some row holds (the slot tables are max_model_len wide).
    num_pages = max(1, int(((lens.max() + block_size - 1) // block_size).item()))
    tables = block_tables[rows, :, :num_pages]
    wants_metrics = slot_metrics is not None and metric_slots is not None
    # Rows sharing a (padding) slot read nothing, so per-row metrics stay exact.
    paged_attention(
        query[:num_rows],
        key_cache,
        value_cache,
        slot_positions,
        tables,
        lens,
        list(range(num_rows + 1)),
        query_positions[:num_rows],
        scale,
        out=out[:num_rows],
        slot_metrics=slot_metrics if wants_metrics else None,
        metric_seqs=metric_slots[rows].to(torch.bool) if wants_metrics else None,
        metric_power=metric_power,
    )
    return out
