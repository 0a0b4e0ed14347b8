"""A model with sliding-window layers through the real engine (issue 60), in the default run:
a tiny random Llama whose layers 0, 1 and 3 attend to the last 96 tokens (layer 2 to all),
prompts of 300-600 tokens in 128-token prefill chunks, so the window moves past several
64-token pages of every windowed head.

Oracle: stock vLLM on the same checkpoint (its own sliding-window KV cache manager). At rate
1 kvcompress gives its greedy tokens and logprobs while the windowed heads give back their
pages behind the window; at rate 8 the full-attention layer is compressed as well, and the
scheduler's and the worker's page counts never disagree.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_BYTES_PER_TOKEN, TINY_HEAD_DIM, TINY_KV_HEADS, TINY_LAYERS, greedy_tokens_and_logprobs, page_stats

pytestmark = pytest.mark.engine

WINDOW, SLIDING_LAYERS = 96, (0, 1, 3)
ENGINE_ARGS = dict(
    skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=8,
    max_num_batched_tokens=128, kv_cache_memory_bytes=4000 * TINY_BYTES_PER_TOKEN, seed=0,
)


@pytest.fixture(scope="module")
def windowed_model() -> str:
    from offline_assets import tiny_llama_checkpoint

    return str(tiny_llama_checkpoint(
        num_layers=TINY_LAYERS, num_q_heads=8, num_kv_heads=TINY_KV_HEADS, head_dim=TINY_HEAD_DIM,
        sliding_window=WINDOW, sliding_layers=SLIDING_LAYERS,
    ))


def _prompts(count: int = 4, seed: int = 3):
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1024, int(n)).tolist())
            for n in rng.integers(300, 600, count)]


def _generate(llm, rate: float | None = None, max_tokens: int = 40):
    from vllm import SamplingParams

    extra = None if rate is None else {"kv_compress_rate": rate}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, extra_args=extra)
    return greedy_tokens_and_logprobs(llm.generate(_prompts(), params, use_tqdm=False))


@pytest.fixture(scope="module")
def stock_greedy(windowed_model):
    from vllm import LLM

    from kvcompress.vllm_glue.llm import shutdown

    llm = LLM(model=windowed_model, **ENGINE_ARGS)
    try:
        return _generate(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def kvc_llm(windowed_model):
    import kvcompress
    from kvcompress.vllm_glue.llm import shutdown

    llm = kvcompress.LLM(windowed_model, kv_compress_rate=1, kv_compress_protected_window=8, **ENGINE_ARGS)
    yield llm
    shutdown(llm)


def test_rate_1_equals_stock_while_windowed_heads_give_back_their_pages(stock_greedy, kvc_llm):
    tokens, logprobs = _generate(kvc_llm)
    stock_tokens, stock_logprobs = stock_greedy
    assert tokens == stock_tokens
    assert max(abs(a - b) for x, y in zip(logprobs, stock_logprobs) for a, b in zip(x, y)) < 1e-3
    stats = page_stats(kvc_llm)
    # 3 windowed layers x 2 KV heads drop a page per 64 tokens the window moves past.
    assert stats["window_pages_freed"] >= 4 * 3 * TINY_KV_HEADS * ((300 - WINDOW) // 64)
    assert stats["compressions"] == 0 and stats["mismatches"] == 0 and stats["evict_mismatches"] == 0
    assert stats["num_free"] == stats["num_pages"]


def test_rate_8_compresses_the_full_layer_and_counts_agree(kvc_llm):
    before = page_stats(kvc_llm)
    tokens, _ = _generate(kvc_llm, rate=8)
    assert all(len(t) == 40 for t in tokens)
    stats = page_stats(kvc_llm)
    assert stats["compressions"] > before["compressions"] and stats["pages_freed"] > before["pages_freed"]
    assert stats["window_pages_freed"] > before["window_pages_freed"]
    assert stats["mismatches"] == 0 and stats["evict_mismatches"] == 0
    assert stats["num_free"] == stats["num_pages"]
    worker = kvc_llm.collective_rpc("kvc_pages_used")[0]
    assert worker["window_pages_freed"] == stats["window_pages_freed"] and worker["evict_mismatches"] == 0
