"""The quality evaluation on two checkouts of kvcompress: does a refactor change any answer?

Runs ``eval_quality.py`` once on each of two commits (``--before``, ``--after``; ``.`` is
this working tree), before first, each the commit's own script (``benchmarks/quality/`` or,
before the regrouping, ``benchmarks/``) in a temporary ``git worktree`` with its own
``kvcompress`` (``benchmarks/common/checkouts.py``), with the same arguments and seed.

Greedy decoding on CPU is deterministic, so a pure refactor gives the same samples and the
same outputs. eval_quality's JSON keeps each sample's generated text, the teacher-forced
negative log-likelihoods of the perplexity windows and the fraction of KVs kept after the
prompt was compressed (not the token ids: those it compares at rate 1 only), and those are
compared sample by sample.

Reported per (task, length, policy, rate) row of eval_quality: each commit's score (string
match, or perplexity for ``ppl``), the difference, each commit's % of the full cache, and
how many samples' outputs are identical; per run, the compression counters of both.

    python benchmarks/quality/compare_quality_checkouts.py --before 8d591c4 --after HEAD \\
        --out benchmarks/results/refactor-58-quality-smollm2-cpu \\
        -- --quick --rates 1 8 --policies kvc snapkv

Everything after ``--`` goes to ``eval_quality.py`` (``--seed``, ``--out`` and
``--no-progress`` are set here). Writes ``<out>.json`` (the summary and both runs' results)
and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.common.checkouts import (  # noqa: E402
    Checkout, fmt, opened_checkouts, run_order, run_script, split_argv,
)

SCRIPT_PATHS = ("benchmarks/quality/eval_quality.py", "benchmarks/eval_quality.py")
NOT_IN_RULER_MEAN = ("ppl", "niah_multiturn")
"""eval_quality's tasks outside its ``all`` rows (the RULER mean): perplexity and the
multi-turn task, which has rows of its own."""
RUN_COUNTERS = ("compressions", "compressions_on_interval", "pages_freed", "num_preemptions")


def run_eval(checkout: Checkout, eval_args: list[str], seed: int, prefix: Path) -> dict:
    run_script(checkout, SCRIPT_PATHS, [*eval_args, "--seed", str(seed), "--no-progress", "--out", str(prefix)])
    return json.loads(Path(f"{prefix}.json").read_text())


def find_run(results: dict, policy: str, rate: float) -> dict:
    """The run behind a row: the full cache's, or a policy's at a rate (JSON keys are text)."""
    if policy == "full":
        return results["runs"]["full"]
    return next(run for key, run in results["runs"][policy].items() if float(key) == rate)


def row_samples(samples: list[dict], task: str, length) -> list[int]:
    """Indices of the samples a row scores; ``all`` rows average the RULER cells."""
    def in_task(sample: dict) -> bool:
        return sample["task"] == task or (task == "all" and sample["task"] not in NOT_IN_RULER_MEAN)
    return [i for i, s in enumerate(samples) if in_task(s) and length in ("all", s["length"])]


def sample_output(run: dict, index: int) -> tuple:
    """What a run produced for one sample: its text, forced log-likelihoods, KVs kept."""
    kept = run.get("kv_kept")
    return run["texts"][index], run["nll"][index], None if kept is None else kept[index]


def nll_difference(before: dict, after: dict, indices: list[int]) -> float | None:
    """Largest |difference| of one forced token's negative log-likelihood (perplexity windows)."""
    pairs = [(a, b) for i in indices if before["nll"][i] is not None
             for a, b in zip(before["nll"][i], after["nll"][i])]
    return max((abs(a - b) for a, b in pairs), default=None)


def _difference(before, after):
    return None if before is None or after is None else after - before


def compare_row(before: dict, after: dict, row: dict, same_samples: bool) -> dict:
    """One row of eval_quality compared: scores, % of full, kept KVs, identical outputs."""
    key = (row["policy"], float(row["rate"]), row["task"], row["length"])
    old = next((r for r in before["rows"] if (r["policy"], float(r["rate"]), r["task"], r["length"]) == key), None)
    entry = {"task": row["task"], "length": row["length"], "policy": row["policy"], "rate": float(row["rate"]),
             "metric": row["metric"], "n": row["n"]}
    for field in ("score", "pct_of_full", "kv_kept"):
        entry[f"before_{field}"] = None if old is None else old[field]
        entry[f"after_{field}"] = row[field]
    entry["score_difference"] = _difference(entry["before_score"], entry["after_score"])
    entry["identical_samples"] = entry["max_nll_difference"] = None
    if same_samples and old is not None:
        runs = find_run(before, *key[:2]), find_run(after, *key[:2])
        indices = row_samples(after["samples"], row["task"], row["length"])
        entry["identical_samples"] = sum(sample_output(runs[0], i) == sample_output(runs[1], i) for i in indices)
        entry["max_nll_difference"] = nll_difference(*runs, indices)
    return entry


