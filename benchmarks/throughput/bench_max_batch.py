"""Max concurrent decoding requests under one fixed KV memory budget: stock vLLM vs
kvcompress at several compression rates, side by side in one run.

Both engines get the same ``kv_cache_memory_bytes`` (printed), the same model, prompts
and scheduler limits. A step's decode batch is the number of requests that produced a
token in that step (``LLMEngine.step`` outputs), counted the same way for both engines;
the table shows the largest one. kvcompress runs every rate in one engine through the
per-request field ``kv_compress_rate`` (``SamplingParams.extra_args``).

    python benchmarks/throughput/bench_max_batch.py                     # CPU default, ~5 min
    python benchmarks/throughput/bench_max_batch.py --rates 2 4 8 --prompt-len 1024 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

# Tiny random GQA Llama of the test suite: 4 layers x 2 KV heads x head dim 64, float32.
TINY = dict(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64)
TINY_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4


def _engine_args(kv_tokens: int, max_model_len: int, max_num_seqs: int) -> dict:
    return dict(
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=kv_tokens * TINY_BYTES_PER_TOKEN,
        enable_prefix_caching=False,
        seed=0,
    )


def _run_batch(llm, prompts, params_list) -> dict:
    """Feed all requests, step to completion; returns the peak decode batch and more."""
    engine = llm.llm_engine
    tag = f"b{time.monotonic_ns()}"
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"{tag}-{index}", prompt, params)
    peak, steps, finished, generated = 0, 0, 0, 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        peak = max(peak, len(outputs))
        for output in outputs:
            if output.finished:
                finished += 1
                generated += len(output.outputs[0].token_ids)
    return {
        "max_decode_batch": peak,
        "steps": steps,
        "finished": finished,
        "generated_tokens": generated,
        "seconds": time.perf_counter() - started,
    }


def _pages_after_compression(llm, prompt, params) -> int:
    """Pages one request holds right after its prefill was compressed (first decode token
    included): a single request, so nothing else competes for memory."""
    engine = llm.llm_engine
    one = params.clone()
    one.max_tokens = 4  # compressed at the start of step 2, still running after it
    engine.add_request(f"pages-{time.monotonic_ns()}", prompt, one)
    held = None
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.engine_core.call_utility("kvc_page_stats")
        for request in stats["requests"].values():
            if min(min(layer) for layer in request["head_lens"]) < request["logical_len"]:
                held = request["pages_held"] if held is None else held
    return held if held is not None else -1


def measure(
    rates=(2, 4, 8),
    prompt_len: int = 1024,
    output_len: int = 64,
    kv_tokens: int = 16384,
    num_prompts: int | None = None,
    protected_window: int = 8,
    max_num_seqs: int = 256,
    seed: int = 0,
) -> dict:
    """Run stock vLLM and kvcompress (one engine, all rates); returns the results table."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvcompress
    from benchmarks.common.offline_assets import tiny_llama_checkpoint

    model = str(tiny_llama_checkpoint(**TINY))
    # Enough requests that even the highest rate runs out of memory before prompts.
    per_request_tokens = prompt_len + output_len
    if num_prompts is None:
        num_prompts = min(max_num_seqs, int(1.3 * max(rates) * kv_tokens / per_request_tokens) + 4)
    rng = np.random.default_rng(seed)
    prompts = [
        TokensPrompt(prompt_token_ids=rng.integers(3, 1000, prompt_len).tolist())
        for _ in range(num_prompts)
    ]
    max_model_len = per_request_tokens + 16
    args = _engine_args(kv_tokens, max_model_len, max_num_seqs)

    def params(extra=None):
        return SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True, extra_args=extra
        )

    results = {
        "model": "tiny random GQA Llama (4 layers, 8 q / 2 KV heads, head 64, float32)",
        "kv_cache_memory_bytes": args["kv_cache_memory_bytes"],
        "kv_budget_tokens_uncompressed": kv_tokens,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "protected_window": protected_window,
        "max_num_seqs": max_num_seqs,
        "rows": [],
    }
    stock = LLM(model=model, **args)
    stock_run = _run_batch(stock, prompts, [params() for _ in prompts])
    stock.llm_engine.engine_core.shutdown()
    del stock
    results["rows"].append({"engine": "stock vLLM", "rate": 1, **stock_run})

    kvc = kvcompress.LLM(model, kv_compress_protected_window=protected_window, **args)
    for rate in rates:
        held = _pages_after_compression(kvc, prompts[0], params({"kv_compress_rate": rate}))
        worker_before = kvc.collective_rpc("kvc_pages_used")[0]
        run = _run_batch(kvc, prompts, [params({"kv_compress_rate": rate}) for _ in prompts])
        worker_after = kvc.collective_rpc("kvc_pages_used")[0]
        stats = kvc.llm_engine.engine_core.call_utility("kvc_page_stats")
        run["pages_per_request_after_prefill_compression"] = held
        run["pages_per_request_uncompressed"] = stats["num_layers"] * stats["num_kv_heads"] * (
            -(-(prompt_len + 1) // stats["block_size"])
        )
        step_seconds = worker_after["step_seconds"] - worker_before["step_seconds"]
        run["compression_share_of_step_time"] = (
            worker_after["compress_seconds"] - worker_before["compress_seconds"]
        ) / max(step_seconds, 1e-9)
        run["mismatches"] = stats["mismatches"]
        run["preemptions_total"] = stats["num_preemptions"]
        run["multiplier"] = run["max_decode_batch"] / max(1, stock_run["max_decode_batch"])
        run["multiplier_over_rate"] = run["multiplier"] / rate
        results["rows"].append({"engine": "kvcompress", "rate": rate, **run})
    kvc.llm_engine.engine_core.shutdown()
    return results


def print_table(results: dict) -> None:
    print(
        f"model: {results['model']}\nKV memory: {results['kv_cache_memory_bytes']} bytes "
        f"(= {results['kv_budget_tokens_uncompressed']} uncompressed tokens); "
        f"{results['num_prompts']} prompts x {results['prompt_len']} tokens, "
        f"{results['output_len']} output tokens, protected window {results['protected_window']}"
    )
    print(
        f"{'engine':>12} {'rate':>5} {'max batch':>10} {'x stock':>8} {'x/rate':>7} "
        f"{'pages/req':>10} {'compress %':>11} {'seconds':>8}"
    )
    for row in results["rows"]:
        mult = row.get("multiplier", 1.0)
        per_rate = row.get("multiplier_over_rate", 1.0)
        pages = row.get("pages_per_request_after_prefill_compression")
        pages_text = f"{pages}/{row['pages_per_request_uncompressed']}" if pages else "-"
        share = row.get("compression_share_of_step_time")
        share_text = f"{100 * share:.2f}" if share is not None else "-"
        print(
            f"{row['engine']:>12} {row['rate']:>5} {row['max_decode_batch']:>10} "
            f"{mult:>8.2f} {per_rate:>7.2f} {pages_text:>10} {share_text:>11} {row['seconds']:>8.1f}"
        )
    print("pages/req: pages one request holds after its prefill is compressed / uncompressed; "
          "compress %: worker time in compression (schedule + MoveCache) / worker step time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=16384,
                        help="KV memory budget in uncompressed tokens of the tiny model")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--protected-window", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results = measure(
        rates=args.rates, prompt_len=args.prompt_len, output_len=args.output_len,
        kv_tokens=args.kv_tokens, num_prompts=args.num_prompts,
        protected_window=args.protected_window,
    )
    print_table(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
