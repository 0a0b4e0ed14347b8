"""Eviction metrics of the per-(layer, KV head) paged cache (PyTorch reference).

A KV's metric says how much attention it receives: the attention probabilities
of some queries, raised to ``power`` (2 = "L2", the paper's squared attention;
1 = "L1"), summed over the queries and over the query heads of the KV head's
group (query-group compression). Metrics live beside the pages in
``slot_metrics [num_pages, block_size]`` float32 and move with their KVs.

- Prompt metrics (``attention_metrics``): the last ``w`` prompt queries (KVC-w),
  or all queries but the ``v`` nearest to each key (KVC-full, computed in query
  chunks: memory is ``chunk x keys`` per head, never the full attention matrix),
  then pooled over key positions (``pool_metrics``: max, or avg for XKV).
- Decode metrics (continual compression): :mod:`kvcompress.ops.decode_metrics` (the
  formula every kernel is tested against, and the object that owns when they are added).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompress.ops.kv_pool import gather_pages
from kvcompress.ops.word_spans import span_max_pool


def _logical_slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[H, P]`` page ids -> ``[H, P*b]`` flat slot ids (``page * b + offset``)."""
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables.unsqueeze(-1) * block_size + offsets).reshape(block_tables.shape[0], -1)


def write_held_slots(slot_metrics: torch.Tensor, slots: torch.Tensor, held: torch.Tensor,
                     values: torch.Tensor) -> None:
    """``slot_metrics`` at each head's held slots = ``values``, reading nothing on the host
    (a boolean-mask write would: a stream sync on CUDA).

    ``slots`` ``[H, K]`` flat slot ids in logical order, ``held`` ``[H, K]`` bool, ``values``
    ``[H, K]``. Columns not held may point anywhere (another head's pages too): they write
    their head's first slot again with its own new value, so every head must hold at least
    one KV (a prompt's end)."""
    targets = torch.where(held, slots, slots[:, :1])
    values = torch.where(held, values, values[:, :1])
    slot_metrics.view(-1).index_put_((targets.reshape(-1),), values.reshape(-1).to(slot_metrics.dtype))


SCORE_COPIES = 4  # score-sized float32 temporaries alive at once in attention_metrics


