"""Tensor parallelism (TP=2, mp executor, a CPU core per rank) in the real engine.

Each rank holds one of the tiny model's two KV heads in its own page pool. Oracles:
stock vLLM at the same TP size (rate 1: nothing evicted, tokens and logprobs equal),
and the scheduler's per-rank page counts against every rank's worker after every step
(``mismatches``) and at the end (every page of every rank free).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import (
    TINY_BYTES_PER_TOKEN,
    TINY_ENGINE_ARGS,
    _shutdown,
    environment,
    greedy_tokens_and_logprobs,
    page_stats,
)

pytestmark = [pytest.mark.engine, pytest.mark.solo]  # solo: its ranks want both cores

TP = 2
# Per worker: half the single-device test's bytes, so each rank's pool (one KV head of
# the two) holds the same tokens as there: preemption at rate 1 and pressure at rate 8.
ENGINE_ARGS = dict(TINY_ENGINE_ARGS, tensor_parallel_size=TP,
                   kv_cache_memory_bytes=TINY_ENGINE_ARGS["kv_cache_memory_bytes"] // 2)
PROMPT_LENGTHS = [37, 200, 513, 90, 300, 700, 150, 64]
# Long enough for every request to grow past one of stock's 128-token blocks (the unit a
# rate-1 request is counted in), so the tight pools preempt.
OUTPUT_TOKENS = 160


def _prompts(lengths, seed=0):
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist()) for n in lengths]


def _params(max_tokens, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          extra_args=extra or None)


@pytest.fixture(scope="module")
def stock_tp_outputs(tiny_model):
    """Stock vLLM at TP=2 (it needs the core-per-rank binding the user would set)."""
    from vllm import LLM

    from kvcompress.vllm_glue.engine_setup import cpu_worker_binding

    # The binding kvcompress would set on a one-NUMA-node machine: a share of cores per rank.
    binding = cpu_worker_binding(TP, sorted(os.sched_getaffinity(0)), 1, "stock TP=2")
    with environment(VLLM_CPU_OMP_THREADS_BIND=binding):
        llm = LLM(model=tiny_model, **ENGINE_ARGS)
        try:
            return greedy_tokens_and_logprobs(
                llm.generate(_prompts(PROMPT_LENGTHS), _params(OUTPUT_TOKENS), use_tqdm=False)
            )
        finally:
            _shutdown(llm)


@pytest.fixture(scope="module")
def kvc_tp_llm(tiny_model, stock_tp_outputs):  # after stock's engine is gone (2 cores)
    import kvcompress

    from benchmarks.throughput.benchmark_throughput import engine_core_in_process

    # The engine core in this process (the TP workers are still their own processes): a
    # step runs when the test calls it, so scheduler and workers are read between steps.
    with environment(VLLM_CPU_OMP_THREADS_BIND=None), engine_core_in_process():  # kvcompress binds
        llm = kvcompress.LLM(tiny_model, kv_compress_rate=1, kv_compress_protected_window=16,
                             **ENGINE_ARGS)
    yield llm
    _shutdown(llm)


def _worker_stats(llm):
    return llm.collective_rpc("kvc_pages_used")


def test_rate_one_and_compression_off_are_token_exact_with_stock_at_the_same_tp(kvc_tp_llm, stock_tp_outputs):
    before = page_stats(kvc_tp_llm)
    tokens, logprobs = greedy_tokens_and_logprobs(
        kvc_tp_llm.generate(_prompts(PROMPT_LENGTHS), _params(OUTPUT_TOKENS), use_tqdm=False)
    )
    stock_tokens, stock_logprobs = stock_tp_outputs
    assert tokens == stock_tokens
    assert len({t for row in stock_tokens for t in row}) > 20  # not a repeated token
    assert max(abs(a - b) for x, y in zip(logprobs, stock_logprobs) for a, b in zip(x, y)) <= 1e-3
    after = page_stats(kvc_tp_llm)
    assert after["num_ranks"] == TP
    assert after["num_preemptions"] > before["num_preemptions"]  # the pools were tight
    assert after["mismatches"] == 0
    # Compression off for the request (the per-head cache, never compressed): the same.
    off = greedy_tokens_and_logprobs(kvc_tp_llm.generate(
        _prompts(PROMPT_LENGTHS), _params(OUTPUT_TOKENS, kv_compress=False), use_tqdm=False
    ))
    assert off[0] == stock_tokens
    assert max(abs(a - b) for x, y in zip(off[1], stock_logprobs) for a, b in zip(x, y)) <= 1e-3


PRESSURE_RATE = 8  # rate 4 passes too (checked); one rate keeps CI short


def _pressure_run(llm):
    """3 uncompressed requests beside 12 at PRESSURE_RATE, more than the pools hold:
    returns (tokens, stats before, stats after)."""
    before = page_stats(llm)
    rng = np.random.default_rng(PRESSURE_RATE)
    lengths = [500] * 3 + rng.integers(300, 800, 12).tolist()  # + 160 outputs <= 1024
    params = ([_params(160, kv_compress=False)] * 3
              + [_params(160, kv_compress_rate=PRESSURE_RATE)] * 12)
    outputs = llm.generate(_prompts(lengths, seed=PRESSURE_RATE), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], before, page_stats(llm)


def _assert_pressure_run_kept_every_rank_in_step(run):
    tokens, before, after = run
    assert all(len(row) == 160 for row in tokens)
    assert after["compressions"] > before["compressions"]
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["steps_checked"] - before["steps_checked"] >= 160
    assert after["mismatches"] == 0 and after["evict_mismatches"] == 0
    assert after["free_by_rank"] == [after["num_pages"] // TP] * TP


@pytest.fixture(scope="module")
def mp_pressure_run(kvc_tp_llm):
    return _pressure_run(kvc_tp_llm)


def test_compression_under_pressure_keeps_every_rank_in_step(kvc_tp_llm, mp_pressure_run):
    """Compression and preemption both happen (uncompressed requests beside compressed
    ones outgrow the pools); the scheduler's count of EVERY rank's pool agreed with that
    rank's worker after every step; all pages of every rank are free at the end."""
    _assert_pressure_run_kept_every_rank_in_step(mp_pressure_run)
    kvc_tp_llm.llm_engine.step()  # tells the workers of the requests the last step finished
    assert page_stats(kvc_tp_llm)["mismatches"] == 0
    workers = _worker_stats(kvc_tp_llm)
    assert len(workers) == TP
    num_pages = page_stats(kvc_tp_llm)["num_pages"]
    for worker in workers:
        assert worker["num_free"] == worker["num_pages"] == num_pages // TP
        assert worker["kvs_evicted"] > 0  # each rank evicted over its own head


