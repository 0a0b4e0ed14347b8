"""benchmarks/quality/ruler.py's own logic (no server, no RULER venv): the summary against a
brute-force recount, the configurations, the flags every server shares, bad arguments."""

from __future__ import annotations

import json
import random

import pytest

from conftest import load_benchmark

ruler = load_benchmark("ruler")


def _runs(rng: random.Random, tasks: list[str], samples: int) -> dict[str, dict]:
    def scores(p_hit: float) -> dict[str, dict[int, float]]:
        return {t: {i: 100.0 * (rng.random() < p_hit) for i in range(samples)} for t in tasks}

    return {
        "stock": {"policy": None, "rate": None, "scores": scores(0.8)},
        "kvc r8": {"policy": "kvc", "rate": 8.0, "scores": scores(0.6)},
    }


def test_summary_is_the_mean_of_task_means_and_its_share_of_stock():
    tasks = ["vt", "qa_1", "niah_single_2"]
    runs = _runs(random.Random(3), tasks, samples=12)
    runs["kvc r8"]["scores"]["vt"] = dict(reversed(list(runs["kvc r8"]["scores"]["vt"].items())))  # order-free
    rows = {row["label"]: row for row in ruler.summarize(runs, tasks)}
    for label, run in runs.items():
        task_means = {t: sum(run["scores"][t].values()) / 12 for t in tasks}
        stock_means = {t: sum(runs["stock"]["scores"][t].values()) / 12 for t in tasks}
        row = rows[label]
        assert row["score"] == pytest.approx(sum(task_means.values()) / 3)
        assert row["pct_of_stock"] == pytest.approx(100 * sum(task_means.values()) / sum(stock_means.values()))
        assert row["n"] == 36
        low, high = row["score_ci"]
        assert low <= row["score"] <= high
        for task in tasks:
            assert row["tasks"][task]["score"] == pytest.approx(task_means[task])
    assert rows["stock"]["pct_of_stock"] == pytest.approx(100.0)
    assert rows["stock"]["pct_ci"] == pytest.approx((100.0, 100.0))  # paired: stock vs itself


def test_a_task_stock_never_solves_has_no_share():
    tasks = ["cwe"]
    runs = {"stock": {"policy": None, "rate": None, "scores": {"cwe": {0: 0.0, 1: 0.0}}},
            "kvc r8": {"policy": "kvc", "rate": 8.0, "scores": {"cwe": {0: 0.0, 1: 50.0}}}}
    row = ruler.summarize(runs, tasks)[1]
    assert row["tasks"]["cwe"]["pct_of_stock"] is None and row["pct_ci"] is None
    assert row["score"] == 25.0


def test_a_run_missing_a_sample_stock_has_fails_loudly():
    runs = _runs(random.Random(0), ["vt"], samples=4)
    del runs["kvc r8"]["scores"]["vt"][2]
    with pytest.raises(KeyError):
        ruler.summarize(runs, ["vt"])


def test_configurations_are_stock_then_every_policy_and_rate():
    args = ruler.parse_args(["--policies", "kvc", "snapkv", "--rates", "2", "8"])
    configs = ruler.configurations(args)
    assert [c.label for c in configs] == ["stock", "kvc r2", "kvc r8", "snapkv r2", "snapkv r8"]
    assert configs[0].flags() == []
    assert configs[4].flags() == ["--kv-compress-rate", "8", "--kv-compress-policy", "snapkv"]


def test_no_policies_is_stock_alone():
    assert [c.label for c in ruler.configurations(ruler.parse_args(["--policies"]))] == ["stock"]


def test_stock_from_another_run_goes_last_and_waits_for_that_runs_lines(tmp_path):
    import threading

    args = ruler.parse_args(["--rates", "8", "16", "--stock-from-another-run"])
    assert [c.label for c in ruler.configurations(args)] == ["kvc r8", "kvc r16", "stock"]
    runs = {"kvc r8": {"policy": "kvc"}, "kvc r16": {"policy": "kvc"}, "stock": {"policy": None}}
    assert list(ruler.stock_first(runs)) == ["stock", "kvc r8", "kvc r16"]  # the tables' first row
    tasks, samples = ["vt", "qa_1"], 3
    (tmp_path / "vt.jsonl").write_text('{"a": 1}\n' * samples)

    class Bar:
        updated = 0

        def set_postfix_str(self, _): pass

        def update(self, n): self.updated += n

    bar = Bar()
    waiter = threading.Thread(target=ruler.wait_for_predictions, args=(tmp_path, tasks, samples, bar, 0.01))
    waiter.start()
    (tmp_path / "qa_1.jsonl").write_text('{"a": 1}\n' * (samples - 1))
    waiter.join(0.2)
    assert waiter.is_alive() and bar.updated == 0  # one qa_1 sample still missing
    with open(tmp_path / "qa_1.jsonl", "a") as handle:
        handle.write('{"a": 1}\n')
    waiter.join(5)
    assert not waiter.is_alive() and bar.updated == len(tasks) * samples