def metric_query_chunk(query_chunk: int, num_q_heads: int, num_keys: int, workspace_bytes: int) -> int:
    """Queries per chunk of :func:`attention_metrics`: at most ``query_chunk``, and few
    enough that ``SCORE_COPIES`` float32 ``[num_q_heads, chunk, num_keys]`` fit in
    ``workspace_bytes`` (at least 1)."""
    per_query = SCORE_COPIES * 4 * num_q_heads * max(1, num_keys)
    return max(1, min(query_chunk, workspace_bytes // per_query))


def attention_metrics(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    key_cache: torch.Tensor,
    slot_positions: torch.Tensor,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    scale: float,
    power: int = 2,
    skip_nearest: int = 0,
    query_chunk: int = 1024,
    workspace_bytes: int = 256 << 20,
    position_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """Metric contribution of some queries of ONE sequence and ONE layer.

    Args:
        query: ``[Tq, num_q_heads, D]``; query head ``j`` reads KV head ``j // G``.
        query_positions: ``[Tq]`` token positions of the queries.
        key_cache: ``[num_pages, block_size, D]``.
        slot_positions: ``[num_pages, block_size]`` token position of each slot.
        block_tables: ``[num_kv_heads, P]`` this layer's pages of the sequence.
        head_lens: ``[num_kv_heads]`` KVs held per head.
        scale: softmax scale.
        power: probabilities are raised to this power (2 = L2, 1 = L1).
        skip_nearest: a query adds nothing to keys fewer than this many positions
            before it (KVC-full's ``v``; 0 for KVC-w). Softmax still sees them.
        query_chunk: queries attended at a time (bounds memory to chunk x keys).
        workspace_bytes: bound of one chunk's score-sized temporaries (scores,
            probabilities, masks: ~``SCORE_COPIES`` float32 ``[Hq, chunk, K]``); the
            chunk shrinks to fit (at least one query). 1024 queries x 32 heads x 32K
            keys would be 4.3 GB per temporary.
        position_tables: ``[num_kv_heads, P]`` the rows of ``slot_positions`` holding
            ``block_tables``' pages' positions (``KVPool.meta_tables``; None: the page ids).

    Returns:
        ``[num_kv_heads, P * block_size]`` float32 in logical slot order; slots at
        or past a head's length are 0.
    """
    num_kv_heads, num_pages = block_tables.shape
    block_size, head_dim = key_cache.shape[1], key_cache.shape[2]
    num_keys = num_pages * block_size
    group = query.shape[1] // num_kv_heads
    flat_pages = block_tables.reshape(-1).long()
    # K^T of each head [H, D, K]: whole pages gathered as vLLM's CPU layout stores them
    # ([D, b]; other layouts gather strided), then one transposing copy.
    keys_t = (
        gather_pages(key_cache.transpose(1, 2), flat_pages)
        .view(num_kv_heads, num_pages, head_dim, block_size)
        .permute(0, 2, 1, 3).reshape(num_kv_heads, head_dim, num_keys).float()
    )
    rows = flat_pages if position_tables is None else position_tables.reshape(-1).long()
    key_pos = slot_positions.index_select(0, rows).view(num_kv_heads, num_keys).long()
    held = torch.arange(num_keys, device=key_pos.device) < head_lens.unsqueeze(-1)
    metric = torch.zeros(key_pos.shape, dtype=torch.float32, device=key_pos.device)
    query_chunk = metric_query_chunk(query_chunk, query.shape[1], num_keys, workspace_bytes)
    for start in range(0, query.shape[0], query_chunk):
        # The scale goes on the queries (Tq x Hq x D values, not Hq x Tq x K scores), and
        # the score-sized passes run in place: this pass is ~3% of a prompt step on CPU.
        q = query[start : start + query_chunk].float() * scale
        q_pos = query_positions[start : start + query_chunk].long()
        num_queries = q.shape[0]
        q = q.view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(q.reshape(num_kv_heads, group * num_queries, head_dim), keys_t)
        scores = scores.view(num_kv_heads, group, num_queries, num_keys)
        hidden = ~(held.unsqueeze(1) & (key_pos.unsqueeze(1) <= q_pos.view(1, -1, 1)))  # [H, Tq, K]
        scores.masked_fill_(hidden.unsqueeze(1), float("-inf"))
        # softmax(s) ** p summed over the queries = sum of exp(s - max) ** p / total ** p:
        # one weighted reduction (a bmm) instead of a division, a power and a sum pass.
        top = scores.amax(dim=3, keepdim=True).clamp_(min=torch.finfo(torch.float32).min)
        scores.sub_(top).exp_()
        totals = scores.sum(dim=3, keepdim=True)  # [H, G, Tq, 1]; 0: the query sees no held key
        if skip_nearest > 0:
            near = (q_pos.view(1, -1, 1) - key_pos.unsqueeze(1)) < skip_nearest  # [H, Tq, K]
            scores.masked_fill_(near.unsqueeze(1), 0.0)
        weights = torch.where(totals > 0, totals.pow(-power), torch.zeros_like(totals))
        if power != 1:
            scores.pow_(power)
        metric += torch.bmm(
            weights.view(num_kv_heads, 1, group * num_queries), scores.view(num_kv_heads, group * num_queries, num_keys),
        ).view(num_kv_heads, num_keys)
    return metric


def accumulate_metrics(
    slot_metrics: torch.Tensor,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    metric: torch.Tensor,
) -> None:
    """Add ``metric [H, P*b]`` (logical order) into the held slots of ``slot_metrics``.

    No host read (boolean indexing would wait for the stream on CUDA, at every layer):
    the columns past a head's length add 0.0 to slot 0, which leaves it as it was.
    """
    block_size = slot_metrics.shape[1]
    slots = _logical_slots(block_tables, block_size)
    held = torch.arange(slots.shape[1], device=slots.device) < head_lens.unsqueeze(-1)
    slot_metrics.view(-1).index_add_(
        0, slots.masked_fill(~held, 0).reshape(-1),
        metric.masked_fill(~held, 0.0).to(slot_metrics.dtype).reshape(-1),
    )


def pool_metrics(
    slot_metrics: torch.Tensor,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    kernel: int,
    mode: str = "max",
    word_starts: torch.Tensor | None = None,
) -> None:
    """Pool each head's metrics over neighbouring key positions, in place.

    ``mode``: ``max`` (SnapKV, PyramidKV, Ada-KV, KV-Compress) or ``avg`` (XKV; the
    mean over the window's held KVs, edges included). Only valid while a head is
    uncompressed (logical slot order = position order), which is when prompt metrics
    are final. ``kernel`` odd; 1 = no kernel pooling.

    ``word_starts``: ``[T]`` int64, the first position of the word span of each of the
    first T positions (``kvcompress.ops.word_spans.span_starts``); after the kernel,
    each of those positions gets its span's largest (pooled) metric.

    Reads nothing on the host (on CUDA a read would wait for the stream at every layer).
    ``max``: a held slot's pooled value is at least its own, so an ``amax`` scatter
    writes it exactly, and the columns past a head's length scatter ``-inf`` to slot 0,
    which leaves it as it was. ``avg``: those columns rewrite their head's first slot
    with that slot's own new value (every head holds at least one KV at a prompt's end).
    """
    if kernel <= 1 and word_starts is None:
        return
    if mode not in ("max", "avg"):
        raise ValueError(f"pool mode must be 'max' or 'avg', got {mode!r}")
    block_size = slot_metrics.shape[1]
    slots = _logical_slots(block_tables, block_size)
    held = torch.arange(slots.shape[1], device=slots.device) < head_lens.unsqueeze(-1)
    values = slot_metrics.view(-1)[slots]
    if kernel <= 1:
        pooled = values
    elif mode == "max":
        values = values.masked_fill(~held, float("-inf"))
        pooled = F.max_pool1d(values.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
    else:
        ones = torch.ones((1, 1, kernel), dtype=values.dtype, device=values.device)
        total = F.conv1d(values.masked_fill(~held, 0.0).unsqueeze(1), ones, padding=kernel // 2)
        count = F.conv1d(held.to(values.dtype).unsqueeze(1), ones, padding=kernel // 2)
        pooled = (total / count.clamp(min=1)).squeeze(1)
    if word_starts is not None:
        span = min(len(word_starts), pooled.shape[1])
        within = pooled[:, :span].masked_fill(~held[:, :span], float("-inf"))
        pooled[:, :span] = span_max_pool(within, word_starts[:span])
    if mode == "max":
        slot_metrics.view(-1).scatter_reduce_(
            0, slots.masked_fill(~held, 0).reshape(-1),
            pooled.masked_fill(~held, float("-inf")).reshape(-1), "amax",
        )
    else:
        write_held_slots(slot_metrics, slots, held, pooled)


def max_pool_metrics(
    slot_metrics: torch.Tensor,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    kernel: int,
) -> None:
    """``pool_metrics`` in ``max`` mode."""
    pool_metrics(slot_metrics, block_tables, head_lens, kernel, "max")
