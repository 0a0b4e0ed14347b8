"""Prefix caching with compression in the real engine (issue 17), tiny model.

- Rate 1 with ``--enable-prefix-caching``: greedy tokens identical to stock vLLM with
  prefix caching, the same cached tokens per request and the same
  ``vllm:prefix_cache_queries`` / ``_hits`` counters, for a request sequence with hits
  across steps and within one step; a request compressed at rate 8 caches its first
  128 tokens and a later uncompressed request that hits them gets stock's tokens.
- Rate 8 under KV pressure, requests of two system prompts added, aborted and finished
  in a random interleaving driven step by step: after every step a brute-force recount
  of every page reference the worker holds (live requests' tables + the cache's page
  groups) must equal the worker's page shares and free stack (no page freed while
  held, none leaked), and a cached block's pages and bytes never change while it
  stays cached (never moved, evicted or overwritten); the scheduler's counts agree with
  the worker's every step. At the end, after ``reset_prefix_cache``, every page is free.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from conftest import TINY_BYTES_PER_TOKEN, TINY_ENGINE_ARGS, _shutdown, greedy_tokens_and_logprobs

BLOCK = 64
PREFIX_ARGS = dict(TINY_ENGINE_ARGS, enable_prefix_caching=True, block_size=BLOCK)


def _prompts(seed: int, prefix_len: int, suffixes: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 1000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(5, 1000) for _ in range(n)] for n in suffixes]


def _waves(llm, waves, max_tokens: int = 24, with_extra: bool = True):
    """Generate wave after wave (each wave's requests together); every output in order.
    A wave entry is a prompt or ``(prompt, extra_args)`` (extra args dropped for stock)."""
    from vllm import SamplingParams, TokensPrompt

    outputs = []
    for wave in waves:
        prompts, params = [], []
        for entry in wave:
            prompt, extra = entry if isinstance(entry, tuple) else (entry, None)
            prompts.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0,
                                         ignore_eos=True, extra_args=extra if with_extra else None))
        outputs += llm.generate(prompts, params, use_tqdm=False)
    return outputs


def _prefix_cache_counters(llm) -> dict[str, float]:
    """vLLM's own ``vllm:prefix_cache_queries`` / ``_hits`` (what ``/metrics`` serves)."""
    names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    return {m.name: m.value for m in llm.get_metrics() if m.name in names}


def test_rate_1_with_prefix_caching_matches_stock_tokens_and_hits(tiny_model):
    from vllm import LLM

    import kvcompress
    from kvcompress.vllm_glue.llm import page_stats

    a = _prompts(1, 300, [40, 47, 54, 200])
    b = _prompts(2, 150, [10, 70])
    c = _prompts(3, 130, [300, 90])
    # Wave 1 computes a's prefix; wave 2 hits it (and b's copies hit each other in one
    # step); wave 3 repeats whole prompts (hits up to the last full block). Then c[0] is
    # compressed at rate 8 keeping (and caching) its first 128 tokens, and c[1] at rate 1
    # hits them: the compressed request never touched the pages it shares, so c[1]'s
    # tokens are stock's (stock caches c[0]'s first 2 blocks too: the third differs).
    compressed = {"kv_compress_rate": 8, "kv_compress_shared_prefix_tokens": 128}
    waves = [[a[0]], [a[1], a[2], b[0], b[1], b[0]], [a[3], a[0], b[1]], [(c[0], compressed)], [c[1]]]
    args = dict(PREFIX_ARGS, disable_log_stats=False)
    stock = LLM(model=tiny_model, **args)
    try:
        expected = _waves(stock, waves, with_extra=False)
        expected_counters = _prefix_cache_counters(stock)
    finally:
        _shutdown(stock)
    llm = kvcompress.LLM(tiny_model, kv_compress_rate=1, **args)
    try:
        got = _waves(llm, waves)
        counters = _prefix_cache_counters(llm)
        stats = page_stats(llm)
    finally:
        _shutdown(llm)
    tokens, expected_tokens = greedy_tokens_and_logprobs(got)[0], greedy_tokens_and_logprobs(expected)[0]
    assert stats["compressions"] == 1  # c[0], and only it
    assert tokens[:-2] + tokens[-1:] == expected_tokens[:-2] + expected_tokens[-1:]
    hits = [o.num_cached_tokens for o in got]
    assert hits == [o.num_cached_tokens for o in expected]
    assert sum(hits) >= 4 * 256 and hits[-1] == 128  # the sequence really hits
    assert counters == expected_counters and counters["vllm:prefix_cache_hits"] == sum(hits)
    assert stats["mismatches"] == 0


def _recount(dump: dict) -> Counter:
    references = Counter()
    for heads in dump["slots"].values():
        for pages in heads:
            references.update(pages)
    for pages in dump["groups"].values():
        references.update(pages)
    return references


def _check_pages(dump: dict, previous: dict | None) -> None:
    references = _recount(dump)
    free = dump["free"]
    assert len(set(free)) == len(free), "a page is twice on the free stack"
    held_and_free = set(free) & set(references)
    assert not held_and_free, f"pages {sorted(held_and_free)[:5]} are free but held"
    # Pages a compressing request's metadata rows are carved from (CPU): its own, once.
    row_pages = [page for pages in dump["row_pages"].values() for page in pages]
    assert len(set(row_pages)) == len(row_pages), "a metadata page is held twice"
    assert not set(row_pages) & (set(free) | set(references)), "a metadata page is free or holds KVs"
    leaked = set(range(dump["num_pages"])) - set(free) - set(references) - set(row_pages)
    assert not leaked, f"pages {sorted(leaked)[:5]} are neither free nor held"
    shares = dump["page_shares"]
    wrong = [p for p in range(dump["num_pages"]) if shares[p] != max(references[p] - 1, 0)]
    assert not wrong, f"page shares of {wrong[:5]} differ from the recount"
    if previous is None:
        return
    for block_id, pages in dump["groups"].items():
        if block_id in previous["groups"]:
            assert pages == previous["groups"][block_id], f"block {block_id}'s pages moved"
            assert dump["group_checksums"][block_id] == previous["group_checksums"][block_id], (
                f"block {block_id}'s KVs changed while cached"
            )


@pytest.fixture(scope="module")
def pressure_llm(tiny_model):
    import kvcompress

    # ~800 tokens of pages: a few requests of 200-500 tokens fill it.
    args = dict(PREFIX_ARGS, max_model_len=512, kv_cache_memory_bytes=800 * TINY_BYTES_PER_TOKEN)
    llm = kvcompress.LLM(tiny_model, kv_compress_rate=8, kv_compress_shared_prefix_tokens=128, **args)
    yield llm
    _shutdown(llm)


def test_shared_pages_survive_random_interleavings_and_all_free_after_reset(pressure_llm):
    from vllm import SamplingParams

    from kvcompress.vllm_glue.llm import page_stats

    llm = pressure_llm
    engine = llm.llm_engine
    rng = random.Random(7)
    systems = [_prompts(10 + i, n, [0])[0] for i, n in enumerate((200, 140))]
    live: list[str] = []
    hits = compressions = 0
    previous = None
    for step in range(160):
        if rng.random() < 0.35 and len(live) < 8:
            extra = rng.choice([{}, {"kv_compress_rate": 4}, {"kv_compress": False},
                                {"kv_compress_shared_prefix_tokens": 0}])
            prompt = rng.choice(systems) + [rng.randrange(5, 1000) for _ in range(rng.randrange(1, 260))]
            params = SamplingParams(max_tokens=rng.randrange(4, 40), temperature=0,
                                    ignore_eos=True, extra_args=extra)
            request_id = f"r{step}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            live.append(request_id)
        if live and rng.random() < 0.05:
            engine.abort_request([live.pop(rng.randrange(len(live)))])
        for output in engine.step():
            if output.finished:
                hits += output.num_cached_tokens or 0
                if output.request_id in live:
                    live.remove(output.request_id)
        dump = llm.collective_rpc("kvc_page_dump")[0]
        _check_pages(dump, previous)
        previous = dump
    while engine.has_unfinished_requests():
        engine.step()
    stats = page_stats(llm)
    compressions = stats["compressions"]
    assert stats["mismatches"] == 0 and stats["evict_mismatches"] == 0
    assert hits > 0 and compressions > 0, (hits, compressions)
    assert stats["num_preemptions"] + stats["compressions_instead_of_preemption"] > 0, "no KV pressure"
    assert previous["groups"], "nothing stayed cached"
    # Idle cached groups hold pages until the cache is cleared.
    dump = llm.collective_rpc("kvc_page_dump")[0]
    assert len(dump["free"]) < dump["num_pages"]
    assert llm.reset_prefix_cache()
    # The worker lets go of the groups at its next step: one request that caches nothing.
    llm.generate([{"prompt_token_ids": [7] * 70}],
                 SamplingParams(max_tokens=2, extra_args={"kv_compress_shared_prefix_tokens": 0}),
                 use_tqdm=False)
    dump = llm.collective_rpc("kvc_page_dump")[0]
    _check_pages(dump, None)
    assert not dump["groups"] and len(dump["free"]) == dump["num_pages"]
    stats = page_stats(llm)
    assert stats["num_free"] == stats["num_pages"] and stats["mismatches"] == 0
