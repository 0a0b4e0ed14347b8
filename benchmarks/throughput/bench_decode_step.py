"""Decode-step time of kvcompress at rate 1 against stock vLLM, both engines in ONE process.

Issue 14's kernel-parity target: a decode step of kvcompress (nothing evicted) within
1.1x stock vLLM's. Separate processes on a shared CPU host differ by up to ~20% in plain
matmul speed from run to run, so both engines live in this process (in-process engine
cores) and their runs alternate: each repetition times ``generate`` of ``--batch``
prompts of ``--input-len`` tokens for 1 and for ``--output-len`` tokens on stock, then
on kvcompress; the difference over ``output-len - 1`` is the time per decode step.

    python benchmarks/throughput/bench_decode_step.py --model tiny --batch 1
    python benchmarks/throughput/bench_decode_step.py --model smollm2 --batch 1 --reps 5
    # host bookkeeping at many sequences (issue 15 item 7): short contexts, 256 rows
    python benchmarks/throughput/bench_decode_step.py --model tiny --batch 256 --input-len 32 --output-len 65 \\
        --reps 3 --host-breakdown

``--shared-prefix N`` gives every prompt the same first N tokens and turns prefix caching
on in both engines (block size ``--block-size`` for both, 64 by default then): after the
first ``generate`` each prompt's full blocks are hits, so the decode steps read their
prefix through the prefix cache's pages (issue 61: prefix caching's rate-1 row). kvcompress
keeps the prefix uncompressed (``kv_compress_shared_prefix_tokens`` = N), and
``--engine-rate R`` starts its engine at rate R while the requests ask for ``--rate`` (as
``bench_prefix_caching.py``'s rate-1 row does, on an engine started at its highest rate).

    python benchmarks/throughput/bench_decode_step.py --model smollm2 --batch 4 --input-len 2000 \\
        --shared-prefix 1500 --output-len 65 --reps 5 --host-breakdown

``--prompt-only`` times the prompt steps instead (each repetition one ``generate`` of one
output token on each engine: the prefill of ``--batch`` prompts, ms a prompt); with
``--op-profile`` the torch ops of one such generate per engine (issue 61's SmolLM2
prefill-only regime); ``--max-num-batched-tokens`` below ``--input-len`` prefills each prompt
in chunks, the later ones reading the earlier ones' KVs from the cache (the 4096-token regimes):

    python benchmarks/throughput/bench_decode_step.py --model smollm2 --batch 2 --input-len 2048 \\
        --prompt-only --reps 5 --op-profile 12
    python benchmarks/throughput/bench_decode_step.py --model smollm2 --batch 1 --input-len 4096 \\
        --max-num-batched-tokens 2048 --prompt-only --reps 5 --op-profile 12

``--host-breakdown`` then runs each engine once more per repetition with wall-clock timers
(no profiler) around the scheduler's ``schedule`` + ``update_from_output``, the worker's
``_update_states`` (kvcompress: its override, which holds the step's page appends, the
decode plan for vLLM's kernel and the report) and vLLM's ``_build_attention_metadata``
(stock: the CPU attention backend's per-step metadata, the kernel's work split among it;
kvcompress: an empty builder, its kernel plan being in ``_update_states``), and prints
their time per decode step on each engine and kvcompress's extra over stock: its
bookkeeping per step, with and without the attention metadata. A last pass times
kvcompress's own code exclusive of the vLLM calls it wraps (``own_code_ms``): the extra
over stock also holds vLLM's own code running at another speed inside the kvcompress
engine.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.throughput import benchmark_throughput as bench  # noqa: E402  (sets VLLM_TARGET_DEVICE on CPU)
from benchmarks.throughput.side_scripts import side_script_parser, side_workload  # noqa: E402


def token_params(tokens: int, extra):
    """Greedy, exactly ``tokens`` output tokens, no detokenizing."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False,
                          extra_args=extra)


def decode_ms_per_step(llm, prompts, output_len: int, extra) -> float:
    """Time per decode step: generate(output_len) minus generate(1) (the prefill)."""
    started = time.perf_counter()
    llm.generate(prompts, token_params(1, extra), use_tqdm=False)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate(prompts, token_params(output_len, extra), use_tqdm=False)
    total = time.perf_counter() - started
    return (total - prefill) / (output_len - 1) * 1e3


