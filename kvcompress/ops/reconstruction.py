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
    pages = block_tables.long()
    cached_keys = pool.key_cache[pages].reshape(num_kv_heads, num_pages * block_size, head_dim).float()
    cached_values = pool.value_cache[pages].reshape(num_kv_heads, num_pages * block_size, head_dim).float()
    held = torch.arange(num_pages * block_size, device=pages.device) < head_lens.long().unsqueeze(-1)
    own_keys = key.float().transpose(0, 1)  # [H, n, D]
    own_values = value.float().transpose(0, 1)
    queries = query.float().view(num_tokens, num_kv_heads, group, head_dim)
    best = torch.zeros(held.shape, dtype=torch.float32, device=pages.device)
    per_query = SCORE_COPIES * 4 * num_q_heads * (num_pages * block_size + num_tokens)
    chunk = max(1, min(num_tokens, workspace_bytes // per_query))
    for start in range(0, num_tokens, chunk):
        end = min(num_tokens, start + chunk)
        q = queries[start:end]
        cached = torch.einsum("chgd,hkd->hgck", q, cached_keys).mul_(scale)
        cached.masked_fill_(~held[:, None, None, :], float("-inf"))
        own = torch.einsum("chgd,hmd->hgcm", q, own_keys[:, :end]).mul_(scale)
        future = torch.arange(end, device=pages.device) > torch.arange(start, end, device=pages.device)[:, None]
        own.masked_fill_(future, float("-inf"))
        top = torch.maximum(cached.amax(dim=-1), own.amax(dim=-1)).unsqueeze(-1)  # [H, G, c, 1]
        cached = torch.exp_(cached.sub_(top))
        own = torch.exp_(own.sub_(top))
        total = cached.sum(dim=-1, keepdim=True) + own.sum(dim=-1, keepdim=True)
        cached.div_(total)
        own.div_(total)
        attended = torch.einsum("hgck,hkd->chgd", cached, cached_values)
        attended += torch.einsum("hgcm,hmd->chgd", own, own_values[:, :end])
        out[start:end] = attended.reshape(end - start, num_q_heads, head_dim).to(out.dtype)
        torch.maximum(best, cached.amax(dim=(1, 2)), out=best)
    return best