def run_counters(results: dict) -> dict[str, dict]:
    """Per kvcompress run (``policy rN``): its compression counters and seconds."""
    return {f"{policy} r{float(rate):g}": {k: run.get(k) for k in ("seconds", *RUN_COUNTERS)}
            for policy, by_rate in results["runs"].items() if policy != "full"
            for rate, run in by_rate.items()}


def summarize(before: dict, after: dict) -> dict:
    """Both runs compared: same samples?, every row, rate 1 vs stock, the runs' counters."""
    same_samples = before["samples"] == after["samples"]
    rows = [compare_row(before, after, row, same_samples) for row in after["rows"]]
    cells = [r for r in rows if r["identical_samples"] is not None and r["task"] != "all"
             and not (r["task"] == "niah_multiturn" and r["length"] == "all")]
    return {
        "same_samples": same_samples,
        "rows": rows,
        "identical_samples": sum(r["identical_samples"] for r in cells) if same_samples else None,
        "compared_samples": sum(r["n"] for r in cells) if same_samples else None,
        "max_abs_score_difference": max((abs(r["score_difference"]) for r in rows
                                         if r["score_difference"] is not None), default=None),
        "rate1_identical": {"before": before.get("rate1_identical"), "after": after.get("rate1_identical")},
        "counters": {"before": run_counters(before), "after": run_counters(after)},
    }


def verdict(summary: dict) -> str:
    if not summary["same_samples"]:
        return "The two commits built different samples: outputs not compared sample by sample."
    same, total = summary["identical_samples"], summary["compared_samples"]
    return (f"Outputs identical sample by sample: {same} of {total} (task, length, policy, rate) samples "
            f"({'all' if same == total else 'NOT all'}); largest |score difference| "
            f"{fmt(summary['max_abs_score_difference'], '.4g')}.")


def _row_line(e: dict) -> str:
    spec = ".2f" if e["metric"] == "perplexity" else ".3f"
    same = "-" if e["identical_samples"] is None else f"{e['identical_samples']}/{e['n']}"
    return (f"| {e['task']} | {e['length']} | {e['policy']} | {e['rate']:g} | {fmt(e['before_score'], spec)} | "
            f"{fmt(e['after_score'], spec)} | {fmt(e['score_difference'], '+.3g')} | "
            f"{fmt(e['before_pct_of_full'], '.1f')} | {fmt(e['after_pct_of_full'], '.1f')} | {same} | "
            f"{fmt(e['max_nll_difference'], '.2g')} |")


def render_markdown(checkouts: list[Checkout], summary: dict, meta: dict) -> str:
    lines = [f"# Quality before / after ({meta['date']})", "",
             f"Host: {meta['machine']}. One run per commit (before first), eval_quality arguments "
             f"`{' '.join(meta['eval_args']) or '(defaults)'}`, seed {meta['seed']}.", ""]
    lines += [f"- {c['label']}: `{c['rev']}` = {c['commit']}" for c in (c.record() for c in checkouts)]
    rate1 = summary["rate1_identical"]
    lines += [f"- rate 1 token-identical to stock vLLM: before {rate1['before']}, after {rate1['after']}",
              "", verdict(summary), "",
              "Scores: string match (mean over samples), perplexity for `ppl`; identical = same text, same "
              "forced log-likelihoods and same fraction of KVs kept.", "",
              "| task | length | policy | rate | before | after | after - before | before % of full | "
              "after % of full | identical samples | max nll diff |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [_row_line(e) for e in summary["rows"]]
    lines += ["", "| run | " + " | ".join(f"{k} before / after" for k in RUN_COUNTERS) + " |",
              "| --- |" + " --- |" * len(RUN_COUNTERS)]
    for label, counts in summary["counters"]["after"].items():
        old = summary["counters"]["before"].get(label, {})
        lines.append(f"| {label} | " + " | ".join(f"{old.get(k)} / {counts[k]}" for k in RUN_COUNTERS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    own, eval_args = split_argv(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="commit to compare against")
    parser.add_argument("--after", default=".", help="commit compared with it ('.' = this working tree)")
    parser.add_argument("--seed", type=int, default=0, help="eval_quality's sample seed, the same for both")
    parser.add_argument("--out", required=True, help="output prefix for .json and .md")
    args = parser.parse_args(own)

    results: dict[str, dict] = {}
    with opened_checkouts(args.before, args.after) as (checkouts, scratch):
        for _, label in run_order(1):
            results[label] = run_eval(checkouts[0 if label == "before" else 1], eval_args, args.seed,
                                      scratch / f"{label}-quality")
    machine = results["after"]["machine"]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{machine['cpu']}, {machine['cores']} cores", "eval_args": eval_args, "seed": args.seed}
    summary = summarize(results["before"], results["after"])
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {**meta, "checkouts": [c.record() for c in checkouts], "summary": summary, "results": results}, indent=1))
    out.with_suffix(".md").write_text(render_markdown(checkouts, summary, meta))
    print(out.with_suffix(".md").read_text())
    return summary


if __name__ == "__main__":
    main()
