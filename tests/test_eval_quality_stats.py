"""The quality benchmark's statistics and multi-turn task, without engines: bootstrap
intervals against the normal approximation, rows and ranking of hand-made runs, and the
multi-turn sample's text."""

from __future__ import annotations

import math
import random

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("eval_quality")


def test_interval_of_a_mean_matches_the_normal_approximation(bench):
    rng = random.Random(0)
    values = [float(rng.random() < 0.5) for _ in range(400)]
    mean = sum(values) / len(values)
    half = 1.96 * math.sqrt(mean * (1 - mean) / len(values))
    low, high = bench.bootstrap_interval([values], None)
    assert low == pytest.approx(mean - half, abs=0.012)
    assert high == pytest.approx(mean + half, abs=0.012)


def test_interval_of_pct_of_full(bench):
    full = [1.0, 0.0, 1.0, 1.0] * 10
    assert bench.bootstrap_interval([full], [full]) == (100.0, 100.0)  # paired: always equal
    half = [v * 0.5 for v in full]
    assert bench.bootstrap_interval([half], [full]) == pytest.approx((50.0, 50.0))
    # fewer samples, wider interval
    rng = random.Random(1)
    comp = [float(rng.random() < 0.6) for _ in range(200)]
    ref = [1.0] * 200
    wide = bench.bootstrap_interval([comp[:20]], [ref[:20]])
    narrow = bench.bootstrap_interval([comp], [ref])
    assert wide[1] - wide[0] > 2 * (narrow[1] - narrow[0])
    assert bench.bootstrap_interval([[0.0] * 5], [[0.0] * 5]) is None  # full scores 0


def test_interval_of_perplexity(bench):
    full = [30.0, 40.0, 50.0]
    doubled = [2 * p for p in full]
    assert bench.bootstrap_interval([doubled], [full], perplexity=True) == pytest.approx((50.0, 50.0))


def _results(bench, scores: dict[str, list[float]]) -> dict:
    """Hand-made results: one multi-turn and one niah_single cell of 4 samples; the
    second answer of policy p's sample i is right when scores[p][i] is 1."""
    samples, texts = [], {p: [] for p in scores}
    for task in ("niah_single", bench.MULTITURN):
        for i in range(4):
            samples.append({"task": task, "length": 2048, "index": i, "answers": [f"{1000000 + i}"]})
            for policy, values in scores.items():
                texts[policy].append(f" {1000000 + i}." if values[i] else " 42.")
    runs = {p: {"texts": t, "nll": [None] * len(t), "kv_kept": [0.2] * len(t)} for p, t in texts.items()}
    full = runs.pop("full")
    full.pop("kv_kept")
    results = {"samples": samples, "runs": {"full": full, **{p: {8.0: r} for p, r in runs.items()}},
               "config": {"ppl_context": 2048}}
    results["rows"] = bench.score_rows(results)
    return results


def test_rows_and_ranking(bench):
    results = _results(bench, {"full": [1, 1, 1, 1], "good": [1, 1, 1, 0], "bad": [1, 0, 0, 0]})
    row = next(r for r in results["rows"] if r["policy"] == "good" and r["task"] == bench.MULTITURN)
    assert row["pct_of_full"] == pytest.approx(75.0)
    assert row["pct_ci"][0] <= 75.0 <= row["pct_ci"][1]
    (summary,) = [r for r in results["rows"] if r["policy"] == "bad" and r["task"] == "all" and r["length"] == "all"]
    assert summary["pct_of_full"] == pytest.approx(25.0)  # the RULER cells only, not multi-turn
    lines = bench.ranking_lines(results, markdown=False)
    assert lines[0].startswith("RULER r8: good 75%") and "> bad 25%" in lines[0]
    assert lines[1].startswith("multi-turn r8: good 75%")
    line = bench.summary_line(results)
    assert line.startswith("summary: % of the full cache: good r8: RULER 75% (")
    assert "; bad r8: RULER 25% (" in line


@pytest.mark.assets
def test_multiturn_sample_asks_about_the_other_needle(bench):
    from transformers import AutoTokenizer

    from offline_assets import paul_graham_essays, smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint()))
    (sample,) = bench.build_samples(tokenizer, paul_graham_essays(), [bench.MULTITURN], [1024], 1)
    prompt = tokenizer.decode(sample["prompt_token_ids"])
    forced = tokenizer.decode(sample["forced"])
    (second,) = sample["answers"]
    assert sample["prompt_tokens"] <= 1024
    assert f"code of the {sample['query']} vault is {second}." in prompt  # the second needle
    assert second not in forced and f"code of the {sample['query']} vault mentioned" in forced
    first = forced.split(".")[0].strip()
    assert first.isdigit() and f"is: {first}." in prompt and prompt.rstrip().endswith("text is")
    assert sample["query"] not in prompt.split("\n\n")[-1]  # asked only later
    assert sample["max_tokens"] == len(sample["forced"]) + bench.MULTITURN_ANSWER_TOKENS
