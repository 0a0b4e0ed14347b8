"""One ranking of eviction policies from several ``eval_quality.py`` runs on the same
samples: every (policy, rate) cell of every file scored against the one full-cache run,
as if a single run had made them all.

    python benchmarks/quality/quality_ranking.py A.json B.json ... --out PREFIX

Writes ``PREFIX.json`` / ``.md`` / ``.png`` as ``eval_quality.py --out`` does (summary
tables policies x rates, the ranking per rate with 95% bootstrap intervals, each
policy's table), the Markdown starting with where each cell came from (file, date,
machine, command).

Refused, naming the file and the difference, unless every file answered the same
samples (the settings ``--full-from`` checks, and the sample list), under the same
kvcompress settings (continual-compression interval, ``--kv-compress-*`` overrides,
engine arguments), with the same full-cache answers (texts equal, teacher-forced
log-likelihoods within ``NLL_TOLERANCE``). A (policy, rate) in several files is taken
from the first one listed; whether the others answered the same is reported.

``--differences kvzip:kvc kvzip:snapkv`` adds, per string-match task and rate, the paired
difference of two policies as % of the full cache's score with its 95% bootstrap
interval: whether one is ahead of the other beyond the noise of these samples, which
overlapping per-policy intervals do not tell.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.quality import eval_quality as quality  # noqa: E402

SETTING_KEYS = (*quality.FULL_RUN_KEYS, "kv_compress_interval", "kvc_settings", "engine_args")
"""Config keys that must be equal in every file (samples, and how kvcompress ran)."""

NLL_TOLERANCE = 1e-3
"""Largest difference (nats per token) between two files' full-cache log-likelihoods:
stock vLLM's answers to these samples measured 4.2e-5 apart on different days/hosts."""


def _differences(first: dict, other: dict) -> list[str]:
    """What keeps ``other`` from being scored against ``first``'s full cache."""
    config, theirs = first["config"], other["config"]
    out = [f"{key} {theirs.get(key)!r} there, {config.get(key)!r} in the first" for key in SETTING_KEYS
           if theirs.get(key) != config.get(key)]
    if not out and other["samples"] != first["samples"]:
        out.append("its samples differ (same settings, other texts)")
    if out:
        return out
    full, mine = other["runs"]["full"], first["runs"]["full"]
    texts = sum(a != b for a, b in zip(full["texts"], mine["texts"]))
    if texts:
        out.append(f"{texts} of its full-cache answers differ")
    gap = _nll_gap(full, mine)
    if gap > NLL_TOLERANCE:
        out.append(f"its full-cache log-likelihoods differ by up to {gap:.2g} nats (> {NLL_TOLERANCE})")
    return out


def _nll_gap(a: dict, b: dict) -> float:
    """Largest per-token difference of two runs' teacher-forced log-likelihoods (0 without any)."""
    return max((abs(x - y) for u, v in zip(a.get("nll") or [], b.get("nll") or []) if u and v
                for x, y in zip(u, v)), default=0.0)


def _same_answers(a: dict, b: dict) -> bool:
    return a["texts"] == b["texts"] and _nll_gap(a, b) <= NLL_TOLERANCE


