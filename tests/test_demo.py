"""``make demo`` (benchmarks/serving/demo.py), small: 4 SmolLM2 documents of ~768 tokens, stock
vLLM vs kvcompress at rates 1 and 8 under the same KV memory (room for 2.2 documents).

Checked against stock vLLM in the same run: rate 1 is token-identical to stock; rate 8
holds fewer KV bytes per request and decodes more requests at once than stock; every time
and rate is a positive measurement; the tables, JSON and PNG are written. Answers are
listed, not asserted (the quality floors are tests/test_quality_floor.py's and tests/test_ruler_floor.py's)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.assets]

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serving" / "demo.py"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    # Its own process: the demo's in-process engine cores pin the caller's threads.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--documents", "4", "--length", "768", "--output-tokens", "32",
         "--rates", "1", "8", "--kv-documents", "2.2", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout)
    return done.stdout, out, json.loads(out.with_suffix(".json").read_text())


def test_rate1_is_token_identical_to_stock(demo):
    stdout, _, saved = demo
    stock, rate1, _ = saved["runs"]
    assert rate1["rate"] == 1 and stock["rate"] is None
    assert rate1["token_ids"] == stock["token_ids"]
    assert "token-identical to stock: True" in stdout


def test_rate8_holds_fewer_bytes_and_runs_more_requests_than_stock(demo):
    _, _, saved = demo
    stock, rate1, rate8 = saved["runs"]
    assert rate8["kv_bytes_per_request"] < 0.5 * stock["kv_bytes_per_request"]
    assert rate8["max_concurrent"] > stock["max_concurrent"] >= 1
    # Rate 1 holds what stock holds, within page rounding (64-token pages vs stock's 128-token blocks on CPU).
    assert abs(rate1["kv_bytes_per_request"] - stock["kv_bytes_per_request"]) <= 0.05 * stock["kv_bytes_per_request"]


def test_every_figure_is_a_measurement_and_every_file_is_written(demo):
    stdout, out, saved = demo
    for run in saved["runs"]:
        assert run["seconds"] > 0 and run["output_tokens"] == 4 * 32
        assert len(run["answers"]) == 4
    table = out.with_suffix(".md").read_text()
    rows = table.splitlines()
    for label in ("stock vLLM", "kvcompress rate 1", "kvcompress rate 8"):
        assert sum(line.startswith(f"| {label} |") for line in rows) == 1, label
    answer_rows = [line for line in rows if re.match(r"\| \d+ \(\d+ tokens\) \| \d{7} \|", line)]
    assert len(answer_rows) == 4 and all(line.count("ok: ") + line.count("WRONG: ") == 3 for line in answer_rows)
    assert not re.search(r"\| 0\.0 \(", table), table  # no clamped or zero tokens/s
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert stdout.strip().splitlines()[-1].startswith("summary: kvcompress rate 8 holds")


def test_the_pool_is_recorded_and_fills_the_kv_memory(demo):
    stdout, _, saved = demo
    pool = saved["runs"][1]["extra"]["pool"]
    kv_bytes = saved["engine_args"]["kv_cache_memory_bytes"]
    # float32 K and V of head dim 64 fill most of the bytes (the rest: slot metadata, tables)
    page_bytes = pool["pages"] * pool["block_size"] * 2 * 64 * 4
    assert 0.9 * kv_bytes <= page_bytes <= kv_bytes
    assert f"kvcompress pool: {pool['pages']} pages of {pool['block_size']} slots" in stdout
    assert "--kv-cache-dtype: kvcompress auto, stock auto" in stdout
