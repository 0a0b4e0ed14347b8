"""Loose check of the max-batch benchmark: under one KV memory budget, kvcompress at
rate r decodes about r times as many requests at once as stock vLLM
(benchmarks/throughput/bench_max_batch.py prints the full table for r in {2, 4, 8})."""

from __future__ import annotations

import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.engine


def test_max_decode_batch_grows_with_the_rate():
    bench = load_benchmark("bench_max_batch")
    results = bench.measure(rates=(4,), prompt_len=1024, output_len=32, kv_tokens=8192)
    bench.print_table(results)
    stock, kvc = results["rows"]
    assert stock["engine"] == "stock vLLM" and stock["max_decode_batch"] >= 4
    assert stock["finished"] == kvc["finished"] == results["num_prompts"]
    assert kvc["mismatches"] == 0
    # Loose: the benchmark's goal is >= 0.8 r; allow noise from scheduling granularity.
    assert kvc["max_decode_batch"] >= 0.6 * 4 * stock["max_decode_batch"]
