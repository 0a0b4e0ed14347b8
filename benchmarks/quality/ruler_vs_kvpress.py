"""kvcompress against kvpress on the same RULER samples, rate by rate (issue 59's comparison).

Reads ``ruler.py`` result files (stock vLLM and kvcompress at some rates) and
``ruler_kvpress.py`` files (kvpress's no-press run, the same in each, and its presses at some
compression ratios) of the same model, length, haystack and sample set. For every rate both sides
ran (a press's ``compression_ratio = 1 - 1/rate``), per task and for the mean of the
tasks: kvcompress's score as % of stock vLLM, each press's as % of its own no-press run,
and their paired difference, kvc % minus press %, with a 95% percentile-bootstrap
interval (every resample draws the same samples for the four runs). Each side is read
against its own full cache, so that the two engines' full-cache answers (vLLM against
transformers) do not count as compression. A task where kvc trails a press beyond the
interval (the interval's top below 0) is listed under "kvc behind": the acceptance wants
each such case's reason measured.

Samples: where the files' ``--samples`` differ, the first ``min(n)`` samples of a task
are the same draw, but not for the QA tasks (the package draws a set's QA questions by
chunk of ``--samples``, see ``ruler_combine._check_questions_disjoint``: SmolLM2 set 1
at 5 and at 10 samples, compared 2026-12-02, have qa_1 / qa_2 inputs all different and
the other 11 tasks' first 5 identical); those are then left out, and said so.

    python benchmarks/quality/ruler_vs_kvpress.py \\
        --kvc benchmarks/results/ruler-smollm2-4k-sotu-set1-r4-cpu.json benchmarks/results/ruler-smollm2-4k-sotu-set1-r16-cpu.json \\
        --kvpress benchmarks/results/ruler-kvpress-smollm2-4k-sotu-set1-r4-r16-question-cpu.json \\
        --out benchmarks/results/ruler-vs-kvpress-smollm2-4k-sotu-set1-cpu

Writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))

SAME_SETUP = ("model", "length", "haystack", "sample_set")
"""Setup fields both sides must share to be read as the same samples."""
QA_TASKS = ("qa_1", "qa_2")
"""Tasks whose samples depend on ``--samples`` (see the module's docstring)."""
RESAMPLES = 2000


@dataclass(frozen=True)
class Run:
    """One configuration's per-sample scores: ``scores[task][index]`` (0-100)."""

    label: str
    rate: float | None
    scores: dict[str, dict[str, float]]


@dataclass(frozen=True)
class Side:
    """One engine's runs on the samples: its full-cache ``reference`` and compressed
    ``runs``, over ``tasks`` (in the package's order)."""

    setup: dict[str, Any]
    tasks: list[str]
    reference: Run
    runs: list[Run]


def load_kvc(paths: list[Path]) -> Side:
    """``ruler.py`` files: their stock run (the same samples in each file) and every kvc run."""
    setups, tasks, runs, reference = [], [], [], None
    for path in paths:
        results = json.loads(path.read_text())
        setups.append(results["setup"])
        tasks = tasks or results["tasks"]
        for label, run in results["runs"].items():
            if label == "stock":
                reference = reference or Run(label, None, run["scores"])
            else:
                runs.append(Run(label, float(run["rate"]), run["scores"]))
    if reference is None:
        raise ValueError("--kvc: no file has a stock run")
    for setup in setups[1:]:
        _require_same(setups[0], setup, (*SAME_SETUP, "samples"), "--kvc files")
    return Side(setups[0], tasks, reference, runs)


def load_kvpress(paths: list[Path]) -> Side:
    """``ruler_kvpress.py`` files of the same samples: their one no-press run (each file's,
    the same scores in all: a later file may reuse an earlier's through ``--reference-from``)
    and every press."""
    setups, tasks, presses, reference = [], [], {}, None
    for path in paths:
        results = json.loads(path.read_text())
        runs = [Run(label, run["rate"], run["scores"]) for label, run in results["runs"].items()]
        references = [run for run in runs if run.rate is None]
        if len(references) != 1:
            raise ValueError(f"--kvpress {path}: {len(references)} no-press runs, one needed")
        if reference is not None and _by_str(references[0].scores) != _by_str(reference.scores):
            raise ValueError(f"--kvpress {path}: its no-press scores differ from {paths[0]}'s")
        reference = reference or references[0]
        for run in runs:
            if run.rate is not None and presses.setdefault(run.label, run) is not run:
                raise ValueError(f"--kvpress: {run.label!r} in more than one file")
        setups.append(results["setup"])
        tasks = tasks or results["tasks"]
    for setup in setups[1:]:
        _require_same(setups[0], setup, (*SAME_SETUP, "samples", "kvpress_requirements"), "--kvpress files")
    return Side(setups[0], tasks, reference, list(presses.values()))


def _by_str(scores: dict) -> dict:
    """Per-sample scores keyed by strings (JSON's keys) whichever way they were written."""
    return {task: {str(index): value for index, value in by_index.items()} for task, by_index in scores.items()}


def _require_same(first: dict, second: dict, fields, what: str) -> None:
    for field in fields:
        if first.get(field) != second.get(field):
            raise ValueError(f"{what}: different {field} ({first.get(field)!r} against {second.get(field)!r})")


def common_samples(kvc: Side, kvpress: Side, tasks: list[str]) -> tuple[list[str], int, list[str]]:
    """(tasks compared, samples a task, tasks left out): the first ``min(n)`` samples of
    each task; QA tasks only when both sides drew the same number."""
    _require_same(kvc.setup, kvpress.setup, SAME_SETUP, "--kvc against --kvpress")
    samples = min(int(kvc.setup["samples"]), int(kvpress.setup["samples"]))
    same_draw = kvc.setup["samples"] == kvpress.setup["samples"]
    left_out = [] if same_draw else [t for t in tasks if t in QA_TASKS]
    return [t for t in tasks if t not in left_out], samples, left_out


def per_sample(run: Run, task: str, samples: int) -> np.ndarray:
    """``[samples]`` scores of the task's first samples (by index)."""
    by_index = run.scores[task]
    indices = sorted(by_index, key=int)[:samples]
    if len(indices) < samples:
        raise ValueError(f"{run.label}: {task} has {len(indices)} samples, {samples} needed")
    return np.asarray([by_index[i] for i in indices], dtype=float)


def pct_difference(kvc: list[np.ndarray], stock: list[np.ndarray], press: list[np.ndarray],
                   no_press: list[np.ndarray], resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Over cells (tasks) of equally many samples each: kvc's mean of task means as % of
    stock's, the press's as % of no press's, and ``kvc % - press %`` with its 95%
    percentile-bootstrap interval (each cell's samples drawn alike for the four runs).
    A % is None where its reference scores 0; the interval None where a reference is 0
    in most resamples."""
    rng = np.random.default_rng(seed)
    sums = np.zeros((4, resamples))
    for cell in zip(kvc, stock, press, no_press):
        draw = rng.integers(0, len(cell[0]), size=(resamples, len(cell[0])))
        for k, values in enumerate(cell):
            sums[k] += values[draw].mean(axis=1)
    means = [sum(float(v.mean()) for v in column) for column in (kvc, stock, press, no_press)]
    kvc_pct = 100 * means[0] / means[1] if means[1] else None
    press_pct = 100 * means[2] / means[3] if means[3] else None
    result = {"kvc_pct": kvc_pct, "press_pct": press_pct, "difference": None, "ci": None,
              "kvc_score": means[0] / len(kvc), "stock_score": means[1] / len(kvc),
              "press_score": means[2] / len(kvc), "no_press_score": means[3] / len(kvc)}
    if kvc_pct is None or press_pct is None:
        return result
    result["difference"] = kvc_pct - press_pct
    valid = (sums[1] > 0) & (sums[3] > 0)
    if valid.mean() >= 0.5:
        stat = 100 * (sums[0][valid] / sums[1][valid] - sums[2][valid] / sums[3][valid])
        low, high = np.percentile(stat, [2.5, 97.5])
        result["ci"] = [float(low), float(high)]
    return result


def compare(kvc: Side, kvpress: Side, tasks: list[str], samples: int) -> list[dict[str, Any]]:
    """A row per (kvc run, press at its rate): the mean and every task (:func:`pct_difference`)."""
    rows = []
    for run in kvc.runs:
        for press in (p for p in kvpress.runs if abs(p.rate - run.rate) < 1e-6):
            cells = {t: [per_sample(r, t, samples) for r in (run, kvc.reference, press, kvpress.reference)]
                     for t in tasks}
            row = {"kvc": run.label, "press": press.label, "rate": run.rate,
                   "mean": pct_difference(*(list(c) for c in zip(*cells.values()))),
                   "tasks": {t: pct_difference(*([c] for c in cell)) for t, cell in cells.items()}}
            row["kvc_behind"] = [t for t, cell in row["tasks"].items() if cell["ci"] and cell["ci"][1] < 0]
            rows.append(row)
    return rows


def _cell(stat: dict[str, Any]) -> str:
    if stat["difference"] is None:
        return "-"
    ci = f" ({stat['ci'][0]:+.0f}..{stat['ci'][1]:+.0f})" if stat["ci"] else ""
    return f"{stat['kvc_pct']:.0f} / {stat['press_pct']:.0f}: {stat['difference']:+.0f}{ci}"


def _names(kvpress_sources) -> str:
    """The kvpress files (one name in results written before several were read)."""
    return kvpress_sources if isinstance(kvpress_sources, str) else ", ".join(kvpress_sources)


def report_lines(results: dict[str, Any]) -> list[str]:
    setup, tasks = results["setup"], results["tasks"]
    lines = [
        f"# RULER {setup['length']}: kvcompress against kvpress on the same samples — {setup['model']}", "",
        f"- sample set {setup['sample_set']}, haystack {setup['haystack']}, the first {results['samples']} samples "
        f"of each task" + (f"; left out: {', '.join(results['left_out'])} (another draw at another --samples)"
                           if results["left_out"] else ""),
        f"- kvc: {', '.join(results['sources']['kvc'])}; kvpress: {_names(results['sources']['kvpress'])}",
        "- cell: kvc % of stock vLLM / press % of no press: difference in points (95% paired bootstrap interval); "
        "`-` where a full cache scores 0", "",
        "| kvc | press | mean | " + " | ".join(tasks) + " | kvc behind |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in tasks) + " | --- |",
    ]  # fmt: skip
    for row in results["rows"]:
        cells = [_cell(row["tasks"][t]) for t in tasks]
        lines.append(f"| {row['kvc']} | {row['press']} | {_cell(row['mean'])} | " + " | ".join(cells)
                     + f" | {', '.join(row['kvc_behind']) or 'none'} |")
    lines += ["", "Scores (0-100, mean of the task means over the compared samples): "
              + "; ".join(f"{r['kvc']} {r['mean']['kvc_score']:.1f} (stock {r['mean']['stock_score']:.1f}), "
                          f"{r['press']} {r['mean']['press_score']:.1f} (no press {r['mean']['no_press_score']:.1f})"
                          for r in results["rows"]), ""]
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvc", type=Path, nargs="+", required=True, help="ruler.py result JSONs")
    parser.add_argument("--kvpress", type=Path, nargs="+", required=True,
                        help="ruler_kvpress.py result JSONs of the same samples (one no-press reference)")
    parser.add_argument("--out", required=True, help="output prefix (OUT.md, OUT.json)")
    args = parser.parse_args(argv)
    kvc, kvpress = load_kvc(args.kvc), load_kvpress(args.kvpress)
    both = [t for t in kvpress.tasks if t in kvc.tasks]
    tasks, samples, left_out = common_samples(kvc, kvpress, both)
    rows = compare(kvc, kvpress, tasks, samples)
    if not rows:
        raise SystemExit("no rate in both: kvc rates "
                         f"{sorted({r.rate for r in kvc.runs})}, kvpress {sorted({r.rate for r in kvpress.runs})}")
    results = {"setup": {k: kvc.setup[k] for k in SAME_SETUP}, "tasks": tasks, "samples": samples,
               "left_out": left_out, "rows": rows,
               "sources": {"kvc": [p.name for p in args.kvc], "kvpress": [p.name for p in args.kvpress]}}
    report = "\n".join(report_lines(results))
    Path(f"{args.out}.md").write_text(report)
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(report)
    return results


if __name__ == "__main__":
    main()
