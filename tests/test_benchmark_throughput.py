"""Smoke tests of the throughput benchmark (benchmarks/throughput/benchmark_throughput.py) and of the
kvcompress flags through vLLM's own ``vllm bench throughput``."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.engine


def test_benchmark_throughput_smoke(tmp_path):
    bench = load_benchmark("benchmark_throughput")
    prefix = tmp_path / "throughput"
    num_prompts, output_len = 16, 16
    # Its own process: the benchmark's in-process engine cores pin the caller's threads.
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "throughput" / "benchmark_throughput.py"
    done = subprocess.run(
        [
            sys.executable, str(script),
            "--rates", "1", "4", "--input-lens", "512", "--num-prompts", str(num_prompts),
            "--output-len", str(output_len), "--kv-tokens", "2048", "--output-prefix", str(prefix),
            "--no-progress", "--repeats", "2",
        ],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| 512 | kvcompress | 4 |" in done.stdout
    saved = json.loads(prefix.with_suffix(".json").read_text())
    assert saved["kv_cache_memory_bytes"] == 2048 * saved["kv_bytes_per_token"]
    assert saved["kv_budget_tokens_uncompressed"] == 2048
    # kvcompress's split of the KV memory adds up, and its pages are vLLM's blocks: on CPU
    # the slot metadata is the pages holding the identity rows, past them (requests that
    # compress hold pages for their own rows, out of "pages").
    split = saved["kvcompress_memory_split"]
    assert sum(split.values()) == saved["kv_cache_memory_bytes"] and min(split.values()) >= 0, split
    block_bytes = saved["kvcompress_block_size"] * saved["kv_bytes_per_token"]
    assert split["pages"] == saved["kvcompress_num_blocks"] * block_bytes, split
    assert split["slot_metadata"] > 0 and split["unused"] < 2 * block_bytes, split  # a block + its metadata
    with open(prefix.with_suffix(".csv")) as handle:
        csv_rows = list(csv.DictReader(handle))
    assert [(r["engine"], float(r["rate"])) for r in csv_rows] == [
        ("stock vLLM", 1.0), ("kvcompress", 1.0), ("kvcompress", 4.0),
    ]  # fmt: skip
    assert "| 512 | kvcompress | 4 |" in prefix.with_suffix(".md").read_text()
    for figure in ("throughput-multiplier", "max-batch", "throughput-by-input"):
        # palette PNGs (plots.save_figure): empty axes are ~4-4.7 KB, a drawn chart more
        assert (tmp_path / f"throughput-{figure}.png").stat().st_size > 5_000, figure
    assert done.stdout.strip().splitlines()[-1].startswith("summary: input 512: rate ")

    rows = {(r["engine"], r["rate"]): r for r in saved["rows"]}
    for row in rows.values():
        assert row["input_len"] == 512
        assert row["finished"] == num_prompts
        assert row["output_tokens"] == num_prompts * output_len
        assert row["prompt_tokens"] == num_prompts * 512
        for key in ("throughput_multiplier", "max_batch_multiplier", "total_tokens_per_s", "requests_per_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["preemptions"] is not None and row["preemptions"] >= 0
        # Tokens computed again: none without a preemption, some after one.
        assert row["recomputed_tokens"] >= 0 and (row["recomputed_tokens"] > 0) == (row["preemptions"] > 0), row
    stock, kvc1, kvc4 = rows[("stock vLLM", 1.0)], rows[("kvcompress", 1.0)], rows[("kvcompress", 4.0)]
    assert stock["throughput_multiplier"] == 1.0
    assert kvc4["max_decode_batch"] > stock["max_decode_batch"]
    assert kvc4["pages_freed"] > 0 and kvc1["pages_freed"] == 0
    assert kvc1["mismatches"] == kvc4["mismatches"] == 0
    assert 0 <= kvc4["compress_share_of_step_time"] < 1
    assert kvc1["throughput_vs_rate1"] == 1.0 and stock["throughput_vs_rate1"] is None

    # Two repetitions (kvcompress first in the second): a row is the faster run (the
    # lower middle of two), and every run is listed with its own ratio to stock's.
    assert saved["repeats"] == 2
    for row in rows.values():
        assert len(row["repeat_seconds"]) == 2 and row["seconds"] == min(row["repeat_seconds"])
        assert row["total_tokens_per_s"] in row["repeat_total_tokens_per_s"]
    report = prefix.with_suffix(".md").read_text()
    assert "## Repetitions" in report and "2 repetitions" in report
    each = [line for line in report.splitlines() if line.startswith("| 512 | kvcompress | 4 |")][-1]
    assert each.count(",") == 2  # two runs' tok/s and two ratios
    # The paired figure: the median of each repetition's kvcompress / stock ratio.
    ratios = [a / b for a, b in zip(kvc4["repeat_total_tokens_per_s"], stock["repeat_total_tokens_per_s"])]
    assert kvc4["paired_multiplier_median"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert stock["paired_multiplier_median"] is None
    assert each.endswith(f"| {kvc4['paired_multiplier_median']:.2f} |")

    # Step split: every request's first token comes from a prompt step, so decode steps
    # produce at most the other tokens; at rate 1 kvcompress schedules like stock.
    for row in rows.values():
        decode_tokens = row["decode_steps"] * row["mean_decode_step_batch"]
        assert 0 < decode_tokens <= num_prompts * (output_len - 1), row
        assert row["mean_decode_step_batch"] <= row["max_decode_batch"]
        assert 0 < row["prefill_step_seconds"] + row["decode_step_seconds"] <= row["seconds"]
    assert kvc1["decode_steps"] == stock["decode_steps"]
    assert kvc4["decode_steps"] < stock["decode_steps"]
    assert stock["ideal_multiplier"] is None and kvc1["ideal_multiplier"] == 1.0
    assert 1.0 < kvc4["ideal_multiplier"] < kvc4["max_batch_multiplier"]
    assert "## Prompt steps and decode steps" in prefix.with_suffix(".md").read_text()

    # The report can be rewritten from the saved JSON without running anything.
    again = bench.main(["--from-json", str(prefix.with_suffix(".json")), "--output-prefix", str(tmp_path / "again"),
                        "--no-plots", "--note", "rewritten"])  # fmt: skip
    assert again["rows"] == saved["rows"]
    assert "note: rewritten" in (tmp_path / "again.md").read_text()

    # matplotlib is part of the test environment (scripts/install_cpu.sh): the plots exist.
    for name in ("throughput-multiplier", "max-batch", "throughput-by-input"):
        assert (tmp_path / f"throughput-{name}.png").stat().st_size > 0


@pytest.mark.assets
def test_vllm_bench_throughput_with_kv_compress_flags(tmp_path):
    """``vllm bench throughput`` takes the plugin's ``--kv-compress-*`` flags and runs the
    kvcompress engine (random dataset: needs a tokenizer, hence SmolLM2)."""
    from offline_assets import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    out = tmp_path / "bench.json"
    vllm_cli = Path(sys.executable).parent / "vllm"
    command = [
        str(vllm_cli), "bench", "throughput", "--model", model,
        "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "16",
        "--num-prompts", "8", "--kv-cache-memory-bytes", str(4096 * 30 * 2 * 3 * 64 * 4),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
        "--kv-compress-rate", "4", "--kv-compress-protected-window", "8",
        "--output-json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"), VLLM_LOGGING_LEVEL="INFO")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "kvcompress scheduler:" in log  # the per-head scheduler ran
    assert "'kvcompress': {'rate': 4.0, 'protected_window': 8}" in log
    report = json.loads(out.read_text())
    assert report["num_requests"] == 8
    assert report["total_num_tokens"] == 8 * (256 + 16)
    assert report["tokens_per_second"] > 0


def test_stock_capacity_counts_tokens_held_in_every_layer():
    """Stock's usable tokens in kvcompress's unit. One group: its blocks less the null
    block. Gemma 3 270M (18 layers: 15 sliding-window, 3 full attention; vLLM groups them
    into 6 KV cache groups of 3 layers sharing each block), the budget of
    rate1-parity-gemma3-270m-r3: 299 blocks of 128 tokens in 235339776 bytes, 36864 bytes a
    token in all 18 layers: a block holds 128 tokens of 3 layers, so 298 usable blocks hold
    298 * 128 / 6 tokens of every layer (the report said 38144 before, 6x too many)."""
    from types import SimpleNamespace

    bench = load_benchmark("benchmark_throughput")
    tiny = SimpleNamespace(num_gpu_blocks=136, block_size=128)
    bytes_per_token = 4 * 2 * 2 * 64 * 4  # 4 layers, 2 KV heads, K and V, head 64, float32
    budget = 17408 * bytes_per_token + 1000  # whole blocks and a remainder vLLM leaves unused
    assert bench.stock_layer_groups(tiny, budget, bytes_per_token) == 1
    assert bench.stock_capacity_tokens(tiny, budget, bytes_per_token) == 135 * 128
    assert bench.stock_capacity_tokens(tiny) == 135 * 128  # budget unknown: one group
    gemma = SimpleNamespace(num_gpu_blocks=299, block_size=128)
    assert bench.stock_layer_groups(gemma, 235339776, 36864) == 6
    assert bench.stock_capacity_tokens(gemma, 235339776, 36864) == 298 * 128 // 6