def test_every_server_gets_the_same_kv_memory_and_context(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_key_value_heads": 3, "hidden_size": 576, "num_attention_heads": 9}))
    assert ruler.kv_bytes_per_token(tmp_path) == 30 * 3 * 64 * 2 * 4  # K and V, float32
    args = ruler.parse_args(["--length", "4000", "--kv-sequences", "2", "--server-flag=--max-num-seqs=8"])
    flags = ruler.server_flags(args, tmp_path)
    max_len = int(flags[flags.index("--max-model-len") + 1])
    assert max_len >= 4000 + 128
    assert int(flags[flags.index("--kv-cache-memory-bytes") + 1]) == 2 * max_len * 30 * 3 * 64 * 2 * 4
    assert "--no-enable-prefix-caching" in flags and flags[-1] == "--max-num-seqs=8"
    assert "--enable-prefix-caching" in ruler.server_flags(ruler.parse_args(["--prefix-caching"]), tmp_path)


@pytest.mark.parametrize("argv, named", [
    (["--tasks", "niah_single_2,needle"], "--tasks"),
    (["--rates", "0.5"], "--rates"),
    (["--tasks", "vt,qa_1", "--length", "1000"], "--length >= 2000"),
])  # fmt: skip
def test_bad_arguments_name_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit):
        ruler.parse_args(argv)
    assert named in capsys.readouterr().err


def test_quick_is_ci_sized():
    args = ruler.parse_args(["--quick"])
    assert args.tasks == list(ruler.QUICK_TASKS) and args.samples == 4 and args.length == 1000
    assert args.out.endswith("-quick")


def test_the_summary_line_names_each_configuration_and_its_share():
    tasks = ["vt"]
    runs = {"stock": {"policy": None, "rate": None, "scores": {"vt": {0: 100.0, 1: 50.0}}},
            "kvc r8": {"policy": "kvc", "rate": 8.0, "scores": {"vt": {0: 50.0, 1: 25.0}}}}
    results = {"setup": {"length": 4000, "model": "SmolLM2-135M-Instruct (x)", "samples": 2}, "tasks": tasks,
               "rows": ruler.summarize(runs, tasks)}
    line = ruler.summary_line(results)
    assert line.startswith("summary: RULER 4000, SmolLM2-135M-Instruct, 1 tasks x 2: stock 75.0; kvc r8 37.5 (50%")


def test_held_out_haystack_names_its_own_samples_and_outputs():
    from benchmarks.quality.ruler_harness import SampleSet

    model = ruler.REPO_ROOT / "smollm2"
    assert SampleSet(model, 4000, 25).key == "smollm2-L4000-n25-set0"  # the essays' cached samples keep their key
    assert SampleSet(model, 4000, 25, 1, "sotu").key == "smollm2-L4000-n25-set1-sotu"
    with pytest.raises(ValueError, match="haystack 'austen'"):
        SampleSet(model, 4000, 25, 0, "austen")
    args = ruler.parse_args(["--haystack", "sotu", "--sample-set", "1"])
    assert args.haystack == "sotu" and args.out.endswith("ruler-smollm2-4k-sotu-set1-cpu")
    assert ruler.parse_args([]).out.endswith("ruler-smollm2-4k-cpu")


