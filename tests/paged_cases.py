"""Ragged per-head paged caches for the attention tests (tests/test_cpu_attention.py,
tests/unified_attention_cases.py): older slots hold a random kept subset of earlier
positions, as compression leaves them; the last ``q_len`` slots hold the step's tokens."""

from __future__ import annotations

import dataclasses

import torch

from kvcompress.ops import KVPool, PagedBatch
from kvcompress.ops import cpu_attention


def make_case(
    query_lens, num_kv_heads, group, head_dim, block_size, dtype, seed, *, ragged=True,
    max_context=300, kernel_layout=True,
):
    """A pool and a batch: sequence s has ``query_lens[s]`` new tokens at the end of each
    head, after a random kept subset of its earlier positions (ragged heads, partial
    pages). ``kernel_layout``: pages as vLLM's CPU kernel stores them (K ``[D, b]``) in
    the engine's ``[2, N, b, D]`` buffer, else row-major ``[N, 2, b, D]`` halves (strided
    K / V views)."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(query_lens)
    contexts = torch.randint(0, max_context, (num_seqs,), generator=gen)
    kept = []  # [S][H] sorted kept earlier positions
    for s in range(num_seqs):
        row = []
        for _ in range(num_kv_heads):
            ctx = int(contexts[s])
            keep = ctx if not ragged else int(torch.randint(0, ctx + 1, (1,), generator=gen))
            row.append(torch.randperm(ctx, generator=gen)[:keep].sort().values)
        kept.append(row)
    head_lens = torch.tensor(
        [[len(kept[s][h]) + query_lens[s] for h in range(num_kv_heads)] for s in range(num_seqs)]
    )
    pages_needed = (head_lens + block_size - 1) // block_size
    max_pages = int(pages_needed.max())
    num_pages = int(pages_needed.sum()) + 7
    if kernel_layout:  # the engine's pool: K region, V region
        buffer = torch.randn((2, num_pages, block_size, head_dim), generator=gen).to(dtype)
        key_cache, value_cache = cpu_attention.pool_views(buffer)
    else:  # K / V interleaved per page: strided views (the ops take any page stride)
        buffer = torch.randn((num_pages, 2, block_size, head_dim), generator=gen).to(dtype)
        key_cache, value_cache = buffer[:, 0], buffer[:, 1]
    slot_positions = torch.full((num_pages, block_size), -1, dtype=torch.int32)
    slot_metrics = torch.zeros((num_pages, block_size), dtype=torch.float32)
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros((num_seqs, num_kv_heads, max_pages + 2), dtype=torch.int64)
    used = 0
    for s in range(num_seqs):
        new_positions = torch.arange(int(contexts[s]), int(contexts[s]) + query_lens[s])
        for h in range(num_kv_heads):
            n = int(pages_needed[s, h])
            tables[s, h, :n] = order[used : used + n]
            used += n
            positions = torch.cat([kept[s][h], new_positions]).to(torch.int32)
            slots = (tables[s, h, :n, None] * block_size + torch.arange(block_size)).reshape(-1)
            slot_positions.view(-1)[slots[: len(positions)]] = positions
    pool = KVPool(key_cache, value_cache, slot_positions, slot_metrics)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    query_positions = torch.cat(
        [torch.arange(int(contexts[s]), int(contexts[s]) + query_lens[s]) for s in range(num_seqs)]
    )
    batch = PagedBatch(tables, head_lens, starts, query_positions)
    query = torch.randn((starts[-1], num_kv_heads * group, head_dim), generator=gen).to(dtype)
    return pool, batch, query


def moved_to(value, device):
    """A case's tensors / tuples / dataclasses of tensors on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(moved_to(item, device) for item in value)
    if not dataclasses.is_dataclass(value):
        return value
    fields = {f.name: moved_to(getattr(value, f.name), device) for f in dataclasses.fields(value)}
    return dataclasses.replace(value, **fields)


def scrambled_cache(seed, lengths_per_head, block_size, head_dim, dtype=torch.float32):
    """A pool with ragged per-head lengths written in a scrambled page order, its
    tables, plus the dense per-head K/V (and positions) that the pages should hold."""
    generator = torch.Generator().manual_seed(seed)
    num_seqs, num_kv_heads = lengths_per_head.shape
    num_pages = 512
    key_cache = torch.randn(num_pages, block_size, head_dim, generator=generator, dtype=dtype)
    value_cache = torch.randn(num_pages, block_size, head_dim, generator=generator, dtype=dtype)
    slot_positions = torch.full((num_pages, block_size), -1, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=generator).tolist()
    max_pages = int(((lengths_per_head.max() + block_size - 1) // block_size).item())
    tables = torch.zeros(num_seqs, num_kv_heads, max(1, max_pages), dtype=torch.int64)
    dense = {}
    for s in range(num_seqs):
        for h in range(num_kv_heads):
            n = int(lengths_per_head[s, h])
            pages = [order.pop() for _ in range((n + block_size - 1) // block_size)]
            tables[s, h, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
            # Keep a subset of positions, as a compressed head would.
            positions = torch.sort(torch.randperm(2 * n + 1, generator=generator)[:n]).values
            for i in range(n):
                slot_positions[pages[i // block_size], i % block_size] = int(positions[i])
            k = key_cache[tables[s, h, : len(pages)]].reshape(-1, head_dim)[:n]
            v = value_cache[tables[s, h, : len(pages)]].reshape(-1, head_dim)[:n]
            dense[(s, h)] = (k.double(), v.double(), positions)
    slot_metrics = torch.zeros(num_pages, block_size)
    return KVPool(key_cache, value_cache, slot_positions, slot_metrics), tables, dense


def scrambled_rows(pool, seed, extra_rows=9):
    """``pool`` with its slot metadata moved to rows of larger tensors: page ``n``'s
    positions and metrics at a random row (never row ``n``), every other row garbage
    (positions in range, so that a bypass of ``page_meta_row`` reads plausible but wrong
    ones). The K / V are ``pool``'s own; ops on it must equal ops on ``pool``."""
    gen = torch.Generator().manual_seed(seed)
    num_pages, block_size = pool.slot_positions.shape
    num_rows = num_pages + extra_rows
    while True:
        rows = torch.randperm(num_rows, generator=gen)[:num_pages]
        if not bool((rows == torch.arange(num_pages)).any()):
            break
    high = max(1, int(pool.slot_positions.max()) + 1)
    positions = torch.randint(0, high, (num_rows, block_size), generator=gen).to(torch.int32)
    metrics = torch.rand((num_rows, block_size), generator=gen) * 3.0
    positions[rows] = pool.slot_positions
    metrics[rows] = pool.slot_metrics
    return dataclasses.replace(
        pool, slot_positions=positions, slot_metrics=metrics, page_meta_row=rows.to(torch.int32)
    )


def by_page(pool):
    """``(positions, metrics)`` ``[num_pages, b]`` of a pool, read through its rows."""
    pages = torch.arange(pool.page_meta_row.shape[0]) if pool.page_meta_row is not None else None
    if pages is None:
        return pool.slot_positions, pool.slot_metrics
    rows = pool.meta_index(pages)
    return pool.slot_positions[rows], pool.slot_metrics[rows]