class HookTimers:
    """Wall-clock seconds spent in wrapped callables, by key (exclusive of nothing: a
    caller's key includes its callees'; the breakdown subtracts the inner vLLM calls)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list = []

    def wrap(self, owner, name: str, key: str) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        seconds = self.seconds

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - started

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def host_breakdown(engines: dict, prompts, output_len: int) -> dict[str, float]:
    """Host time per decode step (ms) of the scheduler (``schedule`` +
    ``update_from_output``) and of the worker's step bookkeeping (``_update_states``,
    plus kvcompress's report) on each engine, and kvcompress's extra: its top-level
    calls timed against stock's same calls (no per-request wrappers, so no timer
    overhead inside), from one generate of ``output_len`` tokens minus one of 1."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcompress.vllm_glue.runner import KVCompressRunnerMixin
    from kvcompress.vllm_glue.scheduler import KVCompressScheduler

    timers = HookTimers()
    timers.wrap(KVCompressScheduler, "schedule", "kvc scheduler")
    timers.wrap(KVCompressScheduler, "update_from_output", "kvc scheduler")
    timers.wrap(Scheduler, "schedule", "vllm scheduler")
    timers.wrap(Scheduler, "update_from_output", "vllm scheduler")
    timers.wrap(KVCompressRunnerMixin, "_update_states", "kvc worker")
    timers.wrap(KVCompressRunnerMixin, "_kvc_attach_report", "kvc worker")
    timers.wrap(GPUModelRunner, "_update_states", "vllm worker")
    timers.wrap(GPUModelRunner, "_build_attention_metadata", "metadata")
    result = {}
    try:
        for name, (llm, extra) in engines.items():
            per_run = []
            for tokens in (1, output_len):
                timers.seconds.clear()
                llm.generate(prompts, token_params(tokens, extra), use_tqdm=False)
                per_run.append(dict(timers.seconds))
            prefix = "kvc" if name == "kvcompress" else "vllm"
            for part, key in (("scheduler", f"{prefix} scheduler"), ("worker", f"{prefix} worker"),
                              ("metadata", "metadata")):
                result[f"{name} {part}"] = (per_run[1].get(key, 0.0) - per_run[0].get(key, 0.0)) / (output_len - 1) * 1e3
    finally:
        timers.restore()
    for part in ("scheduler", "worker", "metadata"):
        result[f"extra {part}"] = result[f"kvcompress {part}"] - result[f"stock {part}"]
    result["extra total"] = result["extra scheduler"] + result["extra worker"]
    result["extra with metadata"] = result["extra total"] + result["extra metadata"]
    return result


