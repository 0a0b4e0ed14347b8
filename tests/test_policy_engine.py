"""Policies inside the real engine (shared tiny-model kvcompress engine, policy and rate
chosen per request): the budget split the worker applied, read back from its
per-layer statistics, has each policy's shape; the XKV profile script works."""

from __future__ import annotations

import json
import math
import random

import pytest

from conftest import TINY_KV_HEADS, TINY_LAYERS, load_benchmark, worker_page_stats
from eviction_oracle import check_what_survived, compress_one_and_read
from metric_oracle import AttentionMetricDefinition, prompt_metrics
from reconstruction_oracle import reconstruction_scores, surprisal_nats
from kvcompress.policies import POLICY_NAMES, load_layer_profile

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 900


def _block(llm) -> int:
    """The engine's page size (the platform default: 64 on CPU)."""
    return llm.llm_engine.vllm_config.cache_config.block_size


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(PROMPT_TOKENS)]


def _kept_by_layer(llm, policy: str, rate: float = 4.0) -> list[int]:
    """Unprotected KVs per layer kept by one compressed request of ``policy``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def kept():
        return worker_page_stats(llm)["kept_unprotected_by_layer"].get(policy, [0] * TINY_LAYERS)

    before = kept()
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True,
        extra_args={"kv_compress_rate": rate, "kv_compress_policy": policy},
    )  # fmt: skip
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=_prompt(len(policy)))], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    return [a - b for a, b in zip(kept(), before)]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_compresses_in_the_engine(kvc_tiny_llm, policy):
    layers = _kept_by_layer(kvc_tiny_llm, policy)
    block = _block(kvc_tiny_llm)
    # rate 4: keep max(128, 225) + 64 protected per head on average -> 225 unprotected.
    average = sum(layers) / (TINY_LAYERS * TINY_KV_HEADS)
    assert 225 - block <= average <= 225 + block, (policy, layers)
    if policy in ("snapkv", "h2o", "streamingllm", "random"):
        # Uniform: every head within one page of the others.
        assert max(layers) - min(layers) <= block * TINY_KV_HEADS, (policy, layers)
    if policy in ("pyramidkv", "ada-pyramidkv"):
        # Arithmetic schedule (beta 20): from 2B - B/20 down to B/20, B = the average;
        # Ada-KV moves budget between the heads of a layer, not between layers. Each
        # layer is within one page per head of its share (whole pages are evicted).
        expected = [(1.95 - 1.9 * layer / 3) * average * TINY_KV_HEADS for layer in range(4)]
        tolerance = block * TINY_KV_HEADS
        assert all(abs(a - e) <= tolerance for a, e in zip(layers, expected)), (policy, layers)
        assert layers == sorted(layers, reverse=True)
    stats = worker_page_stats(kvc_tiny_llm)
    assert stats["pages_freed_by_policy"][policy] > 0
    assert stats["evict_mismatches"] == 0


def test_xkv_profile_script(kvc_tiny_llm, tmp_path):
    profile = load_benchmark("xkv_profile").collect_profile(kvc_tiny_llm, [_prompt(1), _prompt(2)], rate=4.0)
    assert len(profile["layer_shares"]) == TINY_LAYERS
    assert sum(profile["layer_shares"]) == pytest.approx(1.0)
    out = tmp_path / "xkv.json"
    out.write_text(json.dumps(profile))
    assert load_layer_profile(out) == pytest.approx(tuple(profile["layer_shares"]))


def _prompt_positions_kept(llm, window: int | None, tag: str, policy: str = "snapkv") -> list[frozenset[int]]:
    """Per head, the prompt positions one ``policy`` request at rate 4 with scoring window
    ``window`` (None: the policy's) keeps after its compression (the request is aborted
    once it is read)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    before = worker_page_stats(llm)["compressions"]
    extra = {"kv_compress_rate": 4, "kv_compress_policy": policy}
    if window is not None:
        extra["kv_compress_observation_window"] = window
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, extra_args=extra)
    request_id = f"window-{window}-{tag}"
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=_prompt(99)), params)
    kept = None
    while kept is None and engine.has_unfinished_requests():
        engine.step()
        if worker_page_stats(llm)["compressions"] > before:
            (heads,) = llm.collective_rpc("kvc_kept_positions")[0].values()
            kept = [frozenset(p for p in positions if p < PROMPT_TOKENS) for positions in heads]
    engine.abort_request([request_id])
    while engine.has_unfinished_requests():
        engine.step()
    assert kept is not None, "the request was not compressed"
    return kept


