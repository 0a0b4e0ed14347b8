"""benchmarks/quality/ruler_vs_kvpress.py (no server): kvc's % of stock against a press's %
of no press on the same samples, checked against a brute-force recount; a task where kvc
trails beyond the interval is listed, one where it does not is not; QA tasks are left
out when the two sides drew another number of samples; other samples are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import load_benchmark

versus = load_benchmark("ruler_vs_kvpress")

TASKS = ["niah_single_2", "vt", "qa_1"]


def _scores(per_task: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {task: {str(i): v for i, v in enumerate(values)} for task, values in per_task.items()}


def _write(tmp_path, samples_kvc: int = 8, samples_kvpress: int = 8, haystack: str = "sotu"):
    """Both sides' files. kvc: stock finds every needle, kvc 6 of 8, vt half kept;
    kvpress: no press finds every needle, the press 2 of 8, vt all kept (kvc trails on vt)."""
    def ones(n, hits):
        return [100.0] * hits + [0.0] * (n - hits)

    n = samples_kvc
    kvc = {"setup": {"model": "M", "length": 4000, "haystack": haystack, "sample_set": 1, "samples": n},
           "tasks": TASKS,
           "runs": {"stock": {"rate": None, "scores": _scores({"niah_single_2": ones(n, n), "vt": ones(n, n),
                                                               "qa_1": ones(n, n // 2)})},
                    "kvc r8": {"rate": 8.0, "scores": _scores({"niah_single_2": ones(n, 6), "vt": ones(n, n // 2),
                                                                "qa_1": ones(n, n // 2)})}}}
    m = samples_kvpress
    kvpress = {"setup": {"model": "M", "length": 4000, "haystack": "sotu", "sample_set": 1, "samples": m},
               "tasks": TASKS,
               "runs": {"no press": {"rate": None, "scores": _scores({"niah_single_2": ones(m, m), "vt": ones(m, m),
                                                                       "qa_1": ones(m, m)})},
                        "kvpress snapkv r8": {"rate": 8.0, "scores": _scores({"niah_single_2": ones(m, 2),
                                                                               "vt": ones(m, m), "qa_1": ones(m, 0)})},
                        "kvpress snapkv r4": {"rate": 4.0, "scores": _scores({t: ones(m, m) for t in TASKS})}}}
    kvc_path, kvpress_path = tmp_path / "kvc.json", tmp_path / "kvpress.json"
    kvc_path.write_text(json.dumps(kvc))
    kvpress_path.write_text(json.dumps(kvpress))
    return kvc_path, kvpress_path


def test_differences_equal_a_recount_and_only_the_trailing_task_is_listed(tmp_path):
    kvc_path, kvpress_path = _write(tmp_path)
    results = versus.main(["--kvc", str(kvc_path), "--kvpress", str(kvpress_path), "--out", str(tmp_path / "out")])
    (row,) = results["rows"]  # only rate 8 is in both
    assert (row["kvc"], row["press"], row["rate"]) == ("kvc r8", "kvpress snapkv r8", 8.0)
    # recount: kvc 6/8 of stock's 8/8 on the needle, 4/8 of 8/8 on vt, 4/8 of 4/8 on qa_1
    needle, vt, qa = row["tasks"]["niah_single_2"], row["tasks"]["vt"], row["tasks"]["qa_1"]
    assert needle["kvc_pct"] == pytest.approx(75.0) and needle["press_pct"] == pytest.approx(25.0)
    assert needle["difference"] == pytest.approx(50.0)
    assert vt["difference"] == pytest.approx(50.0 - 100.0)
    assert qa["kvc_pct"] == pytest.approx(100.0) and qa["press_pct"] == pytest.approx(0.0)
    mean = row["mean"]
    kvc_mean = np.mean([75.0, 50.0, 50.0]) / np.mean([100.0, 100.0, 50.0]) * 100
    press_mean = np.mean([25.0, 100.0, 0.0]) / 100.0 * 100
    assert mean["difference"] == pytest.approx(kvc_mean - press_mean)
    for stat in (needle, vt, mean):
        low, high = stat["ci"]
        assert low <= stat["difference"] <= high
    assert vt["ci"][1] < 0 and needle["ci"][0] > 0
    assert row["kvc_behind"] == ["vt"]
    text = (tmp_path / "out.md").read_text()
    assert "| kvc r8 | kvpress snapkv r8 | " in text and text.rstrip().splitlines()[-1].startswith("Scores")


def test_qa_tasks_are_left_out_when_the_sides_drew_other_numbers_of_samples(tmp_path):
    kvc_path, kvpress_path = _write(tmp_path, samples_kvc=10, samples_kvpress=5)
    results = versus.main(["--kvc", str(kvc_path), "--kvpress", str(kvpress_path), "--out", str(tmp_path / "out")])
    assert results["tasks"] == ["niah_single_2", "vt"] and results["left_out"] == ["qa_1"]
    assert results["samples"] == 5
    # the first 5 of kvc's 10: 5 needles of 5 (its 6 hits come first), vt 5 of 5
    assert results["rows"][0]["tasks"]["niah_single_2"]["kvc_pct"] == pytest.approx(100.0)


def test_other_samples_are_refused_naming_the_field(tmp_path):
    kvc_path, kvpress_path = _write(tmp_path, haystack="essays")
    with pytest.raises(ValueError, match="different haystack"):
        versus.main(["--kvc", str(kvc_path), "--kvpress", str(kvpress_path), "--out", str(tmp_path / "out")])


def test_several_kvpress_files_share_one_no_press_reference(tmp_path):
    kvc_path, kvpress_path = _write(tmp_path)
    first = json.loads(kvpress_path.read_text())
    # A second file as --reference-from writes it: the same no-press scores (keys as ints
    # before JSON made them strings), another press at rate 8.
    second = {**first, "runs": {"no press": first["runs"]["no press"],
                                "kvpress knorm r8": {"rate": 8.0, "scores": _scores({t: [0.0] * 8 for t in TASKS})}}}
    second_path = tmp_path / "second.json"
    second_path.write_text(json.dumps(second))
    results = versus.main(["--kvc", str(kvc_path), "--kvpress", str(kvpress_path), str(second_path),
                           "--out", str(tmp_path / "out")])
    assert [(r["press"], r["rate"]) for r in results["rows"]] == [("kvpress snapkv r8", 8.0), ("kvpress knorm r8", 8.0)]
    knorm = results["rows"][1]
    assert knorm["tasks"]["vt"]["press_pct"] == pytest.approx(0.0) and knorm["kvc_behind"] == []
    assert "kvpress.json, second.json" in (tmp_path / "out.md").read_text()
    for change, message in [({"no press": {"rate": None, "scores": _scores({t: [0.0] * 8 for t in TASKS})}},
                             "no-press scores differ"),
                            ({"kvpress snapkv r8": first["runs"]["kvpress snapkv r8"]}, "more than one file")]:
        second_path.write_text(json.dumps({**second, "runs": {**second["runs"], **change}}))
        with pytest.raises(ValueError, match=message):
            versus.main(["--kvc", str(kvc_path), "--kvpress", str(kvpress_path), str(second_path),
                         "--out", str(tmp_path / "out")])
    second_path.write_text(json.dumps({**second, "setup": {**second["setup"], "samples": 5}}))
    with pytest.raises(ValueError, match="different samples"):
        versus.main(["--kvc", str(kvc_path), "--kvpress", str(kvpress_path), str(second_path),
                     "--out", str(tmp_path / "out")])
