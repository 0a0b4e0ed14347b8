"""PyTorch reference attention over the per-(layer, KV head) paged cache.

This is the CPU path of the vLLM backend and the oracle for the GPU kernels.
One call handles one layer of a mixed batch (prefills, chunked-prefill
continuations and decodes). Keys are visible to a query when their stored token
position is <= the query's position (causal by position, not by slot order, so
compacted heads stay correct) and, on a sliding-window layer, above the query's
position minus the window.
"""

from __future__ import annotations

import torch

from kvcompress.ops.decode_metrics import decode_metrics
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, gather_pages, scatter_pages


def reference_write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    write_pages: torch.Tensor,
    write_offsets: torch.Tensor,
) -> None:
    """Store new KVs in their pages.

    Args:
        key_cache, value_cache: ``[num_pages, block_size, head_dim]`` (views may be strided).
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        write_pages, write_offsets: ``[num_tokens, num_kv_heads]`` int64 targets.
    """
    scatter_pages(key_cache, (write_pages, write_offsets), key)
    scatter_pages(value_cache, (write_pages, write_offsets), value)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Masked GQA attention in float32 (decode metrics are :mod:`decode_metrics`' own pass).

    Args:
        query: ``[B, Tq, Hkv, G, D]``; keys, values: ``[B, Hkv, K, D]``;
        visible: ``[B, Hkv, Tq, K]`` bool.

    Returns:
        ``[B, Tq, Hkv, G, D]`` float32 output.
    """
    scores = torch.einsum("bthgd,bhkd->bhgtk", query.float(), keys.float()) * scale
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A query that sees no key (padding rows) gets zeros, not NaN.
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("bhgtk,bhkd->bthgd", probs, values.float())


def _attend_fused(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``_attend`` through torch's fused SDPA (prefill chunks:
    several times faster on CPU, same float32 math). Shapes as ``_attend``."""
    batch, num_tokens, num_kv_heads, group, head_dim = query.shape
    q = query.float().permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads * group, num_tokens, head_dim)
    mask = visible.repeat_interleave(group, dim=1)  # [B, Hq, Tq, K]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys.float(), values.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    # A query that sees no key (padding rows) gets zeros, not NaN.
    out = torch.nan_to_num(out, nan=0.0)
    return out.reshape(batch, num_kv_heads, group, num_tokens, head_dim).permute(0, 3, 1, 2, 4)


