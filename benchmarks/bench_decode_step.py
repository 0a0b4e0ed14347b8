"""Decode-step time of kvcompress at rate 1 against stock vLLM, both engines in ONE process.

Issue 14's kernel-parity target: a decode step of kvcompress (nothing evicted) within
1.1x stock vLLM's. Separate processes on a shared CPU host differ by up to ~20% in plain
matmul speed from run to run, so both engines live in this process (in-process engine
cores) and their runs alternate: each repetition times ``generate`` of ``--batch``
prompts of ``--input-len`` tokens for 1 and for ``--output-len`` tokens on stock, then
on kvcompress; the difference over ``output-len - 1`` is the time per decode step.

    python benchmarks/bench_decode_step.py --model tiny --batch 1
    python benchmarks/bench_decode_step.py --model smollm2 --batch 1 --reps 5
    # host bookkeeping at many sequences (issue 15 item 7): short contexts, 256 rows
    python benchmarks/bench_decode_step.py --model tiny --batch 256 --input-len 32 --output-len 65 \
        --reps 3 --host-breakdown

``--host-breakdown`` then runs kvcompress once more with wall-clock timers (no profiler)
around its host-side hooks and prints what they cost per decode step: the scheduler's
page accounting and planning (kvcompress's ``schedule`` / ``update_from_output`` / KV
manager proxy minus the vLLM calls inside them), the worker's step plan and report
(kvcompress's ``_update_states`` minus vLLM's, and the report attached to the output),
and the KV writes (``write_kv``, the counterpart of stock's ``reshape_and_cache``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import benchmark_throughput as bench  # noqa: E402  (sets VLLM_TARGET_DEVICE on CPU)


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


def host_breakdown(llm, prompts, output_len: int, extra) -> dict[str, float]:
    """kvcompress's host-side cost per decode step (ms), from one timed generate of
    ``output_len`` tokens minus one of 1 token (the prefill step's share)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcompress.vllm_glue import attention_backend
    from kvcompress.vllm_glue.runner import PerHeadRunnerMixin
    from kvcompress.vllm_glue.scheduler import KVCompressScheduler

    core = llm.llm_engine.engine_core.engine_core
    proxy = core.scheduler.kv_cache_manager
    timers = HookTimers()
    timers.wrap(KVCompressScheduler, "schedule", "kvc schedule")
    timers.wrap(Scheduler, "schedule", "vllm schedule")
    timers.wrap(KVCompressScheduler, "update_from_output", "kvc update_from_output")
    timers.wrap(Scheduler, "update_from_output", "vllm update_from_output")
    timers.wrap(proxy, "allocate_slots", "kvc allocate_slots")
    timers.wrap(proxy._inner, "allocate_slots", "vllm allocate_slots")
    timers.wrap(PerHeadRunnerMixin, "_update_states", "kvc update_states")
    timers.wrap(GPUModelRunner, "_update_states", "vllm update_states")
    timers.wrap(PerHeadRunnerMixin, "_kvc_attach_report", "kvc report")
    timers.wrap(attention_backend, "write_kv", "kv writes")
    per_run = []
    try:
        for tokens in (1, output_len):
            timers.seconds.clear()
            llm.generate(prompts, token_params(tokens, extra), use_tqdm=False)
            per_run.append(dict(timers.seconds))
    finally:
        timers.restore()
    prefill, full = per_run
    steps = output_len - 1

    def per_step(key: str) -> float:
        return (full.get(key, 0.0) - prefill.get(key, 0.0)) / steps * 1e3

    scheduler = (per_step("kvc schedule") - per_step("vllm schedule")
                 + per_step("kvc allocate_slots") - per_step("vllm allocate_slots")
                 + per_step("kvc update_from_output") - per_step("vllm update_from_output"))
    worker = per_step("kvc update_states") - per_step("vllm update_states") + per_step("kvc report")
    return {"scheduler bookkeeping": scheduler, "worker step plan + report": worker,
            "bookkeeping total": scheduler + worker, "kv writes": per_step("kv writes")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=129)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=None, help="kvcompress page size (default: its own)")
    parser.add_argument("--host-breakdown", action="store_true",
                        help="then time kvcompress's host-side hooks per decode step (see above)")
    args = parser.parse_args(argv)

    with bench.engine_core_in_process():
        from vllm import LLM

        import kvcompress

        path, description, default_dtype = bench.resolve_model(args.model)
        dtype = default_dtype or "auto"
        shape = bench.kv_shape(path)
        prompts = bench.synthetic_prompts(args.input_len, args.batch, shape["vocab_size"], seed=0)
        kv_tokens = max(8192, (args.input_len + args.output_len + 300) * args.batch)
        engine_args = bench.token_prompt_engine_args(
            shape, dtype, args.input_len, args.output_len, kv_tokens,
            max_num_batched_tokens=max(2048, args.input_len), disable_log_stats=True,
        )
        engine_args["max_num_seqs"] = max(256, args.batch)  # the whole batch decodes at once
        engines = {
            "stock": (LLM(model=path, **engine_args), None),
            "kvcompress": (
                kvcompress.LLM(path, kv_compress_block_size=args.block_size, **engine_args),
                {"kv_compress_rate": 1},
            ),
        }
        for llm, extra in engines.values():
            decode_ms_per_step(llm, prompts, 8, extra)  # warm-up
        times = {name: [] for name in engines}
        for _ in range(args.reps):
            for name, (llm, extra) in engines.items():
                times[name].append(decode_ms_per_step(llm, prompts, args.output_len, extra))
        block = engines["kvcompress"][0].llm_engine.vllm_config.cache_config.block_size
        breakdowns = []
        if args.host_breakdown:
            llm, extra = engines["kvcompress"]
            for _ in range(args.reps):
                breakdowns.append(host_breakdown(llm, prompts, args.output_len, extra))
        for llm, _ in engines.values():
            bench._shutdown(llm)

    stock, kvc = statistics.median(times["stock"]), statistics.median(times["kvcompress"])
    ratios = [k / s for s, k in zip(times["stock"], times["kvcompress"])]
    print(f"{description}; batch {args.batch} x {args.input_len} tokens, {args.output_len - 1} decode "
          f"steps, kvcompress page {block}, rate 1; {bench.machine_description()}")
    print(f"decode step: stock {stock:.3f} ms, kvcompress {kvc:.3f} ms, ratio of medians "
          f"{kvc / stock:.3f}; per repetition {min(ratios):.3f}..{max(ratios):.3f} "
          f"(median {statistics.median(ratios):.3f})")
    if breakdowns:
        cells = ", ".join(
            f"{key} {statistics.median(b[key] for b in breakdowns):.3f} ms" for key in breakdowns[0]
        )
        print(f"kvcompress host time per decode step (medians of {len(breakdowns)}): {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
