"""benchmarks/quality/compare_quality_checkouts.py on two hand-made eval_quality results (no
engine): scores and differences per row, and outputs compared sample by sample."""

import copy

from conftest import load_benchmark

compare = load_benchmark("compare_quality_checkouts")

SAMPLES = [{"task": "ppl", "length": 2048, "index": 0},
           {"task": "niah_single", "length": 2048, "index": 0},
           {"task": "niah_single", "length": 2048, "index": 1},
           {"task": "niah_multiturn", "length": 2048, "index": 0}]


def _run(texts, nll, kept=None) -> dict:
    return {"texts": list(texts), "nll": copy.deepcopy(nll), "kv_kept": kept, "compressions": 4,
            "compressions_on_interval": 1, "pages_freed": 10, "num_preemptions": 0, "seconds": 1.0}


def _row(policy, rate, task, length, score, metric="string_match_all", n=2, pct=100.0) -> dict:
    return {"policy": policy, "rate": rate, "task": task, "length": length, "metric": metric, "score": score,
            "n": n, "pct_of_full": pct, "kv_kept": None}


def _results() -> dict:
    texts = ["", "1234567", "7654321", "vault 42"]
    nll = [[0.5, 1.0], None, None, None]
    r8 = _run(texts, nll, [0.2, 0.1, 0.1, 0.1])
    return {"samples": copy.deepcopy(SAMPLES), "rate1_identical": True,
            "runs": {"full": _run(texts, nll), "kvc": {"8.0": r8}},
            "rows": [_row("full", 1.0, "niah_single", 2048, 1.0),
                     _row("kvc", 8.0, "ppl", 2048, 2.1, "perplexity", 1, 95.0),
                     _row("kvc", 8.0, "niah_single", 2048, 1.0),
                     _row("kvc", 8.0, "niah_multiturn", 2048, 1.0, n=1),
                     _row("kvc", 8.0, "all", "all", 1.0)]}


def _by_key(summary: dict) -> dict:
    return {(r["policy"], r["rate"], r["task"], r["length"]): r for r in summary["rows"]}


def test_identical_runs_compare_identical():
    summary = compare.summarize(_results(), _results())
    assert summary["same_samples"] and summary["max_abs_score_difference"] == 0
    # cells only (the `all` row repeats niah_single's two samples): 2 + 1 + 2 + 1
    assert (summary["identical_samples"], summary["compared_samples"]) == (6, 6)
    assert _by_key(summary)[("kvc", 8.0, "all", "all")]["identical_samples"] == 2
    assert "6 of 6" in compare.verdict(summary) and "NOT" not in compare.verdict(summary)


def test_a_changed_answer_and_likelihood_are_found_in_their_rows():
    after = _results()
    run = after["runs"]["kvc"]["8.0"]
    run["texts"][2] = "7654320"
    run["nll"][0] = [0.5, 1.25]
    after["rows"][2]["score"] = 0.5
    summary = compare.summarize(_results(), after)
    rows = _by_key(summary)
    needle, ppl = rows[("kvc", 8.0, "niah_single", 2048)], rows[("kvc", 8.0, "ppl", 2048)]
    assert needle["identical_samples"] == 1 and needle["score_difference"] == -0.5
    assert ppl["identical_samples"] == 0 and ppl["max_nll_difference"] == 0.25
    assert rows[("kvc", 8.0, "all", "all")]["identical_samples"] == 1  # the multi-turn sample is not in it
    assert rows[("full", 1.0, "niah_single", 2048)]["identical_samples"] == 2
    assert (summary["identical_samples"], summary["max_abs_score_difference"]) == (4, 0.5)
    assert "NOT all" in compare.verdict(summary)
    text = compare.render_markdown([], summary, {"date": "d", "machine": "m", "eval_args": ["--quick"], "seed": 0})
    assert "| niah_single | 2048 | kvc | 8 | 1.000 | 0.500 | -0.5 | 100.0 | 100.0 | 1/2 | - |" in text


def test_a_changed_kept_fraction_is_a_difference_and_other_samples_are_not_compared():
    after = _results()
    after["runs"]["kvc"]["8.0"]["kv_kept"][3] = 0.15
    assert _by_key(compare.summarize(_results(), after))[("kvc", 8.0, "niah_multiturn", 2048)]["identical_samples"] == 0
    after["samples"][1]["index"] = 5
    summary = compare.summarize(_results(), after)
    assert not summary["same_samples"] and summary["identical_samples"] is None
    assert "not compared" in compare.verdict(summary)
