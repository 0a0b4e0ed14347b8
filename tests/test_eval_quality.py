"""Quality benchmark (benchmarks/quality/eval_quality.py), smoke-sized: SmolLM2-135M-Instruct,
one sample per RULER task at ~1K tokens, one perplexity window (512 prefilled + 32
teacher-forced tokens), stock vLLM vs kvcompress at rates 1 and 8 under the policies kvc,
snapkv and random (rate 1 run once; ~4 min on 2 cores). Marked slow (the benchmark
script's plumbing; CI's default run keeps the quality floors: tests/test_quality_floor.py
on these tasks, tests/test_ruler_floor.py on RULER): `pytest -m slow tests/test_eval_quality.py`.

Checked: every task is scored for the full cache and both rates of every policy; rate 1
(evicts nothing) is token-identical to stock and scores the same; scores are fractions in
[0, 1]; the teacher-forced perplexity is finite and the same at rate 1; rate 8 keeps well
under half of the KVs under every policy; the summary table lists every policy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import load_benchmark, quality_rows

pytestmark = [pytest.mark.engine, pytest.mark.assets, pytest.mark.slow]

RATES = (1.0, 8.0)
LENGTH = 1024
POLICIES = ("kvc", "snapkv", "random")


@pytest.fixture(scope="module")
def quality(tmp_path_factory):
    bench = load_benchmark("eval_quality")
    prefix = tmp_path_factory.mktemp("quality") / "quality-smoke"
    results = bench.main([
        "--lengths", str(LENGTH), "--limit", "1", "--rates", *map(str, RATES),
        "--policies", *POLICIES,
        "--ppl-samples", "1", "--ppl-context", "512", "--ppl-tokens", "32",
        "--out", str(prefix),
    ])  # fmt: skip
    return bench, results, prefix


def test_every_task_is_scored_for_full_and_every_rate(quality):
    bench, results, _ = quality
    for task in bench.TASKS:
        length = 512 if task == "ppl" else LENGTH
        (full,) = quality_rows(results, policy="full", task=task, length=length)
        assert full["n"] == 1 and full["rate"] == 1.0
        for rate in RATES:
            (row,) = quality_rows(results, policy="kvc", rate=rate, task=task, length=length)
            assert row["n"] == 1
            if task != "ppl":
                assert 0.0 <= row["score"] <= 1.0
                assert row["kv_kept"] is not None
        if task != "ppl":
            assert 0.0 <= full["score"] <= 1.0
    for rate in RATES:  # the summary rows
        assert quality_rows(results, policy="kvc", rate=rate, task="all", length="all")
    samples = [s for s in results["samples"] if s["task"] != "ppl"]
    assert all(LENGTH - 100 <= s["prompt_tokens"] <= LENGTH for s in samples)


def test_rate1_matches_the_full_cache(quality):
    _, results, _ = quality
    assert results["rate1_identical"] is True
    assert results["runs"]["kvc"][1.0]["texts"] == results["runs"]["full"]["texts"]
    for full in quality_rows(results, policy="full"):
        (rate1,) = quality_rows(results, policy="kvc", rate=1.0, task=full["task"], length=full["length"])
        if full["task"] == "ppl":
            assert rate1["score"] == pytest.approx(full["score"], rel=1e-3)
        else:
            assert rate1["score"] == full["score"]
            if full["score"]:
                assert rate1["pct_of_full"] == pytest.approx(100.0)
    run = results["runs"]["kvc"][1.0]
    assert run["compressions"] == 0 and run["pages_freed"] == 0 and run["mismatches"] == 0


def test_perplexity_is_teacher_forced(quality):
    _, results, _ = quality
    full = quality_rows(results, policy="full", task="ppl")[0]["score"]
    assert math.isfinite(full) and 1.0 < full < 1000.0
    for rate in RATES:
        (row,) = quality_rows(results, policy="kvc", rate=rate, task="ppl")
        assert math.isfinite(row["score"]) and row["score"] > 1.0
        (nll,) = [x for x in results["runs"]["kvc"][rate]["nll"] if x is not None]
        assert len(nll) == 32


def test_rate8_compresses(quality):
    _, results, _ = quality
    run = results["runs"]["kvc"][8.0]
    assert run["compressions"] >= len(results["samples"]) and run["pages_freed"] > 0
    assert run["mismatches"] == 0
    (summary,) = quality_rows(results, policy="kvc", rate=8.0, task="all", length="all")
    assert summary["kv_kept"] < 0.5


def test_every_policy_is_scored_and_compresses(quality):
    bench, results, _ = quality
    assert results["config"]["policies"] == list(POLICIES)
    assert set(results["runs"]) == {"full", *POLICIES}
    for policy in POLICIES:
        # rate 1 evicts nothing under any policy: one run, shared
        assert results["runs"][policy][1.0] is results["runs"]["kvc"][1.0]
        run = results["runs"][policy][8.0]
        assert run["compressions"] >= len(results["samples"]) and run["pages_freed"] > 0
        assert run["mismatches"] == 0
        for task in bench.TASKS:
            length = 512 if task == "ppl" else LENGTH
            (row,) = quality_rows(results, policy=policy, rate=8.0, task=task, length=length)
            assert row["n"] == 1
            if task == "ppl":
                assert math.isfinite(row["score"]) and row["score"] > 1.0
            else:
                assert 0.0 <= row["score"] <= 1.0
        (summary,) = quality_rows(results, policy=policy, rate=8.0, task="all", length="all")
        assert 0.0 <= summary["score"] <= 1.0 and summary["kv_kept"] < 0.5


def test_summary_table_lists_every_policy(quality):
    bench, results, _ = quality
    table = bench.format_table(results)
    summary = table.split("\n\n")[0].splitlines()  # the first table: policies x rates
    assert summary[0].startswith("RULER, all cells: % of full") and "r8" in summary[0]
    assert [line.split()[0] for line in summary[1:]] == list(POLICIES)
    for policy in POLICIES:
        assert f"{policy}:" in table  # its per-(task, length) table


def test_outputs_are_written(quality):
    bench, results, prefix = quality
    saved = json.loads(Path(f"{prefix}.json").read_text())
    assert len(saved["rows"]) == len(results["rows"])
    table = Path(f"{prefix}.md").read_text()
    assert "| task | length |" in table and "niah_single" in table
    print("\n" + bench.format_table(results))


def test_the_whole_run_replaces_its_partial_file(quality):
    _, _, prefix = quality
    assert Path(f"{prefix}.json").exists() and not Path(f"{prefix}.partial.json").exists()


def test_full_from_refuses_other_samples_naming_the_difference(quality):
    bench, _, prefix = quality
    saved = json.loads(Path(f"{prefix}.json").read_text())
    config, samples = dict(saved["config"]), saved["samples"]
    assert bench.load_full_run(f"{prefix}.json", config, samples)["texts"] == saved["runs"]["full"]["texts"]
    with pytest.raises(ValueError, match=r"--full-from .*limit 1 there, 2 here"):
        bench.load_full_run(f"{prefix}.json", {**config, "limit": 2}, samples)
    moved = [dict(samples[0], prompt_tokens=samples[0]["prompt_tokens"] - 1), *samples[1:]]
    with pytest.raises(ValueError, match="its samples differ"):
        bench.load_full_run(f"{prefix}.json", config, moved)


def test_a_run_on_the_full_answers_of_another_scores_as_that_run_did(quality, tmp_path):
    """``--full-from``: the full cache's answers come from the module's run (no stock
    engine); kvc at rate 8 answers as it did there (same samples, deterministic), so
    every row equals that run's; each finished (policy, rate) is in the partial file."""
    bench, results, prefix = quality
    partial = tmp_path / "again.partial.json"
    again = bench.run_quality(
        tasks=list(results["config"]["tasks"]), lengths=[LENGTH], rates=[8], policies=["kvc"], limit=1,
        ppl_samples=1, ppl_context=512, ppl_tokens=32, log=lambda _: None,
        full_from=f"{prefix}.json", partial=str(partial),
    )
    assert again["timings"]["full_engine_start"] == 0.0
    for policy, rate in (("full", 1.0), ("kvc", 8.0)):
        want = {(r["task"], r["length"]): r["score"] for r in quality_rows(results, policy=policy, rate=rate)}
        got = {(r["task"], r["length"]): r["score"] for r in quality_rows(again, policy=policy, rate=rate)}
        assert got == want and len(got) >= 2, policy
    written = json.loads(partial.read_text())
    assert list(written["runs"]) == ["full", "kvc"] and list(written["runs"]["kvc"]) == ["8.0"]
