"""The throughput benchmark on two checkouts of kvcompress, interleaved: is a refactor free?

``benchmark_throughput.py`` measures stock vLLM and kvcompress side by side in one run; this
runs it ``--repeats`` times on each of two commits (``--before``, ``--after``; ``.`` is this
working tree), alternating which goes first (B A, A B, B A, ...), so both see the same
machine drift. Each run is the commit's own benchmark script (``benchmarks/throughput/`` or,
before the regrouping, ``benchmarks/``) in a temporary ``git worktree`` with its own
``kvcompress`` (``benchmarks/common/checkouts.py``). ``quality/compare_quality_checkouts.py``
is the quality counterpart.

Reported per (input length, engine, rate): each commit's median output tokens/s, the median
of the paired after/before ratios (each pair ran back to back), and each commit's median
kvcompress/stock multiplier (stock measured in the same run, so the multiplier is the
figure that compares across runs best).

    python benchmarks/throughput/compare_checkouts.py --before 8d591c4 --after . --repeats 3 \\
        --out benchmarks/results/refactor-throughput-tiny-cpu -- --rates 1 8 --input-lens 2048

Everything after ``--`` goes to ``benchmark_throughput.py`` (``--repeats``,
``--output-prefix``, ``--no-plots`` and ``--no-progress`` are set here). Writes
``<out>.json`` (every run's rows) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.common.checkouts import (  # noqa: E402
    Checkout, fmt, opened_checkouts, run_order, run_script, split_argv,
)

SCRIPT_PATHS = ("benchmarks/throughput/benchmark_throughput.py", "benchmarks/benchmark_throughput.py")


def row_key(row: dict) -> tuple[int, str, float]:
    return int(row["input_len"]), str(row["engine"]), float(row["rate"])


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per row key: medians per commit, the paired after/before ratio, kvc/stock multipliers.

    ``runs[label][rep]`` is that run's JSON (``rows`` of benchmark_throughput)."""
    by_key: dict[tuple, dict[str, list[float]]] = {}
    stock: dict[tuple[str, int, int], float] = {}
    for label, reps in runs.items():
        for rep, result in enumerate(reps):
            for row in result["rows"]:
                key = row_key(row)
                by_key.setdefault(key, {}).setdefault(label, []).append(row["output_tokens_per_s"])
                if row["engine"] == "stock vLLM":
                    stock[(label, rep, key[0])] = row["output_tokens_per_s"]
    summary = []
    for key in sorted(by_key):
        values = by_key[key]
        before, after = values.get("before", []), values.get("after", [])
        pairs = [a / b for a, b in zip(after, before) if b > 0]
        entry = {"input_len": key[0], "engine": key[1], "rate": key[2],
                 "before_tokens_per_s": before, "after_tokens_per_s": after,
                 "before_median": statistics.median(before) if before else None,
                 "after_median": statistics.median(after) if after else None,
                 "paired_after_over_before": statistics.median(pairs) if pairs else None}
        if key[1] != "stock vLLM":
            for label in ("before", "after"):
                ratios = [value / stock[(label, rep, key[0])]
                          for rep, value in enumerate(values.get(label, []))
                          if stock.get((label, rep, key[0]))]
                entry[f"{label}_vs_stock"] = statistics.median(ratios) if ratios else None
        summary.append(entry)
    return summary


def render_markdown(checkouts: list[Checkout], summary: list[dict], meta: dict) -> str:
    lines = [f"# Throughput before / after ({meta['date']})", "",
             f"Host: {meta['machine']}. {meta['repeats']} interleaved repetitions per commit; "
             f"benchmark arguments: `{' '.join(meta['benchmark_args']) or '(defaults)'}`.", ""]
    lines += [f"- {c.label}: `{c.rev}` = {c.commit}" for c in checkouts]
    lines += ["", "| input | engine | rate | before tok/s (median) | after tok/s (median) | "
              "after / before (paired median) | before vs stock | after vs stock |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in summary:
        lines.append(f"| {e['input_len']} | {e['engine']} | {e['rate']:g} | {fmt(e['before_median'], '.1f')} | "
                     f"{fmt(e['after_median'], '.1f')} | {fmt(e['paired_after_over_before'], '.3f')} | "
                     f"{fmt(e.get('before_vs_stock'), '.3f')} | {fmt(e.get('after_vs_stock'), '.3f')} |")
    return "\n".join(lines) + "\n"


def run_benchmark(checkout: Checkout, benchmark_args: list[str], prefix: Path) -> dict:
    run_script(checkout, SCRIPT_PATHS, [*benchmark_args, "--repeats", "1", "--no-plots", "--no-progress",
                                        "--output-prefix", str(prefix)])
    return json.loads(prefix.with_suffix(".json").read_text())


def main(argv: list[str] | None = None) -> dict:
    own, benchmark_args = split_argv(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="commit to compare against")
    parser.add_argument("--after", default=".", help="commit measured against it ('.' = this working tree)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True, help="output prefix for .json and .md")
    args = parser.parse_args(own)

    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with opened_checkouts(args.before, args.after) as (checkouts, scratch):
        by_label = {c.label: c for c in checkouts}
        for rep, label in run_order(args.repeats):
            runs[label].append(run_benchmark(by_label[label], benchmark_args, scratch / f"{label}-{rep}"))
    meta = {"date": runs["after"][0]["date"], "machine": runs["after"][0]["machine"], "repeats": args.repeats,
            "benchmark_args": benchmark_args}
    summary = summarize(runs)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {**meta, "checkouts": [c.record() for c in checkouts], "summary": summary, "runs": runs}, indent=1))
    out.with_suffix(".md").write_text(render_markdown(checkouts, summary, meta))
    print(out.with_suffix(".md").read_text())
    return {"summary": summary}


if __name__ == "__main__":
    main()
