"""Compression inside the real vLLM engine (tiny random GQA Llama): memory is really
reclaimed, pressure compresses instead of preempting, preempted sequences are compressed
again, scheduler and worker agree on every page after every step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import (
    TINY_BYTES_PER_TOKEN,
    TINY_KV_HEADS,
    TINY_LAYERS,
    _shutdown,
    page_stats,
    tiny_kv_budget,
    worker_page_stats,
)

pytestmark = pytest.mark.engine

PROTECTED_WINDOW = 16
BLOCK = 16  # the paper's page size (the CPU default is 64): the bounds below are exact in it
# What every engine of this file shares: the tiny model's float32 weights, no tokenizer,
# no CUDA graphs, a fixed seed.
TINY_ENGINE = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0)


@pytest.fixture(scope="module")
def compress_llm(tiny_model):
    """kvcompress engine: rate 1 by default, rates set per request (``kv_compress_rate``)."""
    import kvcompress

    llm = kvcompress.LLM(
        tiny_model,
        kv_compress_protected_window=PROTECTED_WINDOW,
        kv_compress_block_size=BLOCK,
        max_model_len=2048,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        # 4096 tokens of pages, the per-head metadata on top (the bounds below need them)
        kv_cache_memory_bytes=tiny_kv_budget(4096, block_size=BLOCK, max_num_seqs=64, max_model_len=2048),
        **TINY_ENGINE,
    )
    yield llm
    _shutdown(llm)


def _prompt(length: int, seed: int):
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    return TokensPrompt(prompt_token_ids=rng.integers(3, 1000, length).tolist())


def _params(max_tokens: int, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)


def _kv_pages(request: dict, block_size: int) -> int:
    return sum(math.ceil(n / block_size) for layer in request["head_lens"] for n in layer)


def _rows_per_page(llm) -> int:
    """Slot metadata rows (block_size int32 positions, as many float32 metrics) a page's
    K / V bytes hold on the CPU engine (docs/design-61-metadata-rows.md)."""
    model = llm.llm_engine.vllm_config.model_config
    return model.get_head_size() * model.dtype.itemsize // 4


def _assert_exact_accounting(stats: dict, rows_per_page: int) -> None:
    """Every request here compresses: it holds the pages of its heads and the metadata
    pages of those, ceil(pages / rows_per_page)."""
    held_total = 0
    for request in stats["requests"].values():
        ceil_sum = _kv_pages(request, stats["block_size"])
        expected = ceil_sum + math.ceil(ceil_sum / rows_per_page)
        assert request["pages_held"] == expected
        held_total += expected
    assert held_total + stats["num_free"] == stats["num_pages"]


@pytest.mark.parametrize("rate", [2, 4, 8])
def test_compressing_a_prompt_frees_pages_down_to_the_budget(compress_llm, rate):
    """After prefill at rate r: pages held = ceil-sum of kept head lengths
    <= ceil((max(128, ceil(L/r)) + window) * L * H / b) + L * H (one decode token's pages)."""
    prompt_len = 1500
    engine = compress_llm.llm_engine
    before = page_stats(compress_llm)["compressions_after_prefill"]
    engine.add_request(f"mem-{rate}", _prompt(prompt_len, rate), _params(4, kv_compress_rate=rate))
    snapshot = None
    while engine.has_unfinished_requests():
        engine.step()
        stats = page_stats(compress_llm)
        _assert_exact_accounting(stats, _rows_per_page(compress_llm))
        if snapshot is None and stats["compressions_after_prefill"] > before:
            snapshot = stats
    assert snapshot is not None, "the sequence was never compressed"
    (request,) = snapshot["requests"].values()
    heads = TINY_LAYERS * TINY_KV_HEADS
    keep = max(128, math.ceil(prompt_len / rate)) + PROTECTED_WINDOW
    bound = math.ceil(keep * heads / BLOCK) + heads
    uncompressed = heads * math.ceil((prompt_len + 1) / BLOCK)
    kv_pages = _kv_pages(request, BLOCK)  # (the rest: its metadata pages, checked above)
    assert kv_pages <= bound
    assert kv_pages >= math.ceil(keep * heads / BLOCK)  # no over-eviction
    assert kv_pages < uncompressed / rate * 1.25
    # Heads are compressed at different rates but none lost its protected window.
    lens = np.array(request["head_lens"])
    assert lens.min() >= PROTECTED_WINDOW and lens.sum() >= keep * heads - heads * BLOCK
    final = page_stats(compress_llm)
    assert final["num_free"] == final["num_pages"] and final["mismatches"] == 0
    assert worker_page_stats(compress_llm)["evict_mismatches"] == 0


def test_memory_pressure_compresses_instead_of_preempting(compress_llm):
    """6 x 900-token prompts + 300 output tokens do not fit in 4096 tokens of KV memory
    uncompressed: with compression off per request vLLM preempts; at rate 2 the
    scheduler compresses grown sequences instead and nothing is preempted."""
    prompts = [_prompt(900, 100 + i) for i in range(6)]

    def run(extra):
        before = page_stats(compress_llm)
        outputs = compress_llm.generate(prompts, [_params(300, **extra) for _ in prompts], use_tqdm=False)
        after = page_stats(compress_llm)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [300] * 6
        assert after["num_free"] == after["num_pages"] and after["mismatches"] == 0
        return {k: after[k] - before[k] for k in ("num_preemptions", "compressions_instead_of_preemption")}

    uncompressed = run({"kv_compress": False})
    compressed = run({"kv_compress_rate": 2})
    assert uncompressed["num_preemptions"] > 0 and uncompressed["compressions_instead_of_preemption"] == 0
    assert compressed["compressions_instead_of_preemption"] > 0
    assert compressed["num_preemptions"] == 0


def test_waiting_requests_get_running_ones_recompressed(compress_llm):
    """24 x 1000-token prompts at rate 8 in 4096 tokens of pages: compressed after
    prefill, ~10 run at once and the rest wait for pages. While one waits, running
    requests are recompressed (``to_admit``, every PRESSURE_INTERVAL steps) instead of
    growing a page per head every page of tokens; never when nothing waited in the
    step before; every request completes, nothing is preempted, pages agree."""
    engine = compress_llm.llm_engine
    start = previous = page_stats(compress_llm)
    for index in range(24):
        engine.add_request(f"admit-{index}", _prompt(1000, 400 + index), _params(300, kv_compress_rate=8))
    waited, recompressing_steps, finished = False, 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = len(output.outputs[0].token_ids)
        stats = page_stats(compress_llm)
        _assert_exact_accounting(stats, _rows_per_page(compress_llm))
        if stats["compressions_to_admit"] > previous["compressions_to_admit"]:
            assert waited, "running requests recompressed for admission with nothing waiting"
            recompressing_steps += 1
        waited = stats["waiting"] > 0
        previous = stats
    assert finished == {f"admit-{index}": 300 for index in range(24)}
    assert recompressing_steps > 0
    assert previous["num_preemptions"] == start["num_preemptions"]
    assert previous["num_free"] == previous["num_pages"] and previous["mismatches"] == 0
    assert worker_page_stats(compress_llm)["evict_mismatches"] == 0


def test_preempted_compressed_sequence_is_compressed_again(compress_llm):
    """Uncompressed requests grow until vLLM must preempt; the victim (latest arrival) was
    compressed; after its recomputed prefill it is compressed again (the original fork's bug)."""
    prompts = [_prompt(1000, 200 + i) for i in range(3)] + [_prompt(900, 203)]
    params = [_params(400, kv_compress=False) for _ in range(3)] + [_params(300, kv_compress_rate=4)]
    before = page_stats(compress_llm)
    outputs = compress_llm.generate(prompts, params, use_tqdm=False)
    after = page_stats(compress_llm)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [400, 400, 400, 300]
    preempted = after["preempted_after_compression"] - before["preempted_after_compression"]
    recompressed = after["recompressed_after_preemption"] - before["recompressed_after_preemption"]
    assert preempted >= 1 and recompressed == preempted
    assert after["num_free"] == after["num_pages"] and after["mismatches"] == 0


def test_every_option_runs_in_the_engine(tiny_model):
    """KVC-full metric (L1), sink tokens, sum block cost and interval compression in one
    engine (one request with the random policy): sequences are compressed after prefill
    and again on the interval, the sinks and the protected window survive by position in
    every head, and scheduler and worker agree throughout."""
    import kvcompress

    llm = kvcompress.LLM(
        tiny_model,
        kv_compress_rate=4,
        kv_compress_protected_window=8,
        kv_compress_sink_tokens=4,
        kv_compress_min_cache_tokens=32,
        kv_compress_metric="l1",
        kv_compress_metric_queries="full",
        kv_compress_block_cost="sum",
        kv_compress_interval=16,
        kv_compress_max_kv_per_iteration=6000,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_cache_memory_bytes=4096 * TINY_BYTES_PER_TOKEN,
        **TINY_ENGINE,
    )
    try:
        engine = llm.llm_engine
        for index, length in enumerate([400, 520, 300, 610]):
            # One request evicts at random: only the protection keeps its sinks.
            extra = {"kv_compress_policy": "random"} if index == 1 else {}
            engine.add_request(f"opt-{index}", _prompt(length, 300 + index), _params(60, **extra))
        seen_compressed = False
        while engine.has_unfinished_requests():
            engine.step()
            stats = page_stats(llm)
            _assert_exact_accounting(stats, _rows_per_page(llm))
            # The worker's own view (the engine core keeps stepping between the calls):
            # a request is compressed when a head holds fewer KVs than its context.
            for heads in llm.collective_rpc("kvc_kept_positions")[0].values():
                context = max(max(positions) for positions in heads) + 1
                if min(len(positions) for positions in heads) == context:
                    continue
                seen_compressed = True
                # By position, in every head: the 4 sinks and the last 8 tokens (the
                # protected window of the last compression, or newer) are held, once.
                must = set(range(4)) | set(range(context - 8, context))
                for positions in heads:
                    assert len(set(positions)) == len(positions)
                    assert must <= set(positions), sorted(must - set(positions))
        stats = page_stats(llm)
        assert seen_compressed
        assert stats["compressions_after_prefill"] == 4
        assert stats["compressions_on_interval"] > 0
        assert stats["mismatches"] == 0 and stats["num_free"] == stats["num_pages"]
        assert worker_page_stats(llm)["evict_mismatches"] == 0
        _check_deferred_decode_metrics(llm)
    finally:
        _shutdown(llm)


def _check_deferred_decode_metrics(llm) -> None:
    """Decode metric queries scored in their own step (no queue: the kernel step's own
    pass, and a pass at every layer of a step with prompt rows) against the queue of
    kernel/decode_metrics.py, one and four query sets at a time: the last compression
    of each request reads the same metrics, while a request decodes through the prefill
    of two others (its metric rows ride in steps with prompt rows too), and the queue
    of four took fewer metric passes than the queue of one."""
    stride = 8  # the default decode metric stride: the query at position p adds when p % 8 == 0

    def run(tag: str, batch: int) -> tuple[dict, int, int]:
        previous_passes = llm.collective_rpc("kvc_defer_decode_metrics", args=(batch,))[0]
        llm.collective_rpc("kvc_record_compressions", args=(True,))
        engine = llm.llm_engine
        engine.add_request(f"{tag}-a", _prompt(300, 77), _params(80))
        # Another prompt joins after the decoding request's 3rd and 12th token: 900
        # tokens, four chunks of at most 256 each, one of them with a due metric row.
        joins = {3: "b", 12: "c"}
        generated, prefilling, due_in_prompt_steps = 0, set(), 0
        while engine.has_unfinished_requests():
            if generated in joins:
                name = joins.pop(generated)
                engine.add_request(f"{tag}-{name}", _prompt(900, 78 + ord(name)), _params(10))
                prefilling.add(f"{tag}-{name}")
            if prefilling and generated and (300 + generated - 1) % stride == 0:
                due_in_prompt_steps += 1
            for output in engine.step():
                if output.request_id == f"{tag}-a":
                    generated = len(output.outputs[0].token_ids)
                if output.outputs[0].token_ids:
                    prefilling.discard(output.request_id)
        recorded = llm.collective_rpc("kvc_record_compressions", args=(False,))[0]
        # vLLM appends a suffix to each request id: "{tag}-{name}-{suffix}"
        by_request = {key.split("-")[1]: value for key, value in recorded.items()}
        return by_request, previous_passes, due_in_prompt_steps

    oracle, backend_defers, due = run("noqueue", 0)
    if backend_defers < 0:
        pytest.skip("decode metrics are not deferred on this backend")
    assert due >= 2  # the queue's path for steps with prompt rows ran
    every_step, _, _ = run("queue1", 1)
    deferred, passes_every_step, _ = run("queue4", 4)
    passes_deferred = llm.collective_rpc("kvc_defer_decode_metrics", args=(4,))[0]
    assert 0 < passes_deferred < passes_every_step
    assert sorted(oracle) == sorted(every_step) == sorted(deferred) == ["a", "b", "c"]
    for name in oracle:
        for queued in (every_step[name], deferred[name]):
            one, other = oracle[name], queued
            assert one["evict_pages"] == other["evict_pages"]
            for head_one, head_other in zip(one["heads"], other["heads"], strict=True):
                positions_one, metrics_one = zip(*head_one)
                positions_other, metrics_other = zip(*head_other)
                assert positions_one == positions_other
                np.testing.assert_allclose(metrics_other, metrics_one, rtol=1e-5, atol=1e-7)