def test_per_request_observation_window(kvc_tiny_llm):
    """A request's scoring window decides which KVs survive: the same window keeps the
    same prompt positions (deterministic), another window keeps other ones, with the
    same count per head (snapkv's uniform split)."""
    first = _prompt_positions_kept(kvc_tiny_llm, 8, "a")
    again = _prompt_positions_kept(kvc_tiny_llm, 8, "b")
    wide = _prompt_positions_kept(kvc_tiny_llm, 128, "c")
    assert first == again
    assert first != wide
    assert [len(head) for head in first] == [len(head) for head in wide]
    assert worker_page_stats(kvc_tiny_llm)["evict_mismatches"] == 0


def test_kvc_ea_keeps_kvcs_split_and_ranks_within_heads(kvc_tiny_llm):
    """kvc-ea hands each head's kvc values out again in the order of kvc's and the
    expected attention's scores together: every head keeps as many prompt KVs as under
    kvc (the split is kvc's), and some head keeps other ones."""
    kvc = _prompt_positions_kept(kvc_tiny_llm, None, "kvc", policy="kvc")
    ea = _prompt_positions_kept(kvc_tiny_llm, None, "kvc-ea", policy="kvc-ea")
    assert [len(head) for head in ea] == [len(head) for head in kvc]
    assert ea != kvc
    assert worker_page_stats(kvc_tiny_llm)["evict_mismatches"] == 0


@pytest.mark.parametrize("policy", ["kvc", "kvc-ea", "kvzip", "surprisal", "snapkv", "pyramidkv", "ada-snapkv", "h2o", "xkv", "streamingllm"])
def test_what_survives_a_compression_matches_an_independent_recount(kvc_tiny_llm, policy):
    """The engine's eviction checked by what survives, against the metrics the worker
    held just before (``eviction_oracle``: plain Python, no kvcompress op)."""
    recorded, kept = compress_one_and_read(kvc_tiny_llm, _prompt(500 + len(policy)), policy)
    check_what_survived(recorded, kept, policy, _block(kvc_tiny_llm))
    assert worker_page_stats(kvc_tiny_llm)["evict_mismatches"] == 0


def test_kvzip_scores_match_an_independent_reconstruction(kvc_tiny_llm, tiny_model):
    """The reconstruction pass's raw scores equal Hugging Face's attention for the same
    repeated prompt: the pass's forward (positions, cached KVs read per head, its own
    tokens causal, chunking) and its scores, checked end to end."""
    import torch

    prompt = _prompt(301)[:300]
    chunk = kvc_tiny_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert chunk < len(prompt)  # several chunks
    recorded, kept = compress_one_and_read(kvc_tiny_llm, prompt, "kvzip")
    scores = torch.tensor(recorded["reconstruction_scores"])
    want = reconstruction_scores(tiny_model, prompt, chunk)
    assert scores.shape == want.shape
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-3)
    check_what_survived(recorded, kept, "kvzip", _block(kvc_tiny_llm))


def test_surprisal_scores_match_an_independent_forward(kvc_tiny_llm, tiny_model):
    """The surprisal policy's per-token ``-log p``, taken from the engine's own hidden
    states across prefill chunks, equals Hugging Face's log-softmax for the same prompt;
    its sentence scores (fixed 64-token spans: the tiny engine has no tokenizer) are
    the normalised span means, in every head; and the eviction follows them."""
    import torch

    from kvcompress.ops.surprisal import MAX_SENTENCE_TOKENS

    prompt = _prompt(302)[:300]
    chunk = kvc_tiny_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert chunk < len(prompt)  # several chunks: positions at chunk edges predict the next chunk's first token
    recorded, kept = compress_one_and_read(kvc_tiny_llm, prompt, "surprisal")
    nats = torch.tensor(recorded["surprisal_nats"], dtype=torch.float64)
    want = surprisal_nats(tiny_model, prompt)
    assert nats.shape == want.shape and math.isnan(nats[0])
    torch.testing.assert_close(nats[1:], want[1:], atol=2e-3, rtol=1e-4)
    # Each span's mean over its known tokens, over the largest mean (plain Python).
    spans = [range(s, min(s + MAX_SENTENCE_TOKENS, len(prompt))) for s in range(0, len(prompt), MAX_SENTENCE_TOKENS)]
    means = [sum(float(want[p]) for p in span if p > 0) / sum(1 for p in span if p > 0) for span in spans]
    expected = {p: means[i] / max(means) for i, span in enumerate(spans) for p in span}
    protected = recorded["protected_window"]
    for head in recorded["heads"]:
        for position, metric in head:
            if position < recorded["context_len"] - protected:
                # later decode metrics only add attention probabilities (small) to it
                assert expected[position] - 1e-4 <= metric <= expected[position] + 0.05, (position, metric)
    check_what_survived(recorded, kept, "surprisal", _block(kvc_tiny_llm))


