"""When each request is admitted and preempted: stock vLLM's scheduler or kvcompress's, step by step.

Issue 61's knife-edge regimes (KV memory just short of N sequences) preempt at a pattern
set by the budget and the allocation unit (stock's blocks, kvcompress's pages), and the
pattern, not the step time, decides the throughput. This runs ONE engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) over ``--num-prompts`` random prompts at rate 1 and
prints every step in which a request was admitted or preempted, with the tokens every
running request has computed; the last line counts the preemptions and the steps.

    python benchmarks/throughput/trace_schedule.py --engine stock --input-len 4096 --output-len 256 \\
        --num-prompts 16 --kv-tokens 17408
    python benchmarks/throughput/trace_schedule.py --engine kvcompress ... --extra-kv-bytes 1100000

``--extra-kv-bytes`` gives kvcompress that many bytes of KV memory more than ``--kv-tokens``
(a diagnostic: what its slot metadata's bytes cost); ``--block-size`` its page size.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.common.engine_requests import add_token_requests  # noqa: E402
from benchmarks.throughput import benchmark_throughput as bench  # noqa: E402  (sets VLLM_TARGET_DEVICE)
from benchmarks.throughput.side_scripts import side_script_parser, side_workload  # noqa: E402


def parse_args(argv=None):
    parser = side_script_parser(__doc__, model="tiny", input_len=4096)
    parser.add_argument("--engine", choices=("stock", "kvcompress"), required=True)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=17408, help="KV memory in uncompressed tokens")
    parser.add_argument("--extra-kv-bytes", type=int, default=0, help="kvcompress only: this many bytes more")
    parser.add_argument("--block-size", type=int, default=None, help="kvcompress's page size (default its own)")
    return parser.parse_args(argv)


def start_engine(args, workload):
    engine_args = dict(workload.engine_args)
    if args.engine == "stock":
        from vllm import LLM

        return LLM(workload.path, **engine_args)
    import kvcompress

    engine_args["kv_cache_memory_bytes"] += args.extra_kv_bytes
    return kvcompress.LLM(workload.path, kv_compress=True, kv_compress_block_size=args.block_size, **engine_args)


def trace(llm, prompts, output_len: int, rate_args) -> tuple[list[str], int, int]:
    """Steps the engine to the end; (printed lines, preemptions, steps)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0, extra_args=rate_args)
    index_of = add_token_requests(engine, "trace", prompts, [params] * len(prompts))
    scheduler = engine.engine_core.engine_core.scheduler
    lines, preemptions, step, before = [], 0, 0, set()
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        running = {index_of[r.request_id]: r.num_computed_tokens for r in scheduler.running}
        waiting = {index_of[r.request_id] for r in scheduler.waiting}
        events = [f"preempt {i}" for i in sorted(before & waiting - running.keys())]
        events += [f"admit {i}" for i in sorted(running.keys() - before)]
        preemptions += sum(e.startswith("preempt") for e in events)
        if events:
            tokens = ", ".join(f"{i}: {n}" for i, n in sorted(running.items()))
            lines.append(f"step {step}: {'; '.join(events)} | running (tokens computed) {tokens}")
        before = set(running)
    return lines, preemptions, step


def main(argv=None) -> None:
    args = parse_args(argv)
    workload = side_workload(args.model, args.num_prompts, args.input_len, args.output_len, args.kv_tokens)
    with bench.engine_core_in_process():  # the scheduler is read after every step
        llm = start_engine(args, workload)
        lines, preemptions, steps = trace(
            llm, workload.prompts, args.output_len, None if args.engine == "stock" else {"kv_compress_rate": 1},
        )
    print("\n".join(lines))
    print(f"{args.engine}: {preemptions} preemptions in {steps} steps ({workload.description}, "
          f"{args.num_prompts} x {args.input_len} / {args.output_len}, {args.kv_tokens} tokens of KV memory"
          f"{f' + {args.extra_kv_bytes} bytes' if args.extra_kv_bytes else ''})")


if __name__ == "__main__":
    bench._setup_env()
    main()
