"""Which kvc settings keep needles AND perplexity: one stock run, then one kvcompress
engine per candidate setting, the same samples for all (issue 18: kvc's defaults).

Samples are eval_quality's (RULER-style needles at 2K tokens, ``--limit`` per task, and
4 Shakespeare perplexity windows of 2048 + 256 teacher-forced tokens with continual
compression every 64 steps). Each candidate is a JSON object of kvcompress settings
(``observation_window``, ``pool_kernel``, ``pool_words``, ``metric``, ... ; ``policy``
picks the request's policy); its needle score is the sum over the needle tasks as % of
the full cache's, perplexity as ``100 x ppl_full / ppl``. The stock answers are cached
in ``--cache-dir`` by (tasks, lengths, limit), so later searches reuse them.

    python benchmarks/quality/search_kvc_defaults.py --rates 8 32 --limit 8 \\
        --candidates '{"paper": {"policy": "kvc-paper"}, "w32": {"observation_window": 32}}' \\
        --out benchmarks/results/quality-kvc-defaults-search-smollm2-cpu.json

Small samples (8 per task): a screen to pick candidates, not a ranking; the chosen
setting is then measured with 20 samples per cell and intervals by eval_quality.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.quality import eval_quality as eq  # noqa: E402

NEEDLES = ("niah_single", "niah_multikey", "niah_multivalue")


def _summary(samples: list[dict], run: dict, tasks: list[str]) -> dict:
    """Mean score per task, perplexity, KVs kept."""
    out = {}
    for task in tasks:
        scores = [eq.score(s["answers"], t) for s, t in zip(samples, run["texts"]) if s["task"] == task]
        out[task] = sum(scores) / len(scores)
    nll = [x for s, n in zip(samples, run["nll"]) if s["task"] == "ppl" for x in n]
    out["ppl"] = math.exp(sum(nll) / len(nll))
    kept = [k for k in run.get("kv_kept") or [] if k is not None]
    if kept:
        out["kept"] = sum(kept) / len(kept)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", required=True, help="JSON: name -> kvcompress settings")
    parser.add_argument("--tasks", nargs="+", default=list(NEEDLES), choices=[t for t in eq.TASKS if t != "ppl"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--rates", type=float, nargs="+", default=[8.0])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--ppl-samples", type=int, default=4)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvcompress" / "kvc-search"))
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    candidates = json.loads(args.candidates)

    from transformers import AutoTokenizer
    from vllm import LLM

    import kvcompress
    from kvcompress.vllm_glue.llm import shutdown
    from benchmarks.common.offline_assets import paul_graham_essays

    path, model_name = eq._model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    samples = eq.build_samples(tokenizer, paul_graham_essays(), args.tasks, args.lengths, args.limit)
    samples += eq.build_ppl_samples(tokenizer, args.ppl_samples, 2048, 256)
    samples.sort(key=lambda s: s["task"] != "ppl")
    longest = max(s["prompt_tokens"] + s["max_tokens"] for s in samples)
    engine_args = {**eq.ENGINE_ARGS, "max_model_len": longest + 16, "logits_processors": [eq.TEACHER_FQCN]}

    cache = Path(args.cache_dir) / (
        f"full-{args.limit}-{'_'.join(map(str, args.lengths))}-{'_'.join(args.tasks)}-ppl{args.ppl_samples}.json"
    )
    if cache.exists():
        full = json.loads(cache.read_text())
    else:
        stock = LLM(model=path, **engine_args)
        try:
            run = eq._generate(stock, samples, None, kvc=False)
        finally:
            shutdown(stock)
        full = {"texts": run["texts"], "nll": run["nll"]}
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(full))
    reference = _summary(samples, full, args.tasks)
    print("full", json.dumps(reference), flush=True)
    results = {"model": model_name, "machine": eq.machine_info(), "argv": argv or sys.argv[1:],
               "full": reference, "candidates": candidates, "runs": {}}
    needles = [t for t in args.tasks if t in NEEDLES]
    for name, settings in candidates.items():
        started = time.perf_counter()
        policy = settings.get("policy")
        flags = {f"kv_compress_{k}": v for k, v in settings.items() if k != "policy"}
        llm = kvcompress.LLM(path, kv_compress=True, kv_compress_interval=64, **flags, **engine_args)
        try:
            for rate in args.rates:
                summary = _summary(samples, eq._generate(llm, samples, rate, kvc=True, policy=policy), args.tasks)
                found = sum(summary[t] for t in needles)
                summary["needles_pct"] = 100 * found / max(1e-9, sum(reference[t] for t in needles))
                summary["ppl_pct"] = 100 * reference["ppl"] / summary["ppl"]
                if eq.MULTITURN in args.tasks and reference[eq.MULTITURN]:
                    summary["multiturn_pct"] = 100 * summary[eq.MULTITURN] / reference[eq.MULTITURN]
                results["runs"][f"{name} r{rate:g}"] = summary
                print(name, f"r{rate:g}", json.dumps(summary), f"{time.perf_counter() - started:.0f} s", flush=True)
        finally:
            shutdown(llm)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
