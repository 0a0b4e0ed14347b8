"""benchmarks/throughput/bench_serve.py without servers (a whole run is ~25 min: README "Benchmarks"):
the dataset it hands to ``vllm bench serve`` and how it picks and prints the median runs."""

from __future__ import annotations

import json
import os
import signal

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_serve")


@pytest.mark.assets
def test_dataset_prompts_are_long_documents_that_retokenize_to_their_length(bench, tmp_path):
    from transformers import AutoTokenizer

    from offline_assets import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    path = tmp_path / "documents.jsonl"
    lengths = bench.write_dataset(path, model, count=3, length=1024, seed=0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3 and all(set(line) == {"prompt"} for line in lines)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for line, length in zip(lines, lengths):
        assert 900 <= length <= 1024
        # vllm bench serve re-tokenizes the text: it must come back at (about) the same length.
        assert abs(len(tokenizer(line["prompt"], add_special_tokens=False)["input_ids"]) - length) <= 4
        assert "special magic number" in line["prompt"]


def _run(bench, label, rate, throughput, repeat):
    metrics = {key: throughput * 10 for key, _ in bench.METRICS}
    return {"label": label, "rate": rate, "repeat": repeat, "peak_running_requests": 3, "completed": 8,
            "failed": 0, **metrics, "output_throughput": throughput, "request_throughput": throughput / 100}


def test_median_run_per_configuration_and_its_table(bench):
    runs = [_run(bench, "stock vLLM", None, 10.0, 0), _run(bench, "kvcompress rate 8", 8.0, 30.0, 0),
            _run(bench, "kvcompress rate 8", 8.0, 20.0, 1), _run(bench, "stock vLLM", None, 12.0, 1),
            _run(bench, "kvcompress rate 8", 8.0, 25.0, 2), _run(bench, "stock vLLM", None, 11.0, 2)]
    rows = bench.median_runs(runs)
    assert [(r["label"], r["output_throughput"]) for r in rows] == [("stock vLLM", 11.0), ("kvcompress rate 8", 25.0)]
    lines = bench.table(rows)
    assert lines[0].startswith("| server | peak running | preemptions | requests/s | output tokens/s |")
    assert lines[2].startswith("| stock vLLM | 3 | - | 0.11 (1.00x) | 11 (1.00x) |")
    assert lines[3].startswith("| kvcompress rate 8 | 3 | - | 0.25 (2.27x) | 25 (2.27x) |")


def test_paired_ratios_compare_each_repetition_with_its_own_stock_run(bench):
    # Repetition 1's machine was slower for both: the pairs see 3.0, 1.67 and 2.27; the
    # medians of the two columns alone (25 / 11) would say 2.27 by coincidence of order only.
    runs = [_run(bench, "stock vLLM", None, 10.0, 0), _run(bench, "kvcompress rate 8", 8.0, 30.0, 0),
            _run(bench, "kvcompress rate 8", 8.0, 20.0, 1), _run(bench, "stock vLLM", None, 12.0, 1),
            _run(bench, "kvcompress rate 8", 8.0, 25.0, 2), _run(bench, "stock vLLM", None, 11.0, 2)]
    ratios = bench.paired_ratios(runs)
    assert list(ratios) == ["kvcompress rate 8"]
    assert ratios["kvcompress rate 8"] == pytest.approx([3.0, 20 / 12, 25 / 11])
    rows = bench.median_runs(runs)
    lines = bench.table(rows, ratios)
    assert "x stock (paired median; per repeat)" in lines[0]
    assert "| 2.27 (3.00, 1.67, 2.27) |" in lines[3] and lines[2].endswith("| - | 8/0 |")


def test_cpu_delta_counts_each_process_of_the_tree_by_role(bench, tmp_path):
    # A real tree: a waiting parent's child spins 0.3 CPU s (its own process_time) after the
    # first snapshot, says so and stays alive; the second snapshot must see those seconds.
    import subprocess
    import sys
    import time

    go, spun = tmp_path / "go", tmp_path / "spun"
    child = ("import pathlib, time\nstart = time.process_time()\n"
             "while time.process_time() - start < 0.3: pass\n"
             f"pathlib.Path({str(spun)!r}).touch()\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys, time\n"
                               f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
                               f"subprocess.run([sys.executable, '-c', {child!r}])\n"],
                              start_new_session=True)
    try:
        time.sleep(0.3)
        before = bench.cpu_seconds_by_role(parent.pid)
        go.touch()
        deadline = time.monotonic() + 30
        while not spun.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        during = bench.cpu_seconds_by_role(parent.pid)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
    assert set(before) == {parent.pid} and before[parent.pid][0] == "other"
    assert len(during) == 2
    spent = bench.cpu_delta(before, during)
    assert list(spent) == ["other"] and 0.3 <= spent["other"] <= 1.0
    assert bench.cpu_table([]) == []
    row = {"label": "stock vLLM", "completed": 4, "cpu_seconds": {"api server": 2.0, "worker": 10.0}}
    assert bench.cpu_table([row])[2] == "| stock vLLM | 0.50 | 2.50 |"
