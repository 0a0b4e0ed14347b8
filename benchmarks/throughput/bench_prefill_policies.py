"""Prefill cost of each eviction policy against stock vLLM, both engines in ONE process.

A policy's scoring happens at the prefill: window policies score keys with the last
prompt queries inside attention, ``kvc-full`` / ``h2o`` with every prompt query, and
``kvzip`` runs a reconstruction pass (one more forward over the prompt, its attention
the PyTorch reference's). This times ``generate`` of ``--batch`` prompts of
``--input-len`` tokens for ONE output token (the prefill, and kvzip's pass, which runs
in the step that finishes the prompt) on stock vLLM, then on kvcompress under each
policy at ``--rate``, alternating per repetition (separate processes on a shared CPU
host differ by up to ~20% in plain matmul speed), and prints medians and each policy's
ratio to stock.

    python benchmarks/throughput/bench_prefill_policies.py --model smollm2 --policies kvc kvzip --reps 3
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.throughput import benchmark_throughput as bench  # noqa: E402  (sets VLLM_TARGET_DEVICE on CPU)
from benchmarks.throughput.side_scripts import side_script_parser, side_workload  # noqa: E402


def prefill_seconds(llm, prompts, extra) -> float:
    """Wall time of ``prompts`` to their first token."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, extra_args=extra)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def main(argv=None) -> int:
    from kvcompress.policies import POLICY_NAMES

    parser = side_script_parser(__doc__, model="smollm2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--policies", nargs="+", default=["kvc", "kvzip"], choices=POLICY_NAMES)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    with bench.engine_core_in_process():
        from vllm import LLM

        import kvcompress

        kv_tokens = max(8192, (args.input_len + 300) * args.batch)
        workload = side_workload(
            args.model, args.batch, args.input_len, 1, kv_tokens,
            max_num_batched_tokens=max(2048, args.input_len), disable_log_stats=True,
        )
        prompts = workload.prompts
        stock = LLM(model=workload.path, **workload.engine_args)
        kvc = kvcompress.LLM(workload.path, **workload.engine_args)
        runs = {"stock": (stock, None)}
        for policy in args.policies:
            runs[policy] = (kvc, {"kv_compress_rate": args.rate, "kv_compress_policy": policy})
        for llm, extra in runs.values():
            prefill_seconds(llm, prompts[:1], extra)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, (llm, extra) in runs.items():
                times[name].append(prefill_seconds(llm, prompts, extra))
        for llm in (stock, kvc):
            bench._shutdown(llm)

    print(f"{workload.description}; {args.batch} prompts x {args.input_len} tokens to their first token, "
          f"rate {args.rate:g}, {args.reps} repetitions alternating; {bench.machine_description()}")
    base = statistics.median(times["stock"])
    for name, seconds in times.items():
        ratios = [t / s for t, s in zip(seconds, times["stock"])]
        print(f"{name:>14}: {statistics.median(seconds):7.2f} s per batch, "
              f"{statistics.median(seconds) / args.batch:6.2f} s per prompt, "
              f"{statistics.median(seconds) / base:5.2f}x stock (per repetition {min(ratios):.2f}..{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
