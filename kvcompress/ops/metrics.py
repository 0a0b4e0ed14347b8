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
- Decode metrics (continual compression): ``paged_attention`` adds the decode
  queries' probabilities into ``slot_metrics`` as it attends.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

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
        key_cache.transpose(1, 2).index_select(0, flat_pages)
        .view(num_kv_heads, num_pages, head_dim, block_size)
        .permute(0, 2, 1, 3).reshape(num_kv_heads, head_dim, num_keys).float()
    )
    key_pos = slot_positions.index_select(0, flat_pages).view(num_kv_heads, num_keys).long()
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


def decode_metrics(
    query: torch.Tensor,
    pool,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    scale: float,
    power: int = 2,
) -> None:
    """Decode queries add their attention to the eviction metrics, as a pass of its own
    (for attention kernels that return no probabilities).

    Each row's query sees every KV its heads hold (a decode query is the newest token,
    so the position mask admits all of them); it adds ``softmax(q . K * scale) ** power``,
    summed over the query group, into ``pool.slot_metrics`` at the held slots, as the
    reference decode does while it attends.

    Args:
        query: ``[B, num_q_heads, D]`` one decode query per row.
        pool: a :class:`~kvcompress.ops.kv_pool.KVPool` (K ``[num_pages, b, D]``, any
            strides; ``slot_metrics [num_pages, b]`` float32, added to in place).
        block_tables: ``[B, num_kv_heads, P]`` this layer's page ids of each row.
        head_lens: ``[B, num_kv_heads]`` KVs held per head.
        scale: softmax scale; power: 2 (L2) or 1 (L1).
    """
    rows, num_kv_heads, num_pages = block_tables.shape
    if rows == 0:
        return
    group = query.shape[1] // num_kv_heads
    decode_metrics_by_head(
        query.reshape(rows * num_kv_heads, group, query.shape[2]), pool,
        block_tables.reshape(rows * num_kv_heads, num_pages), head_lens.reshape(-1), scale, power,
    )


def decode_metrics_by_head(
    query: torch.Tensor,
    pool,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    scale: float,
    power: int = 2,
    max_pages_per_pass: int = 4096,
    query_positions: torch.Tensor | None = None,
    query_weights: torch.Tensor | None = None,
) -> None:
    """``decode_metrics`` over head-sequences of any layers at once, reading only the
    pages each head holds (no padding to the longest head).

    Head-sequence ``s`` is one (layer, row, KV head) of a decode step: its query group
    sees every KV the head holds (a decode query is the newest token) and adds
    ``softmax(q . K * scale) ** power``, summed over the group, into
    ``pool.slot_metrics`` at those slots. The softmax runs per page and is joined per
    head (segment max and sum), so one pass serves every layer of a step.

    Args:
        query: ``[S, G, D]`` the query group of each head-sequence.
        pool: a :class:`~kvcompress.ops.kv_pool.KVPool` (K ``[num_pages, b, D]``, any
            strides; ``slot_metrics [num_pages, b]`` float32, added to in place).
        block_tables: ``[S, P]`` page ids (int32 or int64) of each head-sequence.
        head_lens: ``[S]`` KVs held per head-sequence.
        scale: softmax scale; power: 2 (L2) or 1 (L1).
        max_pages_per_pass: pages gathered at once (bounds the key copy to
            ``max_pages_per_pass * b * D`` float32; whole heads per pass, at least one).
        query_positions: ``[S, G]`` token position of each query, for queries kept
            from earlier steps (:mod:`kvcompress.ops.deferred_metrics`): a query sees
            only the KVs at positions up to its own (``pool.slot_positions``), as in
            its own step. None: every query sees every KV the head holds.
        query_weights: ``[S, G]`` float32 factor on each query's contribution (0 for
            a padding query: head-sequences with fewer real queries than ``G`` share
            one pass). None: every query counts once.
    """
    num_heads, num_pages = block_tables.shape
    if num_heads == 0:
        return
    block_size = pool.key_cache.shape[1]
    pages_held = (head_lens.long() + block_size - 1) // block_size  # [S]
    if int(pages_held.max()) > num_pages:
        raise ValueError("decode_metrics_by_head: a head holds more KVs than its page table row")
    ends = torch.cumsum(pages_held, 0).tolist()
    if ends[-1] <= max_pages_per_pass:
        _decode_metrics_heads(
            query, pool, block_tables, head_lens, pages_held, scale, power, query_positions, query_weights,
        )
        return
    start_head, start_page = 0, 0
    for head, end_page in enumerate(ends):
        last = head == num_heads - 1
        if last or ends[head + 1] - start_page > max_pages_per_pass:
            _decode_metrics_heads(
                query[start_head : head + 1], pool, block_tables[start_head : head + 1],
                head_lens[start_head : head + 1], pages_held[start_head : head + 1], scale, power,
                None if query_positions is None else query_positions[start_head : head + 1],
                None if query_weights is None else query_weights[start_head : head + 1],
            )
            start_head, start_page = head + 1, end_page


