"""Question-agnostic scores from a context-reconstruction pass (KVzip-style; PyTorch,
no vLLM).

Window policies score a prompt's KVs with its last queries, i.e. with the question:
a second question about the same document then finds the KVs it needs evicted.
Here, once a prompt is prefilled, the model is asked to repeat it: scoring tokens
(an instruction, then a chunk of the prompt's own tokens) run through the model at
positions past the prompt. In each layer their queries attend over the request's
cached KVs and, causally, over the scoring tokens themselves, whose KVs are never
stored. A cached KV's score is the largest attention probability any scoring query
of its KV head's group gives it: how much repeating the context needs that KV,
whatever is asked later. Copying a number or a name needs its KVs; filler the
model can continue from the repeated text alone needs them less.

Every cached KV precedes every scoring token, so no position mask applies to them
(their slot order, which MoveCache may have permuted, does not matter).
"""

from __future__ import annotations

import torch

from kvcompress.ops.kv_pool import gather_pages

SCORE_COPIES = 4
"""Score-sized float32 temporaries alive at once per query chunk."""


def reconstruction_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pool,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace_bytes: int = 256 << 20,
) -> torch.Tensor:
    """Attention of ONE sequence's scoring tokens in ONE layer, and the scores they give.

    Args:
        query: ``[n, num_q_heads, D]`` scoring queries in position order, all placed
            after the cached KVs; query head ``j`` reads KV head ``j // G``.
        key, value: ``[n, num_kv_heads, D]`` the scoring tokens' own K / V (attended
            causally; not written anywhere).
        pool: a :class:`~kvcompress.ops.kv_pool.KVPool` (K / V ``[num_pages, b, D]``).
        block_tables: ``[num_kv_heads, P]`` this layer's pages of the sequence.
        head_lens: ``[num_kv_heads]`` KVs each head holds.
        scale: softmax scale.
        out: ``[n, num_q_heads, D]``, written with the attention output.
        workspace_bytes: bound of one query chunk's score-sized temporaries.

    Returns:
        ``[num_kv_heads, P * b]`` float32 in logical slot order: the largest probability
        any query of the head's group gave each held KV; 0 past a head's length.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, num_pages = block_tables.shape
    block_size = pool.key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    num_keys = num_pages * block_size
    pages = block_tables.long()
    device = pages.device
    # [H, K, D] / [H, D, K]: one batched matmul per head for every query of its group.
    cached_keys_t = gather_pages(pool.key_cache, pages).reshape(num_kv_heads, num_keys, head_dim).float().transpose(1, 2)
    cached_values = gather_pages(pool.value_cache, pages).reshape(num_kv_heads, num_keys, head_dim).float()
    held = torch.arange(num_keys, device=device) < head_lens.long().unsqueeze(-1)  # [H, K]
    # Skipping the mask when every column is held saves a pass on CPU; on CUDA reading
    # that on the host would wait for the stream at every layer.
    all_held = device.type == "cpu" and bool(held.all())
    own_keys_t = key.float().permute(1, 2, 0)  # [H, D, n]
    own_values = value.float().transpose(0, 1)  # [H, n, D]
    queries = query.float().view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [H, G, n, D]
    best = torch.zeros((num_kv_heads, num_keys), dtype=torch.float32, device=device)
    per_query = SCORE_COPIES * 4 * num_q_heads * (num_keys + num_tokens)
    chunk = max(1, min(num_tokens, workspace_bytes // per_query))
    for start in range(0, num_tokens, chunk):
        end = min(num_tokens, start + chunk)
        rows = group * (end - start)
        q = queries[:, :, start:end].reshape(num_kv_heads, rows, head_dim)
        cached = torch.bmm(q, cached_keys_t).mul_(scale)  # [H, G*c, K]
        if not all_held:
            cached.masked_fill_(~held.unsqueeze(1), float("-inf"))
        own = torch.bmm(q, own_keys_t[:, :, :end]).mul_(scale)  # [H, G*c, end]
        future = torch.arange(end, device=device) > torch.arange(start, end, device=device).unsqueeze(-1)
        own.view(num_kv_heads, group, end - start, end).masked_fill_(future, float("-inf"))
        top = torch.maximum(cached.amax(dim=-1, keepdim=True), own.amax(dim=-1, keepdim=True))
        cached = torch.exp_(cached.sub_(top))
        own = torch.exp_(own.sub_(top))
        total = cached.sum(dim=-1, keepdim=True).add_(own.sum(dim=-1, keepdim=True))
        cached.div_(total)
        own.div_(total)
        attended = torch.bmm(cached, cached_values).add_(torch.bmm(own, own_values[:, :end]))  # [H, G*c, D]
        out[start:end] = attended.view(num_kv_heads, group, end - start, head_dim).permute(2, 0, 1, 3).reshape(
            end - start, num_q_heads, head_dim
        ).to(out.dtype)
        torch.maximum(best, cached.amax(dim=1), out=best)
    return best