def test_scheduler_holds_every_ranks_own_head_lengths_mid_run(kvc_tp_llm):
    """While requests run, the scheduler's per-head lengths are, head for head, those of
    the rank holding the head (rank r's heads are its slice of the scheduler's heads):
    rank 1's lengths come from rank 1's report, not a copy of rank 0's."""
    engine = kvc_tp_llm.llm_engine
    rng = np.random.default_rng(5)
    prompts = _prompts(rng.integers(400, 800, 4).tolist(), seed=5)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"mid-{index}", prompt, _params(64, kv_compress_rate=8))
    compared = ranks_differ = 0
    for _ in range(40):
        engine.step()
        scheduler = page_stats(kvc_tp_llm)["requests"]
        ranks = engine.collective_rpc("kvc_head_lens")
        for request_id, state in scheduler.items():
            if all(request_id in rank for rank in ranks):
                per_rank = [np.array(rank[request_id]) for rank in ranks]
                assert np.array_equal(np.array(state["head_lens"]), np.concatenate(per_rank, axis=1)), request_id
                compared += 1
                ranks_differ += not np.array_equal(per_rank[0], per_rank[1])
    assert compared >= 40
    assert ranks_differ > 0  # each rank compressed its head by its own metrics
    while engine.has_unfinished_requests():
        engine.step()
    assert page_stats(kvc_tp_llm)["mismatches"] == 0


def _first_compression_per_rank(llm, prompt, policy: str) -> list[dict]:
    """Run one request of ``policy`` at rate 4 to its end; every rank's recorded inputs
    of its first compression (``kvc_record_compressions``), in rank order."""
    engine = llm.llm_engine
    llm.collective_rpc("kvc_record_compressions", args=(True,))
    engine.add_request(f"{policy}-tp", prompt, _params(8, kv_compress_rate=4, kv_compress_policy=policy))
    recorded = None
    try:
        while engine.has_unfinished_requests():
            engine.step()
            per_rank = llm.collective_rpc("kvc_record_compressions", args=(True,))
            if recorded is None and all(per_rank):
                recorded = [next(iter(rank.values())) for rank in per_rank]
    finally:
        llm.collective_rpc("kvc_record_compressions", args=(False,))
    assert recorded is not None, f"{policy}: no compression"
    return recorded


def test_kvzip_reconstruction_runs_on_every_rank_over_its_own_heads(kvc_tp_llm, tiny_model):
    """kvzip at TP=2: every rank runs the reconstruction pass (its forward's collectives
    in step) over the KV head it holds; the ranks' raw scores side by side equal Hugging
    Face's eager attention for the repeated prompt (``reconstruction_oracle``)."""
    import torch
    from reconstruction_oracle import reconstruction_scores

    engine = kvc_tp_llm.llm_engine
    (prompt,) = _prompts([260], seed=11)
    recorded = _first_compression_per_rank(kvc_tp_llm, prompt, "kvzip")
    scores = torch.cat([torch.tensor(rank["reconstruction_scores"]) for rank in recorded], dim=1)
    chunk = engine.vllm_config.scheduler_config.max_num_batched_tokens
    want = reconstruction_scores(tiny_model, prompt["prompt_token_ids"], chunk)
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-3)
    assert page_stats(kvc_tp_llm)["mismatches"] == 0