def _decode_metrics_heads(
    query, pool, block_tables, head_lens, pages_held, scale, power, query_positions=None, query_weights=None,
) -> None:
    """One pass of :func:`decode_metrics_by_head` over whole heads."""
    num_heads = block_tables.shape[0]
    group = query.shape[1]
    key_cache = pool.key_cache
    block_size = key_cache.shape[1]
    device = block_tables.device
    head_of_page, page_ids, past_end = _held_pages(block_tables, head_lens, pages_held, block_size)
    if head_of_page.numel() == 0:
        return
    # K as [D, b] per page: vLLM's CPU layout stores it so (a copy of whole pages).
    keys = key_cache.transpose(1, 2).index_select(0, page_ids).float()  # [N, D, b]
    scores = torch.bmm(query.float().mul(scale).index_select(0, head_of_page), keys)  # [N, G, b]
    if query_positions is None:
        scores.masked_fill_(past_end.unsqueeze(1), float("-inf"))
    else:  # [N, G, b]: later KVs than a query's own are not in its softmax
        later = (pool.slot_positions.index_select(0, page_ids).unsqueeze(1)
                 > query_positions.index_select(0, head_of_page).unsqueeze(-1))
        scores.masked_fill_(later.logical_or_(past_end.unsqueeze(1)), float("-inf"))
    head_max = torch.full((num_heads, group), float("-inf"), device=device).scatter_reduce_(
        0, head_of_page.unsqueeze(-1).expand(-1, group), scores.amax(dim=2), "amax",
    )
    probs = torch.exp_(scores.sub_(head_max.index_select(0, head_of_page).unsqueeze(-1)))
    totals = torch.zeros((num_heads, group), device=device).index_add_(0, head_of_page, probs.sum(dim=2))
    probs.div_(totals.index_select(0, head_of_page).unsqueeze(-1))
    if power != 1:
        probs.pow_(power)
    if query_weights is None:
        gained = probs.sum(dim=1)  # [N, b]
    else:  # [N, 1, G] @ [N, G, b]: padding queries (weight 0) add nothing
        gained = torch.bmm(query_weights.index_select(0, head_of_page).unsqueeze(1), probs).squeeze(1)
    pool.slot_metrics.index_add_(0, page_ids, gained.to(pool.slot_metrics.dtype))


def _held_pages(
    block_tables: torch.Tensor, head_lens: torch.Tensor, pages_held: torch.Tensor, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every page the heads hold, flattened: ``([N] head of each page, [N] int64 page id,
    [N, b] bool slot past its head's end)``. On CPU built in numpy: a pass is a few
    dozen small ops, and torch's ``nonzero`` and 2-D indexing there cost 10-100 us each."""
    if block_tables.device.type == "cpu":
        held = pages_held.numpy()
        head_of_page = np.repeat(np.arange(held.shape[0]), held)
        page_index = np.arange(head_of_page.shape[0]) - np.repeat(np.cumsum(held) - held, held)
        page_ids = block_tables.numpy()[head_of_page, page_index].astype(np.int64)
        slot = page_index[:, None] * block_size + np.arange(block_size)
        past_end = slot >= head_lens.numpy()[head_of_page][:, None]
        return torch.from_numpy(head_of_page), torch.from_numpy(page_ids), torch.from_numpy(past_end)
    device = block_tables.device
    held = torch.arange(block_tables.shape[1], device=device) < pages_held.unsqueeze(-1)  # [S, P]
    head_of_page, page_index = held.nonzero(as_tuple=True)
    slot = page_index.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)
    past_end = slot >= head_lens.long()[head_of_page].unsqueeze(-1)
    return head_of_page, block_tables[head_of_page, page_index].long(), past_end