def merge_results(paths: list[str], log=print) -> dict[str, Any]:
    """The runs of ``paths`` (results JSONs of ``eval_quality.py``) as one results dict:
    the first file's full cache, every file's (policy, rate) runs (the first listed
    wins a cell), ``rows`` scored anew (:func:`eval_quality.score_rows`) and
    ``config["merged_from"]``: per file its path, date, machine, command, wall time,
    the cells taken from it and the cells it repeated (with whether it answered the same).
    """
    if not paths:
        raise ValueError("no results files given")
    loaded = [(str(path), json.loads(Path(path).read_text())) for path in paths]
    for path, results in loaded:
        if not {"config", "samples", "runs"} <= set(results):
            raise ValueError(f"{path}: not a results file of eval_quality.py (no config, samples or runs)")
    first_path, first = loaded[0]
    runs: dict[str, Any] = {"full": first["runs"]["full"]}
    owner: dict[tuple[str, float], tuple[str, dict]] = {}
    sources = []
    for path, results in loaded:
        differs = _differences(first, results) if path != first_path else []
        if differs:
            raise ValueError(f"{path}: cannot be ranked with {first_path}: " + "; ".join(differs))
        taken, repeated = [], []
        for policy, by_rate in results["runs"].items():
            if policy == "full":
                continue
            for rate, run in by_rate.items():
                cell = (policy, float(rate))
                label = f"{policy} r{float(rate):g}"
                if cell in owner:
                    where, earlier = owner[cell]
                    same = _same_answers(earlier, run)
                    repeated.append({"cell": label, "taken_from": where, "same_answers": same})
                    if not same:
                        log(f"warning: {label} of {path} answered otherwise than {where}'s (kept: {where})")
                    continue
                owner[cell] = (path, run)
                runs.setdefault(policy, {})[float(rate)] = run
                taken.append(label)
        sources.append({
            "path": path, "date": results["machine"].get("date"), "cpu": results["machine"].get("cpu"),
            "command": results.get("argv"), "wall": results.get("timings", {}).get("wall"),
            "cells": taken, "repeated": repeated,
        })  # fmt: skip
    for policy in list(runs)[1:]:
        runs[policy] = dict(sorted(runs[policy].items()))
    config = {key: value for key, value in first["config"].items() if key != "full_from"}
    config["rates"] = sorted({rate for policy in list(runs)[1:] for rate in runs[policy]})
    config["policies"] = list(runs)[1:]
    config["merged_from"] = sources
    merged = {"config": config, "machine": first["machine"], "samples": first["samples"], "runs": runs,
              "rate1_identical": None}
    merged["rows"] = quality.score_rows(merged)
    merged["timings"] = {"wall": sum(s["wall"] or 0.0 for s in sources)}
    return merged


def sources_lines(merged: dict) -> list[str]:
    """Markdown: where each cell came from."""
    lines = ["| file | date | machine | cells taken | cells repeated (same answers?) | wall s |",
             "| --- | --- | --- | --- | --- | ---: |"]
    for s in merged["config"]["merged_from"]:
        repeated = ", ".join(f"{r['cell']} ({'same' if r['same_answers'] else 'DIFFERENT'})" for r in s["repeated"])
        wall = f"{s['wall']:.0f}" if s["wall"] else "-"
        lines.append(f"| `{Path(s['path']).name}` | {s['date']} | {s['cpu']} | {', '.join(s['cells']) or '-'} "
                     f"| {repeated or '-'} | {wall} |")
    return lines


def write_outputs(merged: dict, prefix: str, argv: str, log=print) -> None:
    """``<prefix>.json``, ``<prefix>.md``, ``<prefix>.png`` (if matplotlib)."""
    quality._write_json(f"{prefix}.json", merged)
    config = merged["config"]
    md = [
        f"# Quality ranking: eviction policies vs full cache ({config['model'].split(' (')[0]}, CPU)",
        "",
        f"- model: {config['model']}",
        f"- samples: {config['limit']} per RULER (task, length); lengths {config['lengths']}; "
        f"tasks {config['tasks']}; {config['ppl_samples']} perplexity windows; seed {config['seed']}",
        f"- engine: {', '.join(f'{k}={v}' for k, v in config['engine_args'].items() if k != 'logits_processors')}; "
        f"kvcompress interval {config['kv_compress_interval']}"
        + "".join(f", {k}={v}" for k, v in config.get("kvc_settings", {}).items()),
        f"- {len(config['merged_from'])} runs on these samples, one full-cache run (the first file's; "
        "every file's full-cache answers checked equal), each (policy, rate) scored against it; "
        f"{sum(s['wall'] or 0 for s in config['merged_from']) / 3600:.1f} h of runs in all",
        f"- command: `python benchmarks/quality/quality_ranking.py {argv}`",
        "",
        *sources_lines(merged),
        "",
        quality.format_table(merged, markdown=True),
        "",
    ]
    if merged.get("differences"):
        md += ["Paired differences (A - B as % of the full cache's score; 95% bootstrap interval over "
               "the samples, the same draws for A, B and the full cache):", ""]
        md += [f"- {line}" for line in difference_lines(merged["differences"])] + [""]
    Path(f"{prefix}.md").write_text("\n".join(md))
    written = quality.write_plot(merged, f"{prefix}.png", log=log)
    log(f"wrote {prefix}.json, {prefix}.md" + (f", {prefix}.png" if written else ""))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results JSONs of eval_quality.py (first listed wins a cell)")
    parser.add_argument("--out", default=None, help="write <OUT>.json/.md/.png")
    parser.add_argument("--differences", nargs="+", default=[], metavar="A:B",
                        help="also the paired difference of policy A minus policy B per task and rate, "
                        "as %% of the full cache's score, with its 95%% bootstrap interval (the same "
                        "resampled samples for A, B and the full cache)")
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(raw)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    merged = merge_results(args.results, log=log)
    pairs = [_pair(text, merged) for text in args.differences]
    merged["differences"] = difference_rows(merged, pairs)
    print(quality.format_table(merged))
    for line in difference_lines(merged["differences"]):
        print(line)
    if args.out:
        write_outputs(merged, args.out, " ".join(raw), log=log)
    return merged


