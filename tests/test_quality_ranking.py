"""benchmarks/quality/quality_ranking.py without engines: hand-made eval_quality results split
over several files merge into the rows one file holding every run scores to (the
oracle: eval_quality.score_rows on the whole), the ranking per rate includes
perplexity, and files that did not answer the same samples the same way are refused
naming the difference."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import load_benchmark

POLICIES = {"full": 1.0, "good": 0.75, "bad": 0.25}
"""Each policy's share of right needle answers (the full cache finds all 4)."""


@pytest.fixture(scope="module")
def ranking():
    return load_benchmark("quality_ranking")


def _run(policy: str, rate: float, samples: list[dict]) -> dict:
    """Answers right for the first ``POLICIES[policy] * 4`` needles; perplexity windows
    with a per-token log-likelihood that grows with the policy's loss and the rate."""
    right = round(POLICIES[policy] * 4)
    texts, nll = [], []
    for s in samples:
        if s["task"] == "ppl":
            texts.append("")
            nll.append([3.0 + (1 - POLICIES[policy]) * rate / 8 + 0.01 * k for k in range(5)])
        else:
            texts.append(f" {s['answers'][0]}." if s["index"] < right else " 42.")
            nll.append(None)
    run = {"seconds": 10.0, "texts": texts, "nll": nll}
    if policy != "full":
        run["kv_kept"] = [1 / rate] * len(samples)
    return run


def _whole(bench) -> dict:
    """One results dict holding every (policy, rate) of the test, as eval_quality writes it."""
    samples = [{"task": task, "length": 2048, "index": i, "answers": [f"{1000000 + i}"]}
               for task in ("niah_single", bench.MULTITURN) for i in range(4)]
    samples += [{"task": "ppl", "length": 2048, "index": i, "answers": []} for i in range(2)]
    config = {key: None for key in bench.FULL_RUN_KEYS}
    config.update(model="SmolLM2-135M-Instruct (test)", tasks=["niah_single", bench.MULTITURN, "ppl"],
                  lengths=[2048], limit=4, seed=0, ppl_samples=2, ppl_context=2048, ppl_tokens=5,
                  kv_compress_interval=64, kvc_settings={}, engine_args={"dtype": "float32"})
    runs = {"full": _run("full", 1.0, samples)}
    for policy in ("good", "bad"):
        runs[policy] = {rate: _run(policy, rate, samples) for rate in (4.0, 8.0)}
    return {"config": config, "machine": {"date": "2026-11-27 00:00 UTC", "cpu": "test"},
            "samples": samples, "runs": runs, "timings": {"wall": 100.0}, "argv": "--test"}


def _write(path, results: dict) -> str:
    path.write_text(json.dumps(results, default=str))
    return str(path)


def _split(whole: dict, cells: list[tuple[str, float]]) -> dict:
    """``whole`` with only these (policy, rate) runs (and the full cache)."""
    part = copy.deepcopy(whole)
    part["runs"] = {"full": part["runs"]["full"]}
    for policy, rate in cells:
        part["runs"].setdefault(policy, {})[rate] = copy.deepcopy(whole["runs"][policy][rate])
    return part


def _key(row: dict) -> tuple:
    return row["policy"], row["rate"], row["task"], row["length"]


def test_split_runs_merge_into_the_rows_of_one_run(ranking, tmp_path):
    bench = ranking.quality
    whole = _whole(bench)
    whole["rows"] = bench.score_rows(whole)
    paths = [
        _write(tmp_path / "a.json", _split(whole, [("good", 8.0), ("bad", 4.0)])),
        _write(tmp_path / "b.json", _split(whole, [("bad", 8.0)])),
        _write(tmp_path / "c.json", _split(whole, [("good", 4.0)])),
    ]
    merged = ranking.merge_results(paths, log=lambda _: None)
    want = {_key(r): r for r in whole["rows"]}
    got = {_key(r): r for r in merged["rows"]}
    assert got.keys() == want.keys() and len(got) > 20
    for key, row in want.items():
        for field in ("score", "n", "pct_of_full", "pct_ci", "kv_kept"):
            assert got[key][field] == pytest.approx(row[field]), (key, field)
    assert merged["config"]["rates"] == [4.0, 8.0]
    assert [s["cells"] for s in merged["config"]["merged_from"]] == [["good r8", "bad r4"], ["bad r8"], ["good r4"]]
    assert list(merged["runs"]["good"]) == [4.0, 8.0]  # sorted for the plot's lines

    lines = bench.ranking_lines(merged, markdown=False)
    assert "RULER r8: good 75% (" in lines[1] and "> bad 25%" in lines[1]
    ppl = [line for line in lines if line.startswith("perplexity r")]
    assert len(ppl) == 2 and ppl[0].startswith("perplexity r4: good") and "> bad" in ppl[0]

    prefix = tmp_path / "ranked"
    ranking.write_outputs(merged, str(prefix), "a.json b.json c.json", log=lambda _: None)
    markdown = (tmp_path / "ranked.md").read_text()
    assert "| `b.json` | 2026-11-27 00:00 UTC | test | bad r8 | - |" in markdown
    assert "- perplexity r8: good" in markdown
    again = json.loads((tmp_path / "ranked.json").read_text())
    assert len(again["rows"]) == len(merged["rows"])