def test_surprisal_scores_every_rank_from_the_whole_vocabulary(kvc_tp_llm, tiny_model):
    """surprisal at TP=2: the model's head is split over the ranks and its logits
    all-gathered, so every rank (each holding its own KV head) computes the same
    per-token surprisal, equal to Hugging Face's log-softmax."""
    import torch
    from reconstruction_oracle import surprisal_nats

    (prompt,) = _prompts([270], seed=12)
    recorded = _first_compression_per_rank(kvc_tp_llm, prompt, "surprisal")
    want = surprisal_nats(tiny_model, prompt["prompt_token_ids"])
    for rank in recorded:
        torch.testing.assert_close(torch.tensor(rank["surprisal_nats"], dtype=torch.float64)[1:], want[1:],
                                   atol=2e-3, rtol=1e-4)
    assert page_stats(kvc_tp_llm)["mismatches"] == 0


def test_the_output_vllm_reads_is_tp_rank_zeros_where_the_reports_are_gathered():
    """The reports are gathered to TP rank 0 (``tensor_parallel.gather_reports``); vLLM's mp
    executor reads the output of world rank ``world_size - tp * pcp`` (TP rank 0 of the
    last pipeline stage, rank 0 without PP) and Ray's compiled DAG ``refs[0]``, its
    first TP worker of the last stage. A vLLM that read another rank would drop them."""
    from types import SimpleNamespace

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    for tp in (1, 2, 4):
        executor = SimpleNamespace(
            world_size=tp,
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1),
        )
        assert MultiprocExecutor._get_output_rank(executor) == 0


# --- vLLM's Ray executor (RayExecutorV2) on CPU, through patches/ray_cpu.py -------------
# Last in this module: its engine starts after the mp engine's tests, and stops that
# engine first (2 cores; an idle engine's workers still poll).


@pytest.fixture(scope="module")
def ray_tp_llm(tiny_model, kvc_tp_llm, mp_pressure_run):
    import kvcompress
    import ray  # noqa: F401  (the [ray] extra; scripts/install_cpu.sh installs it)

    _shutdown(kvc_tp_llm)
    # kvcompress binds the workers; RAY_ADDRESS "local": a Ray cluster of its own, never a
    # running one (the engine core, its own process, starts and stops it).
    with environment(VLLM_CPU_OMP_THREADS_BIND=None, RAY_ADDRESS="local"):
        llm = kvcompress.LLM(tiny_model, kv_compress_rate=1, kv_compress_protected_window=16,
                             distributed_executor_backend="ray", **ENGINE_ARGS)
    yield llm
    _shutdown(llm)


def test_ray_executor_runs_a_ray_worker_per_rank_bound_like_mp(ray_tp_llm):
    """The workers are Ray actors (one per TP rank), each bound to its own core as
    vLLM's mp executor binds its workers (kvcompress's default binding: one core each)."""
    workers = ray_tp_llm.collective_rpc("kvc_process_info")
    assert len(workers) == TP
    assert all(w["ray_actor_id"] for w in workers)
    assert len({w["pid"] for w in workers}) == TP
    cores = [tuple(w["cores"]) for w in workers]
    assert len(set(cores)) == TP  # each its own share of the cores
    assert all(len(c) == len(cores[0]) == w["threads"] for c, w in zip(cores, workers))


def test_ray_executor_rate_one_and_compression_off_are_token_exact_with_stock(ray_tp_llm, stock_tp_outputs):
    tokens, logprobs = greedy_tokens_and_logprobs(
        ray_tp_llm.generate(_prompts(PROMPT_LENGTHS), _params(OUTPUT_TOKENS), use_tqdm=False)
    )
    stock_tokens, stock_logprobs = stock_tp_outputs
    assert tokens == stock_tokens
    assert max(abs(a - b) for x, y in zip(logprobs, stock_logprobs) for a, b in zip(x, y)) <= 1e-3
    off = greedy_tokens_and_logprobs(ray_tp_llm.generate(
        _prompts(PROMPT_LENGTHS), _params(OUTPUT_TOKENS, kv_compress=False), use_tqdm=False
    ))
    assert off[0] == stock_tokens
    assert max(abs(a - b) for x, y in zip(off[1], stock_logprobs) for a, b in zip(x, y)) <= 1e-3
    assert page_stats(ray_tp_llm)["mismatches"] == 0


def test_ray_executor_under_pressure_matches_the_mp_executor(ray_tp_llm, mp_pressure_run):
    """The same compressed, preempting workload on both executors: every rank in step on
    Ray too, and the same tokens as on mp (compression is deterministic per rank)."""
    ray_run = _pressure_run(ray_tp_llm)
    _assert_pressure_run_kept_every_rank_in_step(ray_run)
    assert ray_run[0] == mp_pressure_run[0]

