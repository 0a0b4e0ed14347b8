"""One ranking of eviction policies from several ``eval_quality.py`` runs on the same
samples: every (policy, rate) cell of every file scored against the one full-cache run,
as if a single run had made them all.

    python benchmarks/quality_ranking.py A.json B.json ... --out PREFIX

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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_quality as quality  # noqa: E402

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
        f"- command: `python benchmarks/quality_ranking.py {argv}`",
        "",
        *sources_lines(merged),
        "",
        quality.format_table(merged, markdown=True),
        "",
    ]
    Path(f"{prefix}.md").write_text("\n".join(md))
    written = quality.write_plot(merged, f"{prefix}.png", log=log)
    log(f"wrote {prefix}.json, {prefix}.md" + (f", {prefix}.png" if written else ""))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results JSONs of eval_quality.py (first listed wins a cell)")
    parser.add_argument("--out", default=None, help="write <OUT>.json/.md/.png")
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(raw)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    merged = merge_results(args.results, log=log)
    print(quality.format_table(merged))
    if args.out:
        write_outputs(merged, args.out, " ".join(raw), log=log)
    return merged


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
