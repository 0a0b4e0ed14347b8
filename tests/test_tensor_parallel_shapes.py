"""Tensor-parallel shapes beyond TP=2 on the tiny model (slow: more workers than cores).

- TP=4 on the tiny model (2 KV heads): vLLM replicates each KV head on two ranks, and each
  rank keeps its copy in its own pool, compressed by its own query heads' metrics. The
  scheduler counts T x max(1, H/T) = 4 per-rank heads.
- TP=3 on SmolLM2-135M (9 query / 3 KV heads; TP=2 is impossible in vLLM for it): the
  real model split over three ranks, one KV head each.

Oracles: stock vLLM at the same TP size (rate 1: tokens and logprobs equal) and the
scheduler's per-rank page check after every step, every page of every rank free at the end.
More workers than this machine's 2 cores: the workers share cores (set by hand, as a user
would: kvcompress's own binding refuses to oversubscribe).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import TINY_ENGINE_ARGS, _shutdown, environment, greedy_tokens_and_logprobs, page_stats

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _shared_binding(workers: int) -> str:
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[i * len(cores) // workers]) for i in range(workers))


def _run(model, engine_args, prompts, params, *, kvcompress_rate=None, then=None):
    """Greedy (tokens, logprobs) of one engine, and what ``then(llm)`` returns."""
    from vllm import LLM

    binding = _shared_binding(engine_args["tensor_parallel_size"])
    with environment(VLLM_CPU_OMP_THREADS_BIND=binding):
        if kvcompress_rate is None:
            llm = LLM(model=model, **engine_args)
        else:
            import kvcompress

            llm = kvcompress.LLM(model, kv_compress_rate=kvcompress_rate, **engine_args)
        try:
            tokens, logprobs = greedy_tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
            return tokens, logprobs, then(llm) if then else None
        finally:
            _shutdown(llm)


def _params(max_tokens, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          extra_args=extra or None)


def _token_prompts(lengths, seed):
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist()) for n in lengths]


def _pressure(tp, rate, seed):
    """The uncompressed / compressed mix that preempts: run it, return page stats."""
    def then(llm):
        rng = np.random.default_rng(seed)
        lengths = [500] * 3 + rng.integers(300, 800, 12).tolist()
        params = [_params(120, kv_compress=False)] * 3 + [_params(120, kv_compress_rate=rate)] * 12
        llm.generate(_token_prompts(lengths, seed), params, use_tqdm=False)
        return page_stats(llm)
    return then


def _assert_every_rank_in_step(stats, tp):
    assert stats["num_ranks"] == tp
    assert stats["compressions"] > 0 and stats["num_preemptions"] > 0
    assert stats["steps_checked"] >= 120
    assert stats["mismatches"] == 0 and stats["evict_mismatches"] == 0
    assert stats["free_by_rank"] == [stats["num_pages"] // tp] * tp


def test_replicated_kv_heads_at_tp4(tiny_model):
    tp = 4
    args = dict(TINY_ENGINE_ARGS, tensor_parallel_size=tp,
                kv_cache_memory_bytes=TINY_ENGINE_ARGS["kv_cache_memory_bytes"] // 2)
    prompts = _token_prompts([37, 200, 513, 90, 300, 700], seed=0)
    stock = _run(tiny_model, args, prompts, _params(24))
    kvc = _run(tiny_model, args, prompts, _params(24), kvcompress_rate=1, then=_pressure(tp, 8, 3))
    assert kvc[0] == stock[0]
    assert max(abs(a - b) for x, y in zip(kvc[1], stock[1]) for a, b in zip(x, y)) <= 1e-3
    stats = kvc[2]
    assert stats["num_kv_heads"] == tp  # 2 KV heads, each held by two ranks
    _assert_every_rank_in_step(stats, tp)


@pytest.mark.assets
def test_smollm2_at_tp3_is_token_exact_and_compresses_on_every_rank():
    from offline_assets import essay_text, paul_graham_essays, smollm2_checkpoint

    tp = 3
    model = str(smollm2_checkpoint())
    essays = paul_graham_essays()
    prompts = [essay_text(essays, i, 1500 + 700 * i)[: 1500 + 700 * i] + "\n\nSummary:" for i in range(4)]
    args = dict(tensor_parallel_size=tp, dtype="float32", enforce_eager=True, max_model_len=2048,
                max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20, seed=0)

    def compressed(llm):
        llm.generate(prompts, _params(64, kv_compress_rate=8), use_tqdm=False)
        return page_stats(llm)

    stock = _run(model, args, prompts, _params(32))
    kvc = _run(model, args, prompts, _params(32), kvcompress_rate=1, then=compressed)
    assert kvc[0] == stock[0]
    assert max(abs(a - b) for x, y in zip(kvc[1], stock[1]) for a, b in zip(x, y)) <= 1e-3
    stats = kvc[2]
    assert stats["num_ranks"] == tp and stats["compressions"] >= len(prompts)
    assert stats["mismatches"] == 0 and stats["evict_mismatches"] == 0
    assert stats["free_by_rank"] == [stats["num_pages"] // tp] * tp
