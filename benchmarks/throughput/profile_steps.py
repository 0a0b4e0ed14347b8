"""Where an engine step's time goes: stock vLLM and kvcompress under Python's profiler, on
the same batch (the per-step breakdown of benchmarks/throughput/benchmark_throughput.py's runs).

One in-process engine per run (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) serves ``--num-prompts``
prompts of ``--input-len`` tokens generating ``--output-len`` each under a fixed KV
memory; the whole run is profiled (cProfile) and the time is attributed to:

- ``attention kernel``: vLLM's attention ops (``cpu_attention_with_kv_cache``; on CUDA the
  Triton / extension launches are not visible to cProfile, use a GPU profiler);
- ``metric pass``: kvcompress's eviction metrics (``kvcompress/ops/metrics.py``: prompt
  scores, pooling, the decode metric pass);
- ``compression``: the worker's compression (schedule + MoveCache, ``_kvc_compress``);
- ``kvcompress step planning``: the runner's per-step plan (``_kvc_plan_step``: page
  allocation, write slots, the kernel's decode tables) and KV writes (``write_kv``);
- ``kvcompress scheduler``: the scheduler's page accounting and compression planning
  (kvcompress's ``schedule`` / ``update_from_output`` minus vLLM's own);
- ``GEMMs``: vLLM's oneDNN matmuls (``onednn_mm``), the model's linear layers;
- ``engine step``: everything ``LLMEngine.step`` does.

NOTE

    python benchmarks/throughput/profile_steps.py --input-len 2048 --output-len 256 --num-prompts 16 \\
        --kv-tokens 6144 --rates 1 8
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.throughput import benchmark_throughput as bench  # noqa: E402  (sets VLLM_TARGET_DEVICE on CPU)
from benchmarks.throughput.side_scripts import side_script_parser, side_workload  # noqa: E402

NOTE = (
    "Shares are of the engine-step time (cumulative times, so rows overlap: the metric pass "
    "runs inside attention, compression inside step planning's caller, etc.). The profiler "
    "slows Python more than C++, so the Python-side rows read high; compare engines within "
    "one run only."
)
__doc__ = __doc__.replace("NOTE", NOTE)

# (row, [(file suffix, function name)], subtract) — cumulative times of the matching
# functions, summed; "subtract" rows remove the inner vLLM call from kvcompress's override.
CATEGORIES = [
    ("attention kernel", [("~", "<built-in method torch._ops._C.cpu_attention_with_kv_cache>")], []),
    ("metric pass", [("kvcompress/ops/metrics.py", "decode_metrics"),
                     ("kvcompress/ops/metrics.py", "attention_metrics"),
                     ("kvcompress/ops/metrics.py", "accumulate_metrics"),
                     ("kvcompress/ops/metrics.py", "pool_metrics")], []),
    ("compression", [("kvcompress/vllm_glue/runner.py", "_kvc_compress")], []),
    ("kvcompress step planning", [("kvcompress/vllm_glue/runner.py", "_kvc_plan_step"),
                                  ("kvcompress/ops/reference_attention.py", "write_kv")], []),
    ("kvcompress scheduler", [("kvcompress/vllm_glue/scheduler.py", "schedule"),
                              ("kvcompress/vllm_glue/scheduler.py", "update_from_output")],
     [("vllm/v1/core/sched/scheduler.py", "schedule"),
      ("vllm/v1/core/sched/scheduler.py", "update_from_output")]),
    ("GEMMs", [("~", "<built-in method torch._ops._C.onednn_mm>")], []),
    ("engine step", [("vllm/v1/engine/llm_engine.py", "step")], []),
]  # fmt: skip


def _cumulative(stats: pstats.Stats, wanted) -> float:
    total = 0.0
    for (filename, _, name), (_, _, _, cumtime, _) in stats.stats.items():
        for suffix, function in wanted:
            if name == function and (filename == suffix or filename.endswith(suffix)):
                total += cumtime
    return total


def breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per category (see the module docstring)."""
    return {
        row: max(0.0, _cumulative(stats, wanted) - _cumulative(stats, minus))
        for row, wanted, minus in CATEGORIES
    }


def profile_run(llm, prompts, params, label: str, stats_dir: str | None = None) -> dict:
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    run = bench.run_batch(llm, prompts, [params() for _ in prompts], label, progress=False)
    profiler.disable()
    wall = time.perf_counter() - started
    seconds = breakdown(pstats.Stats(profiler))
    if stats_dir:  # raw profile, for `python -m pstats` or a diff of two runs
        Path(stats_dir).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(Path(stats_dir) / (label.replace(" ", "-") + ".prof")))
    step = seconds["engine step"] or wall
    return {
        "label": label, "wall_seconds": wall, "seconds": seconds,
        "share_of_step": {k: v / step for k, v in seconds.items()},
        "output_tokens_per_s": run["output_tokens_per_s"], "max_decode_batch": run["max_decode_batch"],
    }


def main(argv=None) -> list[dict]:
    parser = side_script_parser(__doc__, model="tiny")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=6144)
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 8])
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--out", default=None, help="write <OUT>.json and <OUT>.md")
    parser.add_argument("--stats-dir", default=None, help="also save each run's cProfile stats here")
    args = parser.parse_args(argv)

    bench._setup_env()
    with bench.engine_core_in_process():
        return _profile(args)


def _profile(args) -> list[dict]:
    from vllm import LLM, SamplingParams

    import kvcompress

    workload = side_workload(args.model, args.num_prompts, args.input_len, args.output_len, args.kv_tokens)
    prompts, engine_args = workload.prompts, workload.engine_args

    def params(extra=None):
        return lambda: SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                      detokenize=False, extra_args=extra)

    results = []
    stock = LLM(model=workload.path, **engine_args)
    bench._warmup(stock, params()())
    results.append(profile_run(stock, prompts, params(), "stock vLLM", args.stats_dir))
    bench._shutdown(stock)
    kvc = kvcompress.LLM(workload.path, kv_compress_protected_window=8, kv_compress_block_size=args.block_size, **engine_args)
    bench._warmup(kvc, params({"kv_compress_rate": 1})())
    for rate in args.rates:
        results.append(profile_run(kvc, prompts, params({"kv_compress_rate": rate}), f"kvcompress rate {rate:g}",
                                   args.stats_dir))
    bench._shutdown(kvc)

    header = "| run | out tok/s (profiled) | max batch | " + " | ".join(row for row, _, _ in CATEGORIES) + " |"
    lines = [header, "|" + "---|" * (len(CATEGORIES) + 3)]
    for r in results:
        cells = [f"{100 * r['share_of_step'][row]:.1f}% ({r['seconds'][row]:.1f} s)" for row, _, _ in CATEGORIES[:-1]]
        cells.append(f"{r['seconds']['engine step']:.1f} s")
        lines.append(f"| {r['label']} | {r['output_tokens_per_s']:.1f} | {r['max_decode_batch']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    title = (f"{workload.description}; {args.num_prompts} prompts x {args.input_len} tokens, output {args.output_len}, "
             f"KV {args.kv_tokens} tokens; {bench.machine_description()}")
    print(title)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"title": title, "runs": results}, indent=2) + "\n")
        out.with_suffix(".md").write_text(f"# Step time breakdown (cProfile)\n\n{title}\n\n{table}\n\n{NOTE}\n")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
