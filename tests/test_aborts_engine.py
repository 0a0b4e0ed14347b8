"""Aborts at any point of a step: the scheduler/worker cross-check stays exact and no
page leaks (real engine, tiny model).

vLLM's engine core applies aborts between the model step and ``update_from_output``
(``EngineCore.step`` → ``_process_aborts_queue``): the worker's report of that step
still counts the aborted requests' pages. The oracle: the scheduler's own count of
mismatches stays 0, and at idle every page is free on both sides.
"""

from __future__ import annotations

import random
import time

import pytest

from conftest import page_stats, worker_page_stats

pytestmark = pytest.mark.engine


def _params(index: int):
    from vllm import SamplingParams

    extra = {"kv_compress_rate": 4} if index % 2 else None  # half are compressed
    return SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0, extra_args=extra)


def _prompt(index: int, length: int):
    from vllm.inputs import TokensPrompt

    rng = random.Random(index)
    return TokensPrompt(prompt_token_ids=[rng.randrange(5, 1000) for _ in range(length)])


def _run_with_aborts(llm, round_index: int) -> int:
    """Add 8 requests, abort 5 of them at scattered moments while the engine core
    runs; returns how many steps the test drove."""
    engine = llm.llm_engine
    rng = random.Random(round_index)
    ids = [f"abort-{round_index}-{i}" for i in range(8)]
    for index, request_id in enumerate(ids):
        engine.add_request(request_id, _prompt(index + 10 * round_index, rng.randrange(150, 420)), _params(index))
    victims = rng.sample(ids, 5)
    abort_at = sorted(rng.randrange(0, 25) for _ in victims)
    steps = 0
    while engine.has_unfinished_requests():
        while abort_at and abort_at[0] <= steps:
            abort_at.pop(0)
            # a short random pause lands the abort anywhere inside the core's step
            time.sleep(rng.random() * 0.01)
            engine.abort_request([victims.pop()])
        engine.step()
        steps += 1
    return steps


def test_aborts_during_steps_keep_accounting_exact_and_leak_nothing(kvc_tiny_llm):
    before = page_stats(kvc_tiny_llm)
    in_flight = 0
    for round_index in range(6):
        _run_with_aborts(kvc_tiny_llm, round_index)
        in_flight = page_stats(kvc_tiny_llm)["released_in_flight"] - before["released_in_flight"]
        if in_flight >= 2:
            break
    after = page_stats(kvc_tiny_llm)
    # the point under test: aborts did land while the worker ran a step
    assert in_flight > 0, "no abort landed inside a step; the test proved nothing"
    assert after["mismatches"] == before["mismatches"]
    assert after["steps_checked"] > before["steps_checked"]
    assert after["num_free"] == after["num_pages"] and not after["requests"]
    worker = worker_page_stats(kvc_tiny_llm)
    assert worker["num_free"] == worker["num_pages"] == after["num_pages"]
    assert worker["live_requests"] == 0
