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
    python benchmarks/bench_decode_step.py --model tiny --batch 256 --input-len 32 --output-len 65 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import benchmark_throughput as bench  # noqa: E402  (sets VLLM_TARGET_DEVICE on CPU)


def decode_ms_per_step(llm, prompts, output_len: int, extra) -> float:
    """Time per decode step: generate(output_len) minus generate(1) (the prefill)."""
    from vllm import SamplingParams

    def params(tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                              detokenize=False, extra_args=extra)

    started = time.perf_counter()
    llm.generate(prompts, params(1), use_tqdm=False)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate(prompts, params(output_len), use_tqdm=False)
    total = time.perf_counter() - started
    return (total - prefill) / (output_len - 1) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=129)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=None, help="kvcompress page size (default: its own)")
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
        for llm, _ in engines.values():
            bench._shutdown(llm)

    stock, kvc = statistics.median(times["stock"]), statistics.median(times["kvcompress"])
    ratios = [k / s for s, k in zip(times["stock"], times["kvcompress"])]
    print(f"{description}; batch {args.batch} x {args.input_len} tokens, {args.output_len - 1} decode "
          f"steps, kvcompress page {block}, rate 1; {bench.machine_description()}")
    print(f"decode step: stock {stock:.3f} ms, kvcompress {kvc:.3f} ms, ratio of medians "
          f"{kvc / stock:.3f}; per repetition {min(ratios):.3f}..{max(ratios):.3f} "
          f"(median {statistics.median(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