def own_code_ms(llm, extra, prompts, output_len: int) -> dict[str, float]:
    """kvcompress's own code per decode step (ms), exclusive of the vLLM calls it wraps:
    its scheduler hooks (``schedule`` + ``update_from_output`` minus vLLM's), the KV
    manager proxy (minus vLLM's ``KVCacheManager`` calls it makes) and the worker's step
    bookkeeping (its ``_update_states`` + report minus vLLM's ``_update_states``). Timers
    wrap every call of the proxy, so this pass runs apart from the engine-against-engine
    one above (their overhead, ~0.2 us a call, is counted as kvcompress's)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcompress.vllm_glue.kv_manager import KVCompressKVCacheManager
    from kvcompress.vllm_glue.runner import KVCompressRunnerMixin
    from kvcompress.vllm_glue.scheduler import KVCompressScheduler

    proxy = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    timers = HookTimers()
    for name in ("schedule", "update_from_output"):
        timers.wrap(KVCompressScheduler, name, "scheduler hooks")
        timers.wrap(Scheduler, name, "-scheduler hooks")
    for name in ("allocate_slots", "free", "pop_blocks_for_free"):
        timers.wrap(KVCompressKVCacheManager, name, "kv manager proxy")
        timers.wrap(KVCacheManager, name, "-kv manager proxy")
    timers.wrap(proxy, "_inner_allocate", "-kv manager proxy")  # bound at construction
    timers.wrap(KVCompressRunnerMixin, "_update_states", "worker bookkeeping")
    timers.wrap(KVCompressRunnerMixin, "_kvc_attach_report", "worker bookkeeping")
    timers.wrap(GPUModelRunner, "_update_states", "-worker bookkeeping")
    per_run = []
    try:
        for tokens in (1, output_len):
            timers.seconds.clear()
            llm.generate(prompts, token_params(tokens, extra), use_tqdm=False)
            per_run.append(dict(timers.seconds))
    finally:
        timers.restore()
    result = {}
    for part in ("scheduler hooks", "kv manager proxy", "worker bookkeeping"):
        per_step = [(run.get(part, 0.0) - run.get(f"-{part}", 0.0)) for run in per_run]
        result[f"own {part}"] = (per_step[1] - per_step[0]) / (output_len - 1) * 1e3
    result["own total"] = sum(result.values())
    return result


def prompt_ms(llm, prompts, extra) -> float:
    """Time per prompt (ms) of a generate of one token: the prompt steps alone."""
    started = time.perf_counter()
    llm.generate(prompts, token_params(1, extra), use_tqdm=False)
    return (time.perf_counter() - started) / len(prompts) * 1e3


def prompt_op_profile(engines: dict, prompts, top: int) -> dict[str, dict[str, float]]:
    """Self CPU ms per prompt of the ``top`` costliest torch ops of each engine over one
    generate of one token (``torch.profiler``; as :func:`op_profile` for the prompt steps)."""
    from torch.profiler import ProfilerActivity, profile

    result = {}
    for name, (llm, extra) in engines.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, token_params(1, extra), use_tqdm=False)
        result[name] = {e.key: e.self_cpu_time_total / 1e3 / len(prompts) for e in prof.key_averages()}
    return top_ops(result, top)


def op_profile(engines: dict, prompts, output_len: int, top: int) -> dict[str, dict[str, float]]:
    """Self CPU time per decode step (ms) of the ``top`` costliest torch ops of each engine
    (``torch.profiler`` over one generate of ``output_len`` tokens minus one of 1; the
    engines' workers run in this process). Ops are named as the profiler names them:
    ``_C::cpu_attention_with_kv_cache`` is vLLM's CPU attention kernel in both."""
    from torch.profiler import ProfilerActivity, profile

    result = {}
    for name, (llm, extra) in engines.items():
        per_run = []
        for tokens in (1, output_len):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                llm.generate(prompts, token_params(tokens, extra), use_tqdm=False)
            per_run.append({e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()})
        steps = output_len - 1
        result[name] = {key: (ms - per_run[0].get(key, 0.0)) / steps for key, ms in per_run[1].items()}
    return top_ops(result, top)


def top_ops(ms_by_engine: dict[str, dict[str, float]], top: int) -> dict[str, dict[str, float]]:
    """Each engine's ms of the ``top`` ops costliest on either engine (0 where an engine has none)."""
    keys = sorted(set().union(*ms_by_engine.values()),
                  key=lambda k: -max(ms.get(k, 0.0) for ms in ms_by_engine.values()))
    return {name: {key: ms.get(key, 0.0) for key in keys[:top]} for name, ms in ms_by_engine.items()}


def main(argv=None) -> int:
    parser = side_script_parser(__doc__, model="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=129)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=None,
                        help="kvcompress page size (default: its own); with --shared-prefix both engines' "
                             "block size (default 64)")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="kvcompress's compression rate (default 1: nothing evicted, kernel parity)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="prompts share their first N tokens; prefix caching on in both engines (default 0: off)")
    parser.add_argument("--engine-rate", type=float, default=None,
                        help="kvcompress engine's own rate (default: --rate); requests use --rate")
    parser.add_argument("--log-stats", action="store_true",
                        help="engines log stats per step, as benchmark_throughput.py's do (default off)")
    parser.add_argument("--op-profile", type=int, default=0, metavar="TOP",
                        help="then print the TOP torch ops by self CPU ms a decode step, each engine (torch.profiler)")
    parser.add_argument("--prompt-only", action="store_true",
                        help="time the prompt steps (a generate of one token) instead of the decode steps")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens a step (default: max(2048, --input-len), one chunk a prompt); "
                             "below --input-len the prompts are prefilled in chunks, as benchmark_throughput.py's")
    parser.add_argument("--host-breakdown", action="store_true",
                        help="then time kvcompress's host-side hooks per decode step (see above)")
    args = parser.parse_args(argv)

    with bench.engine_core_in_process():
        from vllm import LLM

        import kvcompress

        kv_tokens = max(8192, (args.input_len + args.output_len + 300) * args.batch)
        workload = side_workload(
            args.model, args.batch, args.input_len, args.output_len, kv_tokens,
            max_num_batched_tokens=args.max_num_batched_tokens or max(2048, args.input_len),
            disable_log_stats=not args.log_stats,
        )
        engine_args, prompts = workload.engine_args, workload.prompts
        engine_args["max_num_seqs"] = max(256, args.batch)  # the whole batch decodes at once
        kvc_options = {"kv_compress_rate": args.engine_rate if args.engine_rate is not None else args.rate}
        if args.shared_prefix:
            prompts = [prompts[0][:args.shared_prefix] + p[args.shared_prefix:] for p in prompts]
            # one block size for both, so hits count the same blocks
            engine_args.update(enable_prefix_caching=True, block_size=args.block_size or 64)
            kvc_options["kv_compress_shared_prefix_tokens"] = args.shared_prefix
        else:
            kvc_options["kv_compress_block_size"] = args.block_size
        engines = {
            "stock": (LLM(model=workload.path, **engine_args), None),
            "kvcompress": (
                kvcompress.LLM(workload.path, **kvc_options, **engine_args),
                {"kv_compress_rate": args.rate},
            ),
        }
        for llm, extra in engines.values():
            decode_ms_per_step(llm, prompts, 8, extra)  # warm-up
        if args.prompt_only:
            return report_prompt_steps(args, workload, engines, prompts)
        times = {name: [] for name in engines}
        for _ in range(args.reps):
            for name, (llm, extra) in engines.items():
                times[name].append(decode_ms_per_step(llm, prompts, args.output_len, extra))
        block = engines["kvcompress"][0].llm_engine.vllm_config.cache_config.block_size
        breakdowns, own = [], []
        if args.host_breakdown:
            for _ in range(args.reps):
                breakdowns.append(host_breakdown(engines, prompts, args.output_len))
            for _ in range(args.reps):
                own.append(own_code_ms(*engines["kvcompress"], prompts, args.output_len))
        profiled = op_profile(engines, prompts, args.output_len, args.op_profile) if args.op_profile else None
        for llm, _ in engines.values():
            bench._shutdown(llm)

    stock, kvc = statistics.median(times["stock"]), statistics.median(times["kvcompress"])
    ratios = [k / s for s, k in zip(times["stock"], times["kvcompress"])]
    print(f"{workload.description}; batch {args.batch} x {args.input_len} tokens, {args.output_len - 1} decode "
          f"steps, kvcompress page {block}, rate {args.rate:g} (engine {kvc_options['kv_compress_rate']:g}), "
          f"shared prefix {args.shared_prefix or 'none'}, stats {'on' if args.log_stats else 'off'}; "
          f"{bench.machine_description()}")
    print(f"decode step: stock {stock:.3f} ms, kvcompress {kvc:.3f} ms, ratio of medians "
          f"{kvc / stock:.3f}; per repetition {min(ratios):.3f}..{max(ratios):.3f} "
          f"(median {statistics.median(ratios):.3f})")
    if breakdowns:
        cells = ", ".join(
            f"{key} {statistics.median(b[key] for b in breakdowns):.3f} ms" for key in breakdowns[0]
        )
        print(f"host time per decode step (medians of {len(breakdowns)}): {cells}")
        cells = ", ".join(f"{key} {statistics.median(b[key] for b in own):.3f} ms" for key in own[0])
        print(f"kvcompress's own code per decode step (medians of {len(own)}): {cells}")
    if profiled:
        print("torch ops, self CPU ms a decode step (one profiled generate each): op | stock | kvcompress")
        for key in profiled["stock"]:
            print(f"  {key} | {profiled['stock'][key]:.3f} | {profiled['kvcompress'][key]:.3f}")
    return 0


