"""RULER result files of the same setup on different sample sets, pooled into one table.

``ruler.py`` (or ``ruler_kvpress.py``) runs one sample set at a time (``--sample-set k``:
the generator's seed 42 + k, the QA questions of chunk k): that is what keeps a run
resumable and lets a comparison grow across sessions, set by set, without redoing the
sets already scored. This script pools such files: each configuration's per-sample scores
of every set side by side (a sample is named ``set<k>:<index>``), then the same summary as
one run (mean of task means, % of the reference, paired 95% bootstrap intervals).

Files are pooled only where that is one experiment: the same model, length, haystack,
tasks, server flags / kvpress setup, and for kvcompress rows the same engine code
(``ruler.engine_code_id``: predictions made by other engine code are another experiment,
run that set again), and sets whose QA questions do not repeat (use one ``--samples`` for
every set). A configuration missing from a file is left out of the pooled table,
and said so.

    python benchmarks/quality/ruler_combine.py benchmarks/results/ruler-smollm2-4k-sotu-set{1,2,3}-cpu.json \\
        --out benchmarks/results/ruler-smollm2-4k-sotu-sets1-3-cpu

Writes ``OUT.md``, ``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))

from benchmarks.quality.ruler import (
    HAYSTACK_NAMES,
    git_commit,
    summarize,
    summary_line,
    table_lines,
    write_plot,
)

SAME_SETUP = ("model", "length", "haystack", "server_flags", "environment", "ruler_requirements",
              "kvpress_requirements", "question_openings")
"""Setup fields every pooled file must agree on (absent counts as a value)."""
REFERENCES = ("stock", "no press")  # ruler.py's reference row, ruler_kvpress.py's


class PoolError(ValueError):
    """The files are not one experiment; the message names the file and the field."""


def reference_label(results: dict) -> str:
    found = [label for label in REFERENCES if label in results["runs"]]
    if not found:
        raise PoolError(f"no reference run ({' or '.join(REFERENCES)}) among {sorted(results['runs'])}")
    return found[0]


def check_poolable(named: dict[str, dict]) -> None:
    """Raise :class:`PoolError` unless ``named`` (path -> result) are one setup on
    distinct sample sets, and kvcompress rows come from one engine code."""
    first_path, first = next(iter(named.items()))
    sets: dict[int, str] = {}
    for path, results in named.items():
        setup = results["setup"]
        for key in SAME_SETUP:
            if setup.get(key) != first["setup"].get(key):
                raise PoolError(f"{path}: setup {key!r} is {setup.get(key)!r}, {first_path} has {first['setup'].get(key)!r}")
        if results["tasks"] != first["tasks"]:
            raise PoolError(f"{path}: tasks {results['tasks']} differ from {first_path}'s {first['tasks']}")
        if setup["sample_set"] in sets:
            raise PoolError(f"{path}: sample set {setup['sample_set']} is already {sets[setup['sample_set']]}'s")
        sets[setup["sample_set"]] = path
        if reference_label(results) != reference_label(first):
            raise PoolError(f"{path}: reference {reference_label(results)!r}, {first_path} has {reference_label(first)!r}")
    _check_questions_disjoint({path: (r["setup"]["sample_set"], r["setup"]["samples"]) for path, r in named.items()})
    engines = {path: r["setup"].get("engine_code") for path, r in named.items() if _has_kvcompress_rows(r)}
    if len(set(engines.values())) > 1 or None in engines.values():
        listed = ", ".join(f"{p}: {code or 'not recorded'}" for p, code in engines.items())
        raise PoolError(f"kvcompress rows made by different engine code ({listed}); run those sets again")


def _check_questions_disjoint(sets: dict[str, tuple[int, int]]) -> None:
    """RULER's QA tasks read SQuAD / HotpotQA questions by global index: set k of n samples
    a task (``ruler_harness.prepare_samples``: chunk k of k + 1 of n * (k + 1)) asks
    questions k*n .. (k+1)*n - 1. Sets of different sizes can overlap; pooled, the same
    question would count twice."""
    spans = sorted((k * n, (k + 1) * n, path) for path, (k, n) in sets.items())
    for (_, end, path), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise PoolError(f"{other}: its QA questions from {start} repeat {path}'s (up to {end - 1}); "
                            "pool sets of the same --samples")


def _has_kvcompress_rows(results: dict) -> bool:
    return "server_flags" in results["setup"] and any(run["policy"] is not None for run in results["runs"].values())


def pooled_runs(named: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """Each configuration present in every file, its scores keyed ``set<k>:<index>``;
    and the labels left out (missing from some file)."""
    every = [set(r["runs"]) for r in named.values()]
    common, left_out = set.intersection(*every), sorted(set.union(*every) - set.intersection(*every))
    order = [label for label in next(iter(named.values()))["runs"] if label in common]
    reference = reference_label(next(iter(named.values())))
    order = [reference] + [label for label in order if label != reference]
    runs: dict[str, dict] = {}
    for label in order:
        scores: dict[str, dict[str, float]] = {}
        for results in named.values():
            run, k = results["runs"][label], results["setup"]["sample_set"]
            for task, per_sample in run["scores"].items():
                scores.setdefault(task, {}).update({f"set{k}:{i}": s for i, s in per_sample.items()})
        some = next(iter(named.values()))["runs"][label]
        kept = {str(r["setup"]["sample_set"]): r["runs"][label].get("kept_fraction") for r in named.values()}
        runs[label] = {"policy": some["policy"], "rate": some["rate"], "scores": scores,
                       "wall_s": sum(r["runs"][label].get("wall_s", 0.0) for r in named.values()),
                       "kept_fraction_by_set": {k: f for k, f in kept.items() if f is not None}}
    return runs, left_out


def pool(named: dict[str, dict]) -> dict[str, Any]:
    """The pooled result (``ruler.py``'s layout; ``setup`` lists the sources)."""
    check_poolable(named)
    runs, left_out = pooled_runs(named)
    first = next(iter(named.values()))
    tasks = first["tasks"]
    setup = {key: first["setup"][key] for key in SAME_SETUP if key in first["setup"]}
    setup.update({
        "sample_sets": [r["setup"]["sample_set"] for r in named.values()],
        "samples": sum(r["setup"]["samples"] for r in named.values()),
        "engine_code": next((r["setup"]["engine_code"] for r in named.values() if _has_kvcompress_rows(r)), None),
        "commit": git_commit(), "left_out": left_out,
        "sources": [{"path": p, "sample_set": r["setup"]["sample_set"], "samples": r["setup"]["samples"],
                     "commit": r["setup"].get("commit"), "machine": r["machine"].get("cpu")} for p, r in named.items()],
    })  # fmt: skip
    return {"setup": setup, "machine": first["machine"], "tasks": tasks, "runs": runs,
            "rows": summarize(runs, tasks, reference=reference_label(first))}


def kept_by_set_lines(runs: dict[str, dict]) -> list[str]:
    """The report's lines on the KVs each configuration kept, set by set, where the source
    runs recorded it (kvcompress: the server's ``/metrics``; kvpress: the press's fraction).
    Not pooled into one figure: each set's share is over the prompts its server answered."""
    shown = [f"- {label}: " + ", ".join(f"set {k} {100 * f:.1f}%" for k, f in sorted(run["kept_fraction_by_set"].items(), key=lambda kv: int(kv[0])))
             for label, run in runs.items() if run.get("kept_fraction_by_set")]
    return ["## KVs kept, by sample set", "", *shown, ""] if shown else []


def write_report(results: dict, prefix: str) -> list[str]:
    setup, rows, tasks = results["setup"], results["rows"], results["tasks"]
    reference = rows[0]["label"]
    sources = "; ".join(f"set {s['sample_set']} ({s['samples']} a task): `{Path(s['path']).name}`, commit {s['commit']}"
                        for s in setup["sources"])
    flags = setup.get("server_flags") or setup.get("kvpress_requirements")
    text = [
        f"# RULER {setup['length']} (NVIDIA's packaged RULER), sample sets pooled — {setup['model']}", "",
        f"- {setup['samples']} samples per task: sample sets {', '.join(map(str, setup['sample_sets']))} "
        f"(haystack {HAYSTACK_NAMES[setup.get('haystack', 'essays')]}), {len(tasks)} tasks; "
        f"each configuration on every set with the same setup: `{' '.join(flags)}`",
        f"- sources: {sources}",
        (f"- kvcompress engine code: {setup['engine_code'] or '-'}; pooled at commit {setup['commit']}"
         + (f"; left out (not in every file): {', '.join(setup['left_out'])}" if setup["left_out"] else "")),
        f"- (lo-hi): 95% percentile-bootstrap interval over the pooled samples (paired with {reference} for %)", "",
        "## Score (0-100)", "", *table_lines(rows, tasks, pct=False), "",
        f"## % of {reference}", "", *table_lines(rows, tasks, pct=True), "",
        *kept_by_set_lines(results["runs"]),
    ]  # fmt: skip
    Path(f"{prefix}.md").write_text("\n".join(text))
    Path(f"{prefix}.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    written = [f"{prefix}.md", f"{prefix}.json"]
    if write_plot(rows, f"{prefix}.png", f"RULER {setup['length']}, {setup['model'].split(' ')[0]}, "
                                         f"sets {','.join(map(str, setup['sample_sets']))}"):
        written.append(f"{prefix}.png")
    return written


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks/quality/ruler_combine.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="result JSONs of ruler.py or ruler_kvpress.py, one per sample set")
    parser.add_argument("--out", required=True, help="output prefix")
    args = parser.parse_args(argv)
    if len(args.results) < 2:
        parser.error("results: pool at least two files")
    named = {path: json.loads(Path(path).read_text()) for path in args.results}
    try:
        results = pool(named)
    except PoolError as error:
        parser.error(str(error))
    for path in write_report(results, args.out):
        print(f"wrote {path}", file=sys.stderr)
    if results["setup"]["left_out"]:
        print(f"left out (not in every file): {', '.join(results['setup']['left_out'])}", file=sys.stderr)
    print("\n".join(table_lines(results["rows"], results["tasks"], pct=True)))
    print(summary_line(results))
    return results


if __name__ == "__main__":
    main()
