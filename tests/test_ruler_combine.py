"""benchmarks/quality/ruler_combine.py (no server): pooled sample sets give the summary of
one run over all their samples (brute-force recount), and files that are not one
experiment are refused naming the file and the field."""

from __future__ import annotations

import copy
import json
import random

import pytest
from conftest import load_benchmark

combine = load_benchmark("ruler_combine")

TASKS = ["niah_single_2", "vt", "qa_1"]


def _result(sample_set: int, samples: int, seed: int, engine_code: str = "abc123") -> dict:
    """A ruler.py result as JSON gives it back (sample indices are strings)."""
    rng = random.Random(seed)

    def scores(p_hit: float) -> dict[str, dict[str, float]]:
        return {t: {str(i): 100.0 * (rng.random() < p_hit) for i in range(samples)} for t in TASKS}

    runs = {"stock": {"policy": None, "rate": None, "scores": scores(0.8), "wall_s": 10.0},
            "kvc r8": {"policy": "kvc", "rate": 8.0, "scores": scores(0.6), "wall_s": 12.0}}
    setup = {"model": "SmolLM2", "length": 4000, "haystack": "sotu", "sample_set": sample_set, "samples": samples,
             "server_flags": ["--dtype", "float32"], "ruler_requirements": ["x==1"], "engine_code": engine_code,
             "commit": "c0ffee0"}
    return json.loads(json.dumps({"setup": setup, "machine": {"cpu": "test"}, "tasks": TASKS, "runs": runs}))


def test_pooled_sets_summarise_as_one_run_over_all_their_samples():
    named = {"set1.json": _result(1, 10, seed=1), "set2.json": _result(2, 15, seed=2)}
    pooled = combine.pool(named)
    assert pooled["setup"]["samples"] == 25 and pooled["setup"]["sample_sets"] == [1, 2]
    rows = {row["label"]: row for row in pooled["rows"]}
    assert list(rows) == ["stock", "kvc r8"]
    for label in rows:
        task_means = {}
        for task in TASKS:  # brute force: every sample of both files, once each
            values = [s for r in named.values() for s in r["runs"][label]["scores"][task].values()]
            assert len(values) == 25
            task_means[task] = sum(values) / 25
            assert rows[label]["tasks"][task]["score"] == pytest.approx(task_means[task])
        assert rows[label]["score"] == pytest.approx(sum(task_means.values()) / len(TASKS))
        assert rows[label]["n"] == 25 * len(TASKS)
    stock_means = [rows["stock"]["tasks"][t]["score"] for t in TASKS]
    kvc_means = [rows["kvc r8"]["tasks"][t]["score"] for t in TASKS]
    assert rows["kvc r8"]["pct_of_stock"] == pytest.approx(100 * sum(kvc_means) / sum(stock_means))
    # the same samples index 0..9 in both sets stay apart
    assert "set1:0" in pooled["runs"]["stock"]["scores"]["vt"] and "set2:0" in pooled["runs"]["stock"]["scores"]["vt"]


def test_a_configuration_missing_from_a_file_is_left_out_and_said():
    second = _result(2, 10, seed=2)
    second["runs"]["kvc r16"] = copy.deepcopy(second["runs"]["kvc r8"]) | {"rate": 16.0}
    pooled = combine.pool({"a.json": _result(1, 10, seed=1), "b.json": second})
    assert [row["label"] for row in pooled["rows"]] == ["stock", "kvc r8"]
    assert pooled["setup"]["left_out"] == ["kvc r16"]


def _changed(field: str, value) -> dict:
    other = _result(2, 10, seed=2)
    other["setup"][field] = value
    return other


@pytest.mark.parametrize("other, named", [
    (_changed("server_flags", ["--dtype", "bfloat16"]), "server_flags"),
    (_changed("haystack", "essays"), "haystack"),
    (_changed("length", 8000), "length"),
    (_changed("sample_set", 1), "sample set 1"),
    (_changed("engine_code", "def456"), "engine code"),
    (_changed("engine_code", None), "not recorded"),
])  # fmt: skip
def test_files_that_are_not_one_experiment_are_refused_naming_why(other, named):
    with pytest.raises(combine.PoolError, match=named) as refused:
        combine.pool({"set1.json": _result(1, 10, seed=1), "other.json": other})
    assert "other.json" in str(refused.value)


