"""RULER for a kvpress user: NVIDIA's kvpress 0.5.5 (KV-cache presses on Hugging Face
transformers) on the SAME RULER samples and scorer as ``ruler.py``, so its rows can sit in
one table with stock vLLM and kvcompress.

Generation runs in kvpress's own venv (``.venv-kvpress``, made on first use: the pinned
``KVPRESS_REQUIREMENTS``) by ``ruler_kvpress_worker.py``, float32 on the CPU, greedy, each
task's answer length from the package's task table; a "no press" run (the full cache
through transformers, same code path) is the reference for the % columns. Answers are
scored by the packaged RULER's scorer (``ruler_harness.score``), rows as ``ruler.summarize``
makes them.

Rates: kvcompress's rate r keeps 1/r of the KV pairs; kvpress's ``compression_ratio`` is the
fraction it removes, so ``compression_ratio = 1 - 1/rate`` (r8 = 0.875, r2 = 0.5); ``--ratios``
gives kvpress's numbers directly and the rows are labelled with the matching rate.

Context / question split (as kvpress's own RULER evaluation does it: the press compresses
the context only, question-agnostic, and the question is read against the compressed
cache): the question starts at the last occurrence of the task template's question opening
(``QUESTION_OPENINGS``: niah "What ...", vt / cwe / fwe "Question: ...", qa the repeated
"Answer the question based on the given documents." before "Question:"); everything after,
the answer prefix included, is the question. The prompt tokens are exactly those stock vLLM
read (see the worker's docstring); only where the cache is compressed differs.

``--split prompt`` is the other reading, kvcompress's in ``vllm serve``: the press compresses
the whole prompt, question and answer prefix included, all but its last token (which then
starts the answer, as the last prompt token does in vLLM), so a press that scores keys by
the prompt's last queries (SnapKV's observation window) sees the question as kvcompress's
policies do. Those rows are labelled ``+question``; the no-press reference is the same run.

    python benchmarks/quality/ruler_kvpress.py --length 1000 --tasks niah_single_2,vt --samples 4 \\
        --presses snapkv knorm --rates 8 --vllm-results benchmarks/results/ruler-smollm2-1k-cpu-quick.json

Writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))

from benchmarks.quality.ruler import (  # noqa: E402
    add_sample_arguments,
    check_tasks,
    git_commit,
    kept_summary,
    length_tag,
    model_dir,
    summarize,
    summary_line,
    table_lines,
)
from benchmarks.quality.ruler_harness import (  # noqa: E402
    SampleSet,
    _run_checked,
    prepare_samples,
    read_jsonl,
    reset_dir,
    ruler_env,
    score,
    tokens_to_generate,
    write_predictions,
)
from benchmarks.quality.ruler_kvpress_worker import PRESS_CLASSES  # noqa: E402

# torch pinned to the CPU build pip finds on this machine's disk: unpinned, the resolver
# picks torch 2.14.1's CUDA build (and ~3 GB of nvidia-* wheels); transformers pinned to
# what kvpress 0.5.5 resolved to (it allows >=4.56,<5.3).
KVPRESS_REQUIREMENTS = ("torch==2.13.0", "kvpress==0.5.5", "transformers==5.2.0")
WORKER = Path(__file__).with_name("ruler_kvpress_worker.py")
REFERENCE = "no press"

# Where each task family's question begins (the last occurrence), from the packaged
# RULER's templates (long_context_eval/data/synthetic/constants.py); the newlines before
# it stay with the context.
QUESTION_OPENINGS = {
    "niah": "\nWhat ",
    "vt": "\nQuestion: ",
    "cwe": "\nQuestion: ",
    "fwe": "\nQuestion: ",
    "qa": "\n\nAnswer the question based on the given documents.",
}


def rate_to_ratio(rate: float) -> float:
    """kvpress's compression_ratio (fraction removed) for kvcompress's rate (1/r kept)."""
    return 1.0 - 1.0 / rate


def ratio_to_rate(ratio: float) -> float:
    return 1.0 / (1.0 - ratio)


def task_family(task: str) -> str:
    return "niah" if task.startswith("niah") else task.split("_")[0]


SPLITS = ("context", "prompt")


def last_token_start(tokenizer, text: str) -> int:
    """Character offset where ``text``'s last prompt token begins (``--split prompt``: the
    worker then cuts every token before it into the pressed part)."""
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    return offsets[-1][0]


def question_start(task: str, text: str) -> int:
    """Character offset in a RULER input where its question begins (after the newlines
    that end the context)."""
    opening = QUESTION_OPENINGS[task_family(task)]
    found = text.rfind(opening)
    if found < 0:
        raise ValueError(f"{task}: no {opening!r} in the input, cannot split context and question")
    return found + len(opening) - len(opening.lstrip("\n"))


# --------------------------------------------------------------------------------------
# The kvpress venv and its worker


def kvpress_env(venv: Path, log=print) -> Path:
    """The kvpress venv's Python (the venv created with the pinned packages if missing)."""
    python = venv / "bin" / "python"
    usable = python.exists() and subprocess.run([str(python), "-c", "import kvpress"], capture_output=True).returncode == 0
    if not usable:
        log(f"kvpress: creating {venv} ({', '.join(KVPRESS_REQUIREMENTS)}; a few minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _run_checked([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      *KVPRESS_REQUIREMENTS], "pip install into the kvpress venv")
    return python


@dataclass(frozen=True)
class PressConfig:
    """One run: kvpress's ``press`` at ``compression_ratio`` (``press`` None: no press)."""

    press: str | None = None
    compression_ratio: float = 0.0
    split: str = "context"  # SPLITS; the no-press run reads the prompt the same either way

    @property
    def rate(self) -> float | None:
        return None if self.press is None else ratio_to_rate(self.compression_ratio)

    @property
    def label(self) -> str:
        if self.press is None:
            return REFERENCE
        return f"kvpress {self.press} r{self.rate:.3g}" + (" +question" if self.split == "prompt" else "")


def job_items(data_dir: Path, tasks: list[str], samples: int, answer_tokens: dict[str, int],
              split: str = "context", tokenizer=None) -> list[dict]:
    """The worker's items: every task's first ``samples`` samples with their split
    (``split`` "prompt" needs the model's ``tokenizer``)."""
    items = []
    for task in tasks:
        for sample in read_jsonl(data_dir / task / "validation.jsonl")[:samples]:
            text = sample["input"]
            cut = question_start(task, text) if split == "context" else last_token_start(tokenizer, text)
            items.append({"task": task, "index": sample["index"], "input": text, "question_start": cut,
                          "max_new_tokens": answer_tokens[task]})
    return items


def worker_environ(threads: int | None) -> dict[str, str]:
    """The worker's environment: quiet, offline, ``threads`` torch threads (None: torch's default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if threads:  # on a shared, busy CPU one thread beats two that wait on each other
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def generate(python: Path, job: dict, pred_dir: Path, progress, threads: int | None = None) -> dict[tuple[str, int], dict]:
    """Run the worker over ``job`` (resuming ``pred_dir/answers.jsonl``); (task, index) ->
    the worker's line (answer, context_tokens, kept_tokens)."""
    job_path, answers = pred_dir / "job.json", pred_dir / "answers.jsonl"
    job_path.write_text(json.dumps(job))
    seen = len(read_jsonl(answers)) if answers.exists() else 0
    progress(seen)
    with open(pred_dir / "worker.log", "ab") as log:
        worker = subprocess.Popen([str(python), str(WORKER), str(job_path), str(answers)],
                                  stdout=log, stderr=subprocess.STDOUT, env=worker_environ(threads))
        while worker.poll() is None:
            time.sleep(2.0)
            now = len(read_jsonl(answers)) if answers.exists() else 0
            progress(now - seen)
            seen = now
    if worker.returncode != 0:
        raise RuntimeError(f"kvpress worker failed (exit {worker.returncode}); see {pred_dir / 'worker.log'}")
    progress(len(read_jsonl(answers)) - seen)
    return {(line["task"], line["index"]): line for line in read_jsonl(answers)}


def run_configuration(config: PressConfig, python: Path, ruler, data_dir: Path, items: list[dict],
                      args, stamp: dict, bar) -> dict[str, Any]:
    """Answer every item under ``config``, write the package's prediction files, score."""
    pred_dir = Path(args.work) / config.label.replace(" ", "-").replace("+", "")
    reset_dir(pred_dir, {**stamp, "config": config.label})  # the label names the split
    started = time.monotonic()
    job = {"model_dir": str(args.checkpoint), "press": config.press,
           "compression_ratio": config.compression_ratio, "items": items}
    answers = generate(python, job, pred_dir, bar.update, args.threads)
    for task in args.tasks:
        samples = read_jsonl(data_dir / task / "validation.jsonl")[: args.samples]
        write_predictions(pred_dir, task, samples, [answers[(task, s["index"])]["answer"] for s in samples])
    return {"policy": config.press, "rate": config.rate, "compression_ratio": config.compression_ratio,
            "wall_s": round(time.monotonic() - started, 1), "pred_dir": str(pred_dir),
            "kept_fraction": kept_fraction(list(answers.values())),
            "scores": score(ruler, pred_dir, args.tasks)}


def kept_fraction(lines: list[dict]) -> float | None:
    """The context KV pairs left after the press over all samples (the worker's counts)."""
    counted = [line for line in lines if "kept_tokens" in line]
    total = sum(line["context_tokens"] for line in counted)
    return sum(line["kept_tokens"] for line in counted) / total if total else None


# --------------------------------------------------------------------------------------
# Sanity check against stock vLLM


def stock_predictions(path: Path) -> Path:
    """Stock vLLM's prediction folder: ``path`` itself, or for a ruler.py result JSON the
    folder its stock run recorded (``pred_dir``), else (JSONs written before runs recorded
    it) the ``stock`` folder of ruler.py's default ``--work`` for it."""
    if path.is_dir():
        return path
    recorded = json.loads(path.read_text()).get("runs", {}).get("stock", {}).get("pred_dir")
    if recorded:
        return Path(recorded)
    from benchmarks.common.offline_assets import cache_dir

    return cache_dir() / "ruler-runs" / path.stem / "stock"


def answer_agreement(ours: Path, theirs: Path, tasks: list[str]) -> dict[str, Any]:
    """Per task, how many of the samples both folders answered (same index, same input)
    got the same answer (whitespace at the ends ignored)."""
    per_task = {}
    for task in tasks:
        mine = {line["index"]: line for line in read_jsonl(ours / f"{task}.jsonl")}
        other = read_jsonl(theirs / f"{task}.jsonl") if (theirs / f"{task}.jsonl").exists() else []
        pairs = [(mine[o["index"]]["pred"], o["pred"]) for o in other
                 if o["index"] in mine and mine[o["index"]]["input"] == o["input"]]
        per_task[task] = {"compared": len(pairs), "identical": sum(a.strip() == b.strip() for a, b in pairs)}
    compared = sum(t["compared"] for t in per_task.values())
    identical = sum(t["identical"] for t in per_task.values())
    return {"stock_predictions": str(theirs), "per_task": per_task, "compared": compared,
            "identical_fraction": identical / compared if compared else None}


def agreement_line(agreement: dict) -> str:
    if not agreement["compared"]:
        return f"no-press vs stock vLLM: no common samples in {agreement['stock_predictions']}"
    tasks = ", ".join(f"{t} {c['identical']}/{c['compared']}" for t, c in agreement["per_task"].items())
    return (f"no-press (transformers) answers identical to stock vLLM's: "
            f"{100 * agreement['identical_fraction']:.0f}% of {agreement['compared']} ({tasks})")


# --------------------------------------------------------------------------------------
# Report


def write_report(results: dict, prefix: str) -> list[str]:
    rows, tasks, setup = results["rows"], results["tasks"], results["setup"]
    mapping = ", ".join(f"r{ratio_to_rate(r):.3g} = {r:g}" for r in setup["compression_ratios"])
    text = [
        f"# RULER {setup['length']} (NVIDIA's packaged RULER) — kvpress on transformers — {setup['model']}", "",
        f"- {setup['samples']} samples per task (sample set {setup['sample_set']}, haystack "
        f"{setup.get('haystack', 'essays')}, the same files as "
        f"`ruler.py`), greedy, float32 on the CPU, the package's answer lengths and scorer; {len(tasks)} tasks",
        f"- kvpress venv: {', '.join(setup['kvpress_requirements'])}; commit {setup['commit']}",
        (f"- press compresses the context only (kvpress's RULER split); the question and answer prefix are read after"
         if setup.get("split", "context") == "context" else
         "- rows marked +question: the press compresses the whole prompt but its last token, question and answer "
         "prefix included (as kvcompress in `vllm serve`); the no-press run reads the same tokens")
        + f"; prompt tokens as `vllm serve` tokenizes them. compression_ratio = 1 - 1/rate ({mapping})",
        f"- reference for %: {REFERENCE} (full cache, same transformers path"
        + (f"; its scores from `{Path(setup['reference_from']).name}`, same samples and venv" if setup.get("reference_from") else "")
        + "); kvpress prunes or masks KVs, it frees no memory",
        "- context KV pairs left after the press (measured, mean over layers and KV heads, masked ones removed; "
        "files before 2026-12-03 counted the first layer's cache length, so masking presses such as KVzip read 100%): " + (kept_summary(results["runs"]) or "not recorded"),
        f"- machine: {results['machine']['cpu']}, {results['machine']['cores']} cores",
        "- (lo-hi): 95% percentile-bootstrap interval over samples (paired with the reference for %)", "",
        "## Score (0-100)", "", *table_lines(rows, tasks, pct=False), "",
        f"## % of {REFERENCE}", "", *table_lines(rows, tasks, pct=True), "",
    ]  # fmt: skip
    if results.get("vllm_agreement"):
        text += ["## Sanity check", "", agreement_line(results["vllm_agreement"]), ""]
    Path(f"{prefix}.md").write_text("\n".join(text))
    Path(f"{prefix}.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return [f"{prefix}.md", f"{prefix}.json"]


# --------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/quality/ruler_kvpress.py", description=__doc__.split("\n\n")[0])
    add_sample_arguments(parser)
    parser.add_argument("--presses", nargs="+", default=["snapkv"], help=f"kvpress presses: {', '.join(PRESS_CLASSES)}")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--rates", nargs="+", type=float, default=None, help="kvcompress rates (default 8)")
    amount.add_argument("--ratios", nargs="+", type=float, default=None, help="kvpress compression_ratio values")
    parser.add_argument("--vllm-results", default=None,
                        help="ruler.py result JSON (or stock prediction folder): report identical no-press answers")
    parser.add_argument("--split", choices=SPLITS, default="context",
                        help="what the press compresses: the context before the question (kvpress's RULER "
                             "split), or the whole prompt but its last token (as kvcompress in vllm serve; "
                             "rows labelled +question)")
    parser.add_argument("--reference-from", default=None,
                        help="an earlier ruler_kvpress.py JSON of the same model, samples and kvpress venv: its "
                             "no-press scores are the reference and the no-press run is skipped (each press run "
                             "then costs half)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in the worker (default: torch's)")
    parser.add_argument("--kvpress-venv", default=str(REPO_ROOT / ".venv-kvpress"))
    parser.add_argument("--ruler-venv", default=str(REPO_ROOT / ".venv-ruler"))
    parser.add_argument("--work", default=None, help="prediction folders (default: <cache>/ruler-kvpress-runs/<out name>)")
    parser.add_argument("--out", default=None, help="output prefix (default benchmarks/results/ruler-kvpress-<model>-<length>-cpu)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    held_out = "" if args.haystack == "essays" else f"-{args.haystack}-set{args.sample_set}"
    args.out = args.out or f"benchmarks/results/ruler-kvpress-{args.model}-{length_tag(args.length)}{held_out}-cpu"
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate in place: tasks, presses, and rates / ratios into ``args.compression_ratios``."""
    check_tasks(parser, args)
    unknown = sorted(set(args.presses) - set(PRESS_CLASSES))
    if unknown:
        parser.error(f"--presses: unknown {unknown}; choose from {', '.join(PRESS_CLASSES)}")
    if args.ratios is not None:
        if any(not 0 < r < 1 for r in args.ratios):
            parser.error("--ratios: every compression_ratio must be in (0, 1)")
        args.compression_ratios = list(args.ratios)
    else:
        rates = args.rates or [8.0]
        if any(rate <= 1 for rate in rates):
            parser.error("--rates: every rate must be > 1 (rate 1 is the no-press row, always run)")
        args.compression_ratios = [rate_to_ratio(rate) for rate in rates]
    if args.samples < 1:
        parser.error("--samples: must be >= 1")
    if args.reference_from and args.vllm_results:
        parser.error("--vllm-results compares the no-press answers of this run: not with --reference-from")


def configurations(args) -> list[PressConfig]:
    presses = [PressConfig(p, r, args.split) for p in args.presses for r in args.compression_ratios]
    return presses if args.reference_from else [PressConfig()] + presses


REFERENCE_MUST_MATCH = ("model", "length", "sample_set", "haystack", "kvpress_requirements")
"""What the no-press answers depend on (the split does not: no press reads the whole prompt)."""


def reference_run(path: Path, setup: dict, tasks: list[str], samples: int) -> dict[str, Any]:
    """The no-press run of an earlier result JSON, its scores cut to ``tasks`` and the
    first ``samples`` samples (sample files list them in index order); refused, naming
    the difference, unless it answered the same samples with the same kvpress venv."""
    earlier = json.loads(path.read_text())
    theirs = earlier["setup"]
    for key in REFERENCE_MUST_MATCH + ("worker",) * ("worker" in theirs):  # recorded since 2026-12-02
        if theirs.get(key, "essays" if key == "haystack" else None) != setup[key]:
            raise SystemExit(f"--reference-from {path}: {key} {theirs.get(key)!r}, this run {setup[key]!r}")
    if theirs["samples"] < samples:
        raise SystemExit(f"--reference-from {path}: {theirs['samples']} samples a task, this run needs {samples}")
    missing = sorted(set(tasks) - set(earlier["tasks"]))
    if missing:
        raise SystemExit(f"--reference-from {path}: no no-press scores for {missing}")
    run = earlier["runs"][REFERENCE]
    scores = {}
    for task in tasks:
        by_index = {int(index): value for index, value in run["scores"][task].items()}
        scores[task] = {index: by_index[index] for index in sorted(by_index)[:samples]}
    return {**run, "scores": scores, "wall_s": 0.0, "from": str(path)}


def main(argv: list[str] | None = None) -> dict:
    from tqdm import tqdm

    from benchmarks.common.offline_assets import cache_dir
    from benchmarks.quality.eval_quality import machine_info

    args = parse_args(argv)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    args.work = args.work or str(cache_dir() / "ruler-kvpress-runs" / Path(args.out).name)
    args.checkpoint, description = model_dir(args.model)
    worker_hash = hashlib.sha256(WORKER.read_bytes()).hexdigest()[:16]
    runs = {}
    if args.reference_from:  # checked before the venvs and samples are made
        runs[REFERENCE] = reference_run(Path(args.reference_from), {
            "model": description, "length": args.length, "sample_set": args.sample_set, "haystack": args.haystack,
            "kvpress_requirements": list(KVPRESS_REQUIREMENTS), "worker": worker_hash}, args.tasks, args.samples)
    ruler = ruler_env(Path(args.ruler_venv), log=log)
    python = kvpress_env(Path(args.kvpress_venv), log=log)
    spec = SampleSet(args.checkpoint, args.length, args.samples, args.sample_set, args.haystack)
    data_dir = prepare_samples(ruler, spec, args.tasks, log=log)
    answer_tokens = tokens_to_generate(ruler, args.tasks)
    items = {"context": job_items(data_dir, args.tasks, args.samples, answer_tokens)}
    if args.split == "prompt":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        items["prompt"] = job_items(data_dir, args.tasks, args.samples, answer_tokens, "prompt", tokenizer)
    # What the answers depend on: not the commit (nothing of kvcompress runs), only the
    # samples, the kvpress venv, the worker and the split; a changed one starts afresh.
    stamp = {"samples": spec.key, "requirements": list(KVPRESS_REQUIREMENTS), "openings": QUESTION_OPENINGS,
             "worker": worker_hash}
    configs = configurations(args)
    with tqdm(total=len(configs) * len(items["context"]), desc="RULER kvpress", unit="sample", file=sys.stderr) as bar:
        for config in configs:
            runs[config.label] = run_configuration(config, python, ruler, data_dir, items[config.split], args, stamp, bar)
    results = {
        "setup": {"model": description, "length": args.length, "samples": args.samples, "sample_set": args.sample_set, "haystack": args.haystack,
                  "commit": git_commit(), "presses": args.presses, "split": args.split, "compression_ratios": args.compression_ratios,
                  "kvpress_requirements": list(KVPRESS_REQUIREMENTS), "question_openings": QUESTION_OPENINGS,
                  "reference_from": args.reference_from, "worker": stamp["worker"]},
        "machine": machine_info(), "tasks": args.tasks, "runs": runs,
        "rows": summarize(runs, args.tasks, reference=REFERENCE),
    }  # fmt: skip
    if args.vllm_results:
        results["vllm_agreement"] = answer_agreement(Path(runs[REFERENCE]["pred_dir"]),
                                                     stock_predictions(Path(args.vllm_results)), args.tasks)
        print(agreement_line(results["vllm_agreement"]))
    for path in write_report(results, args.out):
        print(f"wrote {path}", file=sys.stderr)
    print("\n".join(table_lines(results["rows"], args.tasks, pct=True)))
    print(summary_line(results))
    return results


if __name__ == "__main__":
    main()
