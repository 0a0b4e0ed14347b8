"""The reconstruction pass's attention (kvzip scoring) against a float64 brute force:
each scoring query attends over its sequence's held KVs of the layer plus the scoring
tokens up to itself; a cached KV's score is the largest probability of its group."""

from __future__ import annotations

import pytest
import torch

from kvcompress.ops.reconstruction import reconstruction_attention
from paged_cases import make_case


def _brute_force(query, key, value, pool, tables, lens, scale):
    """float64 loops: ``(out [n, Hq, D], scores [H, P*b])``."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, num_pages = tables.shape
    block_size = pool.key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    scores = torch.zeros((num_kv_heads, num_pages * block_size), dtype=torch.float64)
    for h in range(num_kv_heads):
        slots = [(int(tables[h, i // block_size]), i % block_size) for i in range(int(lens[h]))]
        cached_k = torch.stack([pool.key_cache[p, o] for p, o in slots]).double() if slots else torch.zeros(0, head_dim, dtype=torch.float64)
        cached_v = torch.stack([pool.value_cache[p, o] for p, o in slots]).double() if slots else torch.zeros(0, head_dim, dtype=torch.float64)
        for g in range(group):
            j = h * group + g
            for t in range(num_tokens):
                keys = torch.cat([cached_k, key[: t + 1, h].double()])
                values = torch.cat([cached_v, value[: t + 1, h].double()])
                probs = torch.softmax(keys @ query[t, j].double() * scale, dim=0)
                out[t, j] = probs @ values
                n = len(slots)
                scores[h, :n] = torch.maximum(scores[h, :n], probs[:n])
    return out, scores


@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size,num_tokens,seed",
    [(2, 1, 64, 16, 7, 0), (3, 3, 64, 16, 40, 1), (1, 8, 80, 32, 25, 2), (4, 2, 96, 16, 1, 3), (2, 4, 128, 32, 33, 4)],
)
def test_reconstruction_matches_brute_force(num_kv_heads, group, head_dim, block_size, num_tokens, seed):
    pool, batch, _ = make_case([1], num_kv_heads, group, head_dim, block_size, torch.float32, seed, max_context=200)
    gen = torch.Generator().manual_seed(100 + seed)
    query = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    tables, lens = batch.block_tables[0], batch.head_lens[0]
    scale = head_dim ** -0.5
    out = torch.empty_like(query)
    # a small workspace forces several query chunks
    scores = reconstruction_attention(query, key, value, pool, tables, lens, scale, out, workspace_bytes=1 << 16)
    want_out, want_scores = _brute_force(query, key, value, pool, tables, lens, scale)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(scores.double(), want_scores, atol=2e-6, rtol=1e-4)
    held = torch.arange(scores.shape[1]) < lens.unsqueeze(-1)
    assert (scores[~held] == 0).all()
    assert (scores[held] > 0).all()


def test_reconstruction_scores_follow_copying():
    """A query equal to one cached key (scaled up) gives that KV the top score: what
    repeating a token needs is that token's KV."""
    pool, batch, _ = make_case([1], 1, 2, 64, 16, torch.float32, 7, ragged=False, max_context=120)
    tables, lens = batch.block_tables[0], batch.head_lens[0]
    n = int(lens[0])
    target = n // 2
    page, offset = int(tables[0, target // 16]), target % 16
    query = (8.0 * pool.key_cache[page, offset]).expand(1, 2, 64).clone()
    key = torch.zeros((1, 1, 64))
    out = torch.empty_like(query)
    scores = reconstruction_attention(query, key, key.clone(), pool, tables, lens, 0.125, out)
    assert int(scores[0, :n].argmax()) == target


def test_the_repeat_instruction_in_the_models_tokens():
    """SmolLM2's tokenizer: the instruction's ids decode to it, no special tokens added."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "common"))
    from offline_assets import smollm2_checkpoint
    from transformers import AutoTokenizer

    from kvcompress.vllm_glue.reconstruction import REPEAT_INSTRUCTION, instruction_for

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint()))
    ids = instruction_for(tokenizer)
    assert tokenizer.decode(ids) == REPEAT_INSTRUCTION
    assert not set(ids) & set(tokenizer.all_special_ids)