def _pair(text: str, merged: dict) -> tuple[str, str]:
    first, _, second = text.partition(":")
    for policy in (first, second):
        if policy not in merged["runs"] or policy == "full":
            raise ValueError(f"--differences {text}: no runs of policy {policy!r} in these files")
    return first, second


def paired_difference(first: list[float], second: list[float], full: list[float],
                      resamples: int = quality.BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict | None:
    """``100 * (mean(first) - mean(second)) / mean(full)`` over one cell's samples, and its
    95% percentile-bootstrap interval: each resample draws the same samples for the
    three (the answers are paired). None when the full cache scores 0 in most resamples."""
    if not len(first) == len(second) == len(full) or not full:
        raise ValueError("paired_difference: the three score lists must be equally long and not empty")
    a, b, f = (np.asarray(v, dtype=float) for v in (first, second, full))
    draw = np.random.default_rng(seed).integers(0, len(f), size=(resamples, len(f)))
    full_mean = f[draw].mean(axis=1)
    valid = full_mean > 0
    if valid.mean() < 0.5 or f.mean() == 0:
        return None
    stat = 100 * (a[draw].mean(axis=1) - b[draw].mean(axis=1))[valid] / full_mean[valid]
    low, high = np.percentile(stat, [2.5, 97.5])
    return {"difference": float(100 * (a.mean() - b.mean()) / f.mean()), "ci": [float(low), float(high)]}


def difference_rows(merged: dict, pairs: list[tuple[str, str]]) -> list[dict]:
    """Per pair, string-match task and rate both policies ran: :func:`paired_difference`
    of their per-sample scores against the full cache's (perplexity windows are left out)."""
    rows = {(r["policy"], r["rate"], r["task"], r["length"]): r for r in merged["rows"]
            if r["task"] != "ppl" and r["length"] != "all" and r.get("per_sample") is not None}
    out = []
    for first, second in pairs:
        for (policy, rate, task, length), row in rows.items():
            other = rows.get((second, rate, task, length))
            full = rows.get(("full", 1.0, task, length))
            if policy != first or other is None or full is None:
                continue
            result = paired_difference(row["per_sample"], other["per_sample"], full["per_sample"])
            out.append({"first": first, "second": second, "rate": rate, "task": task, "length": length,
                        "n": len(full["per_sample"]), **(result or {"difference": None, "ci": None})})
    return out


def difference_lines(differences: list[dict]) -> list[str]:
    """One line per row of :func:`difference_rows`, saying whether 0 is outside the interval."""
    lines = []
    for d in differences:
        head = f"{d['first']} - {d['second']}, {d['task']} {d['length']} r{d['rate']:g} (n {d['n']}): "
        if d["difference"] is None:
            lines.append(head + "- (the full cache scores 0)")
            continue
        low, high = d["ci"]
        verdict = "ahead" if low > 0 else "behind" if high < 0 else "not separated"
        lines.append(head + f"{d['difference']:+.0f} points of full ({low:+.0f} to {high:+.0f}): {verdict}")
    return lines


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