def report_prompt_steps(args, workload, engines: dict, prompts) -> int:
    """``--prompt-only``: the engines' prompt steps, alternating, then their torch ops."""
    times = {name: [] for name in engines}
    for _ in range(args.reps):
        for name, (llm, extra) in engines.items():
            times[name].append(prompt_ms(llm, prompts, extra))
    profiled = prompt_op_profile(engines, prompts, args.op_profile) if args.op_profile else None
    for llm, _ in engines.values():
        bench._shutdown(llm)
    stock, kvc = statistics.median(times["stock"]), statistics.median(times["kvcompress"])
    ratios = [k / s for s, k in zip(times["stock"], times["kvcompress"])]
    print(f"{workload.description}; batch {args.batch} x {args.input_len} tokens, prompt steps only, "
          f"rate {args.rate:g}; {bench.machine_description()}")
    print(f"prompt: stock {stock:.1f} ms, kvcompress {kvc:.1f} ms a prompt, ratio of medians {kvc / stock:.3f}; "
          f"per repetition {min(ratios):.3f}..{max(ratios):.3f} (median {statistics.median(ratios):.3f})")
    if profiled:
        print("torch ops, self CPU ms a prompt (one profiled generate each): op | stock | kvcompress")
        for key in profiled["stock"]:
            print(f"  {key} | {profiled['stock'][key]:.1f} | {profiled['kvcompress'][key]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