def visible_by_position(key_pos: torch.Tensor, q_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility by stored position: ``key_pos <= q_pos``
    and, with a window ``W``, ``key_pos > q_pos - W``; the two broadcast together."""
    visible = key_pos <= q_pos
    if sliding_window is not None:
        visible &= key_pos > q_pos - sliding_window
    return visible


def _gather_heads(
    cache: torch.Tensor, block_tables: torch.Tensor
) -> torch.Tensor:
    """``cache [N, b, D]``, ``block_tables [B, H, P]`` -> ``[B, H, P*b, D]``."""
    batch, heads, pages = block_tables.shape
    gathered = gather_pages(cache, block_tables)  # [B, H, P, b, D]
    return gathered.reshape(batch, heads, pages * cache.shape[1], cache.shape[2])


def reference_paged_attention(
    query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None, max_query_chunk: int = 512,
) -> torch.Tensor:
    """Attention of one layer over per-head paged KVs.

    Args:
        query: ``[T, num_q_heads, D]``; query head ``j`` reads KV head ``j // G``.
        pool: the page pool (K, V ``[num_pages, block_size, D]``, slot positions, and
            the slot metrics ``metrics`` adds to).
        batch: this layer's ``block_tables [S, num_kv_heads, P]`` and ``head_lens
            [S, num_kv_heads]``, ``query_start_loc`` (``S + 1`` ints) and
            ``query_positions [T]``.
        scale: softmax scale.
        out: optional ``[T, num_q_heads, D]`` output buffer.
        metrics: optional; the decode queries of the sequences it selects (``[S]``
            bool) add their attention probabilities ** ``metrics.power``, summed over
            the query group, into ``pool.slot_metrics`` at the slots they read
            (continual compression; only held slots are touched, nothing is zeroed).
            Not with ``batch.sliding_window``: a sliding-window layer is never
            compressed, so its KVs keep no metric.
        max_query_chunk: queries of one sequence attended at a time (bounds memory).

    Returns:
        ``[T, num_q_heads, D]`` in ``query.dtype`` (``out`` if given).
    """
    key_cache, value_cache, slot_positions = pool.key_cache, pool.value_cache, pool.slot_positions
    block_tables, head_lens = batch.block_tables, batch.head_lens
    query_start_loc, query_positions = batch.query_start_loc, batch.query_positions
    window = batch.sliding_window
    if window is not None and metrics is not None:
        raise ValueError("a sliding-window layer takes no decode metrics (it is never compressed)")
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs, num_kv_heads, _ = block_tables.shape
    group = num_q_heads // num_kv_heads
    block_size = key_cache.shape[1]
    if out is None:
        out = torch.empty_like(query)
    query_lens = [query_start_loc[s + 1] - query_start_loc[s] for s in range(num_seqs)]
    pages_needed = (head_lens + block_size - 1) // block_size  # [S, H]
    max_pages = pages_needed.amax(dim=1).tolist() if num_seqs else []

    decode_rows = [s for s in range(num_seqs) if query_lens[s] == 1]
    if decode_rows:
        # Decodes are batched: one gather, padded to the longest head.
        rows = torch.tensor(decode_rows, device=block_tables.device)
        num_pages = max(1, max(max_pages[s] for s in decode_rows))
        tables = block_tables[rows, :, :num_pages]
        keys = _gather_heads(key_cache, tables)
        values = _gather_heads(value_cache, tables)
        key_pos = slot_positions[pool.meta_tables(tables)].reshape(len(decode_rows), num_kv_heads, -1)
        token_rows = torch.tensor(
            [query_start_loc[s] for s in decode_rows], device=query.device
        )
        q_pos = query_positions[token_rows]  # [B]
        slot_index = torch.arange(key_pos.shape[-1], device=key_pos.device)
        visible = (slot_index < head_lens[rows].unsqueeze(-1)) & visible_by_position(
            key_pos, q_pos.view(-1, 1, 1), window
        )  # [B, H, K]
        q = query[token_rows].view(len(decode_rows), 1, num_kv_heads, group, head_dim)
        result = _attend(q, keys, values, visible.unsqueeze(2), scale)
        out[token_rows] = result.reshape(len(decode_rows), num_q_heads, head_dim).to(
            out.dtype
        )
        if metrics is not None:
            # The one definition of what a decode query adds (every kernel is tested
            # against it through this reference).
            chosen = metrics.selected[rows].to(torch.bool)
            if bool(chosen.any()):
                decode_metrics(query[token_rows[chosen]], pool, block_tables[rows[chosen]],
                               head_lens[rows[chosen]], scale, metrics.power, q_pos[chosen])

    for s in range(num_seqs):
        if query_lens[s] <= 1:
            continue
        num_pages = max(1, max_pages[s])
        tables = block_tables[s : s + 1, :, :num_pages]
        keys = _gather_heads(key_cache, tables)
        values = _gather_heads(value_cache, tables)
        key_pos = slot_positions[pool.meta_tables(tables)].reshape(1, num_kv_heads, -1)
        slot_index = torch.arange(key_pos.shape[-1], device=key_pos.device)
        held = slot_index < head_lens[s].unsqueeze(-1)  # [H, K]
        for chunk_start in range(query_start_loc[s], query_start_loc[s + 1], max_query_chunk):
            chunk_end = min(chunk_start + max_query_chunk, query_start_loc[s + 1])
            q_pos = query_positions[chunk_start:chunk_end]
            visible = held.unsqueeze(1) & visible_by_position(
                key_pos[0].unsqueeze(1), q_pos.view(1, -1, 1), window
            )  # [H, Tq, K]
            q = query[chunk_start:chunk_end].view(
                1, chunk_end - chunk_start, num_kv_heads, group, head_dim
            )
            result = _attend_fused(q, keys, values, visible.unsqueeze(0), scale)
            out[chunk_start:chunk_end] = result.reshape(
                chunk_end - chunk_start, num_q_heads, head_dim
            ).to(out.dtype)
    return out


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Float64 oracle: plain causal GQA attention of one sequence (token ``t`` at
    position ``t``), optionally within a sliding window of ``sliding_window`` tokens
    (the query and the ``W - 1`` before it).

    ``query [T, Hq, D]``, ``key/value [T, Hkv, D]`` -> ``[T, Hq, D]`` float64.
    """
    num_tokens, num_q_heads, _ = query.shape
    group = num_q_heads // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,khd->htk", query.double(), k) * scale
    mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    if sliding_window is not None:
        mask = mask.triu(-(sliding_window - 1))
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(scores, -1), v)