def test_the_held_out_package_mirror_swaps_only_the_essays(tmp_path, monkeypatch):
    """The mirror links every file of the package but the essays' JSON, which holds the
    other text; the package itself is untouched."""
    from benchmarks.common import offline_assets
    from benchmarks.quality.ruler_harness import ESSAYS_JSON, RulerEnv, package_with_haystack

    package = tmp_path / "long_context_eval"
    for relative, text in [(ESSAYS_JSON, '{"text": "essays"}'), ("data/prepare.py", "print(1)"),
                           ("data/synthetic/niah.py", "# niah"), ("synthetic.yaml", "a: 1")]:
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text)
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(offline_assets, "sotu_text", lambda: "Mr. President, Mr. Speaker")
    env = RulerEnv(python=tmp_path / "python", package=package, nltk_data=tmp_path)
    assert package_with_haystack(env, "essays") == package
    mirror = package_with_haystack(env, "sotu")
    assert json.loads((mirror / ESSAYS_JSON).read_text()) == {"text": "Mr. President, Mr. Speaker"}
    assert not (mirror / ESSAYS_JSON).is_symlink()
    for relative in ("data/prepare.py", "data/synthetic/niah.py", "synthetic.yaml"):
        assert (mirror / relative).resolve() == (package / relative).resolve()
    assert json.loads((package / ESSAYS_JSON).read_text()) == {"text": "essays"}
    assert package_with_haystack(env, "sotu") == mirror  # made once


def _git(root, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def test_kvcompress_predictions_survive_commits_that_leave_the_engine_code_alone(tmp_path):
    """A kvcompress prediction folder is resumed under the same engine code only: a commit
    of benchmarks or docs keeps its stamp, an edit of kvcompress/ or patches/ (uncommitted,
    each edit its own, or committed) changes it; stock's stamp never names the code."""
    from benchmarks.quality.ruler_harness import ServeConfig, reset_dir

    root = tmp_path / "repo"
    for path, text in {"kvcompress/a.py": "A = 1\n", "patches/p.py": "P = 1\n", "benchmarks/b.py": "B = 1\n"}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    _git(root.parent, "init", "-q", str(root))
    for args in (("add", "-A"), ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")):
        _git(root, *args)
    first = ruler.engine_code_id(root)

    def commit(path: str, text: str) -> str:
        (root / path).write_text(text)
        _git(root, "add", "-A")
        _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path)
        return ruler.engine_code_id(root)

    assert commit("benchmarks/b.py", "B = 2\n") == first
    (root / "kvcompress/a.py").write_text("A = 2\n")
    dirty = ruler.engine_code_id(root)
    (root / "kvcompress/a.py").write_text("A = 3\n")
    other_dirty = ruler.engine_code_id(root)
    (root / "patches/new.py").write_text("N = 1\n")  # untracked counts too
    untracked = ruler.engine_code_id(root)
    assert len({first, dirty, other_dirty, untracked}) == 4 and "-dirty-" in dirty
    (root / "patches/new.py").unlink()
    committed = commit("kvcompress/a.py", "A = 3\n")
    assert committed not in (first, other_dirty) and "-dirty" not in committed

    stamp = {"commit": "abc1234", "engine_code": "code-1", "samples": "m-L4000-n5-set1", "flags": ["--seed", "0"]}
    stock = ruler.prediction_stamp(stamp, ServeConfig())
    # The folders of runs made before engine stamps existed keep resuming for stock.
    assert stock == {"samples": stamp["samples"], "flags": stamp["flags"], "config": "stock", "commit": None}
    # kvcompress's: the engine code the run read at its start (a checkout edited during a
    # long run does not change what its folders and results say they ran)
    kvc = ruler.prediction_stamp(stamp, ServeConfig("kvc", 8.0))
    assert kvc["engine_code"] == "code-1" and kvc["config"] == "kvc r8"
    folder = tmp_path / "kvc-r8"
    reset_dir(folder, kvc)
    (folder / "vt.jsonl").write_text("{}\n")
    reset_dir(folder, kvc)
    assert (folder / "vt.jsonl").exists()  # same code: resumed
    reset_dir(folder, ruler.prediction_stamp(stamp | {"engine_code": "code-2"}, ServeConfig("kvc", 8.0)))
    assert not (folder / "vt.jsonl").exists()  # other code: started afresh


def test_the_kept_share_is_what_compressions_did_not_evict():
    metrics = {"kvcompress:kvs_before_compression_total": 8000.0, "kvcompress:kvs_evicted_total": 6500.0}
    assert ruler.kept_share(metrics) == pytest.approx(0.1875)
    assert ruler.kept_share({"kvcompress:kvs_evicted_total": 0.0}) is None  # nothing compressed