def test_a_repeated_cell_is_taken_from_the_first_file_and_compared(ranking, tmp_path):
    whole = _whole(ranking.quality)
    first = _write(tmp_path / "a.json", _split(whole, [("good", 8.0)]))
    same = _write(tmp_path / "b.json", _split(whole, [("good", 8.0), ("bad", 8.0)]))
    other = _split(whole, [("good", 8.0)])
    other["runs"]["good"][8.0]["texts"][0] = " 42."
    different = _write(tmp_path / "c.json", other)
    warnings = []
    merged = ranking.merge_results([first, same, different], log=warnings.append)
    repeated = [s["repeated"] for s in merged["config"]["merged_from"]]
    assert repeated == [[], [{"cell": "good r8", "taken_from": first, "same_answers": True}],
                        [{"cell": "good r8", "taken_from": first, "same_answers": False}]]
    assert len(warnings) == 1 and "good r8" in warnings[0] and "c.json" in warnings[0]
    (row,) = [r for r in merged["rows"] if _key(r) == ("good", 8.0, "niah_single", 2048)]
    assert row["score"] == pytest.approx(0.75)  # the first file's answers


@pytest.mark.parametrize("change, named", [
    (lambda r: r["config"].update(kv_compress_interval=0), "kv_compress_interval 0 there, 64 in the first"),
    (lambda r: r["config"].update(limit=20), "limit 20 there, 4 in the first"),
    (lambda r: r["config"]["kvc_settings"].update(pool_kernel=31), "kvc_settings"),
    (lambda r: r["samples"][0].update(index=9), "its samples differ"),
    (lambda r: r["runs"]["full"]["texts"].__setitem__(1, " 7."), "1 of its full-cache answers differ"),
    (lambda r: r["runs"]["full"]["nll"][-1].__setitem__(0, 3.5), "log-likelihoods differ by up to 0.5"),
])  # fmt: skip
def test_a_file_on_other_samples_or_settings_is_refused_naming_the_difference(ranking, tmp_path, change, named):
    whole = _whole(ranking.quality)
    first = _write(tmp_path / "a.json", _split(whole, [("good", 8.0)]))
    other = _split(whole, [("bad", 8.0)])
    change(other)
    second = _write(tmp_path / "b.json", other)
    with pytest.raises(ValueError, match="b.json: cannot be ranked with .*a.json") as refused:
        ranking.merge_results([first, second], log=lambda _: None)
    assert named in str(refused.value)


def test_a_full_cache_within_the_tolerance_is_the_same(ranking, tmp_path):
    whole = _whole(ranking.quality)
    other = _split(whole, [("bad", 8.0)])
    other["runs"]["full"]["nll"][-1][0] += 4.2e-5  # as measured between days
    paths = [_write(tmp_path / "a.json", _split(whole, [("good", 8.0)])), _write(tmp_path / "b.json", other)]
    merged = ranking.merge_results(paths, log=lambda _: None)
    assert merged["config"]["policies"] == ["good", "bad"]


def test_the_command_line_refuses_with_a_message(ranking, tmp_path):
    not_results = tmp_path / "x.json"
    not_results.write_text("{}")
    with pytest.raises(ValueError, match="x.json: not a results file of eval_quality.py"):
        ranking.main([str(not_results)])


def test_paired_differences_against_direct_counts(ranking, tmp_path):
    """Oracle: the point difference is the count difference over the full cache's count;
    identical answers give a zero-width interval at 0, disjoint ones a zero-width
    interval at +-100, and an ahead / behind / not-separated verdict follows the interval."""
    full = [1.0] * 6 + [0.0] * 2
    a = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    b = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    got = ranking.paired_difference(a, b, full)
    assert got["difference"] == pytest.approx(100 * (5 - 1) / 6)
    low, high = got["ci"]
    assert low <= got["difference"] <= high and high - low > 10
    assert ranking.paired_difference(a, a, full) == {"difference": 0.0, "ci": [0.0, 0.0]}
    assert ranking.paired_difference([1.0] * 8, [0.0] * 8, [1.0] * 8) == {"difference": 100.0, "ci": [100.0, 100.0]}
    assert ranking.paired_difference([1.0] * 3, [0.0] * 3, [0.0] * 3) is None
    with pytest.raises(ValueError, match="equally long"):
        ranking.paired_difference([1.0], [1.0, 0.0], [1.0, 1.0])

    whole = _whole(ranking.quality)
    path = _write(tmp_path / "a.json", whole)
    merged = ranking.main([path, "--differences", "good:bad", "bad:good", "--out", str(tmp_path / "d")])
    by = {(d["first"], d["rate"], d["task"]): d for d in merged["differences"]}
    # good answers 3 of 4 needles, bad 1 of 4, the full cache 4 of 4: +50 points.
    for rate in (4.0, 8.0):
        assert by[("good", rate, "niah_single")]["difference"] == pytest.approx(50.0)
        assert by[("bad", rate, "niah_single")]["difference"] == pytest.approx(-50.0)
    assert not any(d["task"] == "ppl" for d in merged["differences"])
    for d, line in zip(merged["differences"], ranking.difference_lines(merged["differences"])):
        low, high = d["ci"]
        assert line.endswith("ahead" if low > 0 else "behind" if high < 0 else "not separated"), line
    lines = ranking.difference_lines([{**d, "ci": [5.0, 9.0]} for d in merged["differences"][:1]]
                                     + [{**d, "ci": [-9.0, -5.0]} for d in merged["differences"][:1]])
    assert lines[0].endswith(": ahead") and lines[1].endswith(": behind")
    markdown = (tmp_path / "d.md").read_text()
    assert "- good - bad, niah_single 2048 r8 (n 4): +50 points of full" in markdown
    with pytest.raises(ValueError, match="no runs of policy 'worse'"):
        ranking.main([path, "--differences", "good:worse"])
