"""``benchmarks/quality/ppl_eviction_ceiling.py``: its attention equals Hugging Face's eager
attention on the tiny Llama, its masking drops exactly the KVs it is told to (checked
against eager attention on a cache holding only the kept KVs), and its selections
equal brute-force ones."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import load_benchmark


@pytest.fixture(scope="module")
def ceiling():
    return load_benchmark("ppl_eviction_ceiling")


@pytest.fixture(scope="module")
def models(ceiling, tiny_model):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ceiling.ATTENTION_NAME, ceiling.attention)
    mine = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                attn_implementation=ceiling.ATTENTION_NAME).eval()
    eager = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation="eager").eval()  # fmt: skip
    return mine, eager


def test_attention_equals_eager_and_records_scores(ceiling, models):
    mine, eager = models
    ids = torch.randint(0, mine.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ceiling.RECORDER = ceiling.Recorder(prompt_len=30, window=4)
    with torch.inference_mode():
        out = mine(input_ids=ids[:, :30], use_cache=True)
        want = eager(input_ids=ids[:, :30], output_attentions=True)
        torch.testing.assert_close(out.logits, want.logits, atol=1e-4, rtol=1e-4)
        group = mine.config.num_attention_heads // mine.config.num_key_value_heads
        for layer, probs in enumerate(want.attentions):  # [1, Hq, 30, 30]
            grouped = probs[0].double().view(-1, group, 30, 30)
            torch.testing.assert_close(ceiling.RECORDER.window_scores[layer],
                                       grouped[:, :, -4:].square().sum(dim=(1, 2)), atol=1e-6, rtol=1e-5)  # fmt: skip
        # the continuation on the cache: the same logits as eager over all 40 tokens
        ceiling.RECORDER.mode = "future"
        cont = mine(input_ids=ids[:, 30:], position_ids=torch.arange(30, 40).unsqueeze(0),
                    past_key_values=out.past_key_values, use_cache=True)  # fmt: skip
        whole = eager(input_ids=ids)
    torch.testing.assert_close(cont.logits, whole.logits[:, 30:], atol=1e-4, rtol=1e-4)


def test_masked_continuation_equals_a_cache_of_the_kept_kvs(ceiling, models):
    """Continuation queries on a masked cache = eager attention over the kept KVs alone:
    drop keys from the cache by hand (the prompt's K/V from the full prefill, the same
    positions) and compare the continuation's logits."""
    mine, _ = models
    config = mine.config
    ids = torch.randint(0, config.vocab_size, (1, 28), generator=torch.Generator().manual_seed(1))
    prompt_len, heads = 20, config.num_key_value_heads
    keep = torch.rand((config.num_hidden_layers, heads, prompt_len), generator=torch.Generator().manual_seed(2)) < 0.5
    keep[..., -2:] = True
    ceiling.RECORDER = ceiling.Recorder(prompt_len=prompt_len, window=2)
    with torch.inference_mode():
        out = mine(input_ids=ids[:, :prompt_len], use_cache=True)
        ceiling.RECORDER.mode = "masked"
        ceiling.RECORDER.keep = {layer: keep[layer] for layer in range(config.num_hidden_layers)}
        positions = torch.arange(prompt_len, 28).unsqueeze(0)
        masked = mine(input_ids=ids[:, prompt_len:], position_ids=positions,
                      past_key_values=out.past_key_values, use_cache=True).logits  # fmt: skip
        # brute force: per layer and head, a softmax over the kept prompt KVs + the new ones
        out.past_key_values.crop(-(28 - prompt_len))
        reference = _masked_by_hand(ceiling, mine, ids, prompt_len, keep, out.past_key_values)
    torch.testing.assert_close(masked, reference, atol=1e-4, rtol=1e-4)