DOCUMENTED_METRICS = {
    "kvc": AttentionMetricDefinition(power=2, observation_window=32, pool_kernel=31, prompt_weight=1 / 8),
    "snapkv": AttentionMetricDefinition(power=1, observation_window=32, pool_kernel=7, prompt_weight=1 / 8),
    "pyramidkv": AttentionMetricDefinition(power=1, observation_window=8, pool_kernel=7, prompt_weight=1 / 8),
}
"""Prompt metrics as ``kvcompress/policies.py``'s table documents them (kvc: L2, the last
32 queries, max-pool 31; the tiny engine has no tokenizer, so no word spans), scaled by
1 / ``decode_metric_stride`` (8, the default ``kvc_tiny_llm`` keeps)."""

# The engine runs the model in float32 (its dtype), the oracle in float64. Float32
# rounding grows through the layers (and a logit's error is magnified by its size in
# the probability): Hugging Face's own float32 forward is up to 5.5e-5 (relative) off
# the float64 kvc metrics of a 400-token prompt; the engine, on this prompt, up to
# 1e-4 (layer 0: under 1e-5). 5e-4 leaves ~5x room; a changed definition moves the
# values far more (one query less in the window: up to 62%; plain probabilities,
# no GQA sum, no 1/8: factors).
METRIC_RTOL, METRIC_ATOL = 5e-4, 1e-10


@pytest.mark.parametrize("policy", sorted(DOCUMENTED_METRICS))
def test_prompt_metrics_match_a_float64_recomputation(kvc_tiny_llm, tiny_model, policy):
    """The metrics the worker held when it compressed a request equal a float64
    recomputation from Hugging Face's queries and keys (``metric_oracle``: the policy's
    last w queries, probabilities to its power, summed over each KV head's query group,
    scaled by 1/8, max-pooled) in every (layer, KV head) and position, with the window
    across two prefill chunks; and each head evicted the oracle's lowest-ranked
    unprotected KVs (up to ties within the tolerance at the cut)."""
    import torch

    definition = DOCUMENTED_METRICS[policy]
    prompt = _prompt(59)[:388]  # chunks of 128: both windows (356.., 380..) cross 384
    chunk = kvc_tiny_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert (len(prompt) - 1) // chunk != (len(prompt) - definition.observation_window) // chunk
    recorded, kept = compress_one_and_read(kvc_tiny_llm, prompt, policy)
    # Compressed right after its prefill: no decode query has added to the metrics yet.
    assert recorded["context_len"] == len(prompt)
    want = prompt_metrics(tiny_model, prompt, definition)
    assert want.shape == (TINY_LAYERS * TINY_KV_HEADS, len(prompt))
    # The record's heads are the cache's [layers, KV heads] flattened (diagnostics.head_slots):
    # index layer * num_kv_heads + kv_head, the oracle's order.
    got = torch.full_like(want, float("nan"))
    for head, pairs in enumerate(recorded["heads"]):
        positions, metrics = zip(*pairs)
        assert sorted(positions) == list(range(len(prompt)))  # uncompressed: every KV once
        got[head, list(positions)] = torch.tensor(metrics, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=METRIC_RTOL, atol=METRIC_ATOL)
    context, window = recorded["context_len"], recorded["protected_window"]
    unprotected = range(recorded["protected_prefix"], context - window)
    evicted_any = False
    for head, survivors in enumerate(kept):
        evicted = [float(want[head, p]) for p in unprotected if p not in survivors]
        held = [float(want[head, p]) for p in unprotected if p in survivors]
        if evicted and held:
            evicted_any = True
            assert max(evicted) <= min(held) * (1 + 2 * METRIC_RTOL) + METRIC_ATOL, head
    assert evicted_any
    check_what_survived(recorded, kept, policy, _block(kvc_tiny_llm))