def test_sets_whose_qa_questions_overlap_are_refused():
    """Set 1 of 20 asks questions 20-39, set 2 of 10 asks 20-29: the same questions;
    set 1 of 10 (10-19) and set 3 of 5 (15-19) too; set 4 of 5 (20-24) does not."""
    for first, second in ((("set1-n20.json", 1, 20), ("set2-n10.json", 2, 10)),
                          (("set1-n10.json", 1, 10), ("set3-n5.json", 3, 5))):
        with pytest.raises(combine.PoolError, match="QA questions") as refused:
            combine.pool({name: _result(k, n, seed=k) for name, k, n in (first, second)})
        assert first[0] in str(refused.value) and second[0] in str(refused.value)
    assert combine.pool({"set1-n10.json": _result(1, 10, seed=1), "set4-n5.json": _result(4, 5, seed=4)})["rows"]


def test_stock_only_files_pool_across_engine_code():
    """Stock vLLM's answers do not depend on kvcompress's code (ruler.prediction_stamp)."""
    first, second = _result(1, 4, seed=1, engine_code="a"), _result(2, 4, seed=2, engine_code="b")
    for results in (first, second):
        del results["runs"]["kvc r8"]
    assert [row["label"] for row in combine.pool({"a.json": first, "b.json": second})["rows"]] == ["stock"]


def test_kvpress_files_pool_on_their_no_press_reference():
    def kvpress(sample_set: int, seed: int) -> dict:
        results = _result(sample_set, 6, seed=seed)
        results["runs"] = {"no press": results["runs"]["stock"],
                           "kvpress snapkv r8": results["runs"]["kvc r8"] | {"policy": "snapkv"}}
        del results["setup"]["server_flags"], results["setup"]["engine_code"]
        results["setup"]["kvpress_requirements"] = ["kvpress==0.5.5"]
        return results

    pooled = combine.pool({"a.json": kvpress(1, 1), "b.json": kvpress(2, 2)})
    assert [row["label"] for row in pooled["rows"]] == ["no press", "kvpress snapkv r8"]
    assert pooled["rows"][0]["pct_of_stock"] == pytest.approx(100.0)


def test_the_command_line_writes_the_pooled_report(tmp_path, capsys):
    paths = []
    for k in (1, 2):
        path = tmp_path / f"set{k}.json"
        path.write_text(json.dumps(_result(k, 8, seed=k)))
        paths.append(str(path))
    results = combine.main(paths + ["--out", str(tmp_path / "pooled")])
    report = (tmp_path / "pooled.md").read_text()
    assert "16 samples per task" in report and "sample sets 1, 2" in report
    assert json.loads((tmp_path / "pooled.json").read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    assert "summary: RULER 4000" in capsys.readouterr().out


def test_one_file_is_not_a_pool(capsys):
    with pytest.raises(SystemExit):
        combine.main(["only.json", "--out", "x"])
    assert "at least two" in capsys.readouterr().err


def test_each_sets_kept_fraction_is_carried_and_reported_where_recorded(tmp_path):
    first, second = _result(1, 8, seed=1), _result(2, 8, seed=2)
    first["runs"]["kvc r8"]["kept_fraction"] = 0.142
    second["runs"]["kvc r8"]["kept_fraction"] = 0.1437
    paths = []
    for k, result in ((1, first), (2, second)):
        paths.append(str(tmp_path / f"set{k}.json"))
        (tmp_path / f"set{k}.json").write_text(json.dumps(result))
    results = combine.main(paths + ["--out", str(tmp_path / "pooled")])
    assert results["runs"]["kvc r8"]["kept_fraction_by_set"] == {"1": 0.142, "2": 0.1437}
    assert results["runs"]["stock"]["kept_fraction_by_set"] == {}
    report = (tmp_path / "pooled.md").read_text()
    assert "- kvc r8: set 1 14.2%, set 2 14.4%" in report and "- stock:" not in report
    del second["runs"]["kvc r8"]["kept_fraction"]
    pooled = combine.pool({"a.json": first, "b.json": second})
    assert pooled["runs"]["kvc r8"]["kept_fraction_by_set"] == {"1": 0.142}