def _masked_by_hand(ceiling, model, ids, prompt_len, keep, cache):
    """The continuation with each layer's attention done in float64 loops over (head,
    query), reading only the kept prompt KVs."""

    def loops(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        _, num_q, num_queries, dim = query.shape
        group = num_q // key.shape[1]
        out = torch.zeros((1, num_queries, num_q, dim), dtype=torch.float64)
        first = key.shape[2] - num_queries
        for j in range(num_q):
            h = j // group
            for t in range(num_queries):
                visible = [k for k in range(first + t + 1)
                           if k >= prompt_len or bool(keep[module.layer_idx, h, k])]  # fmt: skip
                logits = torch.stack([query[0, j, t].double() @ key[0, h, k].double() for k in visible]) * scaling
                probs = torch.softmax(logits, dim=0)
                out[0, t, j] = sum(p * value[0, h, k].double() for p, k in zip(probs, visible))
        return out.float(), None

    from transformers import AttentionInterface

    AttentionInterface.register("ceiling_test_loops", loops)
    model.config._attn_implementation = "ceiling_test_loops"
    try:
        positions = torch.arange(prompt_len, ids.shape[1]).unsqueeze(0)
        return model(input_ids=ids[:, prompt_len:], position_ids=positions, past_key_values=cache).logits
    finally:
        model.config._attn_implementation = ceiling.ATTENTION_NAME


def test_selections_match_brute_force(ceiling):
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand((3, 2, 50), generator=gen, dtype=torch.float64)
    protected, rate = 5, 4
    keep = ceiling.select(scores, rate, protected)
    budget = 3 * 2 * math.ceil(50 / rate)
    flat = sorted(((float(scores[l, h, p]), (l, h, p)) for l in range(3) for h in range(2) for p in range(45)),
                  reverse=True)  # fmt: skip
    want = torch.zeros_like(keep)
    want[..., 45:] = True
    for _, (l, h, p) in flat[:budget]:
        want[l, h, p] = True
    assert torch.equal(keep, want)
    counts = torch.tensor([[3, 0], [7, 45], [1, 2]])
    per_head = ceiling.select_per_head(scores, counts, protected)
    for l in range(3):
        for h in range(2):
            top = sorted(range(45), key=lambda p: -float(scores[l, h, p]))[: int(counts[l, h])]
            assert sorted(torch.nonzero(per_head[l, h, :45]).flatten().tolist()) == sorted(top)
            assert per_head[l, h, 45:].all()


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, ceiling) -> torch.Tensor:
    """Hugging Face Llama's RoPE of ``x [..., P, D]`` at ``positions [P]`` (float64)."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + ceiling.rotate_half(x) * sin


def test_expected_attention_of_one_known_query_is_its_attention(ceiling):
    """Every prompt query the same vector before RoPE (no spread) and a horizon of one
    position: the expected attention is exactly that query's attention at the next
    position, which is computed here directly."""
    gen = torch.Generator().manual_seed(3)
    heads, group, length, dim = 2, 3, 20, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim))
    pre = torch.randn(heads, group, 1, dim, generator=gen, dtype=torch.float64).expand(heads, group, length, dim)
    q = _rope(pre, torch.arange(length), inv_freq, ceiling)
    keys = torch.randn(heads, length, dim, generator=gen, dtype=torch.float64)
    values = torch.randn(heads, length, dim, generator=gen, dtype=torch.float64)
    got = ceiling.expected_scores(q, keys, values, inv_freq, dim**-0.5, stats_queries=length, horizon=1)
    next_query = _rope(pre[:, :, :1], torch.tensor([length]), inv_freq, ceiling)  # [H, G, 1, D]
    want = torch.softmax(torch.einsum("hgqd,hpd->hgqp", next_query, keys) * dim**-0.5, -1).sum(dim=(1, 2))
    torch.testing.assert_close(got["expected"], want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got["expected+vnorm"], want * values.norm(dim=-1), rtol=1e-9, atol=1e-12)


def test_expected_attention_equals_monte_carlo_over_the_query_gaussian(ceiling):
    """Spread queries, horizon one: ``E[exp(s q.k)]`` under the Gaussian of the recent
    queries (their sample mean and covariance, rotated to the next position) against an
    average over 400k queries drawn from it; normalised over the keys."""
    gen = torch.Generator().manual_seed(5)
    heads, group, length, dim = 1, 2, 24, 4
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim))
    pre = 0.7 * torch.randn(heads, group, length, dim, generator=gen, dtype=torch.float64)
    q = _rope(pre, torch.arange(length), inv_freq, ceiling)
    keys = torch.randn(heads, length, dim, generator=gen, dtype=torch.float64)
    got = ceiling.expected_scores(q, keys, keys, inv_freq, dim**-0.5, stats_queries=length, horizon=1)
    want = torch.zeros(heads, length, dtype=torch.float64)
    for g in range(group):
        torch.manual_seed(g)
        samples = torch.distributions.MultivariateNormal(pre[0, g].mean(0), torch.cov(pre[0, g].T))
        drawn = samples.sample((400_000,))
        rotated = _rope(drawn, torch.full((1,), length), inv_freq, ceiling)  # [N, D]
        expected_exp = torch.exp(rotated @ keys[0].T * dim**-0.5).mean(0)  # [P]
        want[0] += expected_exp / expected_exp.sum()
    torch.testing.assert_close(got["expected"], want, rtol=2e-2, atol=1e-4)


def test_kvc_plus_expected_sums_the_two_per_head_distributions(ceiling):
    gen = torch.Generator().manual_seed(9)
    rec = ceiling.Recorder(prompt_len=12, window=4)
    for layer in range(2):
        rec.window_scores[layer] = torch.rand(3, 12, generator=gen, dtype=torch.float64)
        rec.future_scores[layer] = torch.rand(3, 12, generator=gen, dtype=torch.float64)
        rec.extra_scores.setdefault("expected", {})[layer] = torch.rand(3, 12, generator=gen, dtype=torch.float64)
    got = ceiling.recorded_scorings(rec, [0, 1], 1, ["kvc+expected"], False)["kvc+expected"]
    for layer in range(2):
        for head in range(3):
            kvc, expected = rec.window_scores[layer][head], rec.extra_scores["expected"][layer][head]
            want = kvc / kvc.sum() + expected / expected.sum()
            torch.testing.assert_close(got[layer, head], want)
