"""Prefix caching with compression: requests sharing a long system prompt, stock vLLM with
prefix caching vs kvcompress with prefix caching at rates 1 / 4 / 8, same KV memory.

Both engines use the same block size (``--block-size``, 64: kvcompress's CPU page size), so
prefix-cache hits are counted in the same blocks. Every request is ``--shared`` tokens of one system prompt (an essay slice) + ``--private``
tokens of its own (other slices) and generates exactly ``--output-len`` tokens. Both
engines run with ``enable_prefix_caching=True`` and the same ``kv_cache_memory_bytes``;
kvcompress keeps the system prompt uncompressed and cached
(``--kv-compress-shared-prefix-tokens`` = ``--shared``) and compresses each request's
private part at the request's rate (one engine, the rate per request). Before each run
the prefix cache is reset (``LLM.reset_prefix_cache``), so every run starts cold and the
first request computes the system prompt.

Per engine / rate: seconds, requests/s, output and total tokens/s, the max and mean
decode batch (requests that produced a token in a step), preemptions and prefix-cache
hit tokens (vLLM's ``vllm:prefix_cache_hits``), and for kvcompress the compressions and
page-count mismatches; then multipliers over stock. A correctness pass checks that at
rate 1 kvcompress's greedy tokens and per-request cached tokens equal stock's.

Writes ``<prefix>.json``, ``<prefix>.md`` and ``<prefix>.png`` (throughput and max batch
by engine). Defaults: SmolLM2-135M, 1500 shared + 500 private tokens, outputs 128,
16 prompts, KV memory for the prompt + 4 private parts uncompressed (stock holds ~4
requests at once), ~8 min on 2 CPU cores.

    python benchmarks/throughput/bench_prefix_caching.py
    python benchmarks/throughput/bench_prefix_caching.py --model tiny --num-prompts 8   # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.throughput.benchmark_throughput import (
    KVC,
    STOCK,
    _setup_env,
    _shutdown,
    engine_core_in_process,
    essay_tokens,
    kv_bytes_per_token,
    kvcompress_capacity_tokens,
    kv_shape,
    resolve_model,
    run_batch,
    stock_capacity_tokens,
    synthetic_prompts,
)
from benchmarks.common.machine import cpu_model_name, usable_cores
from benchmarks.common.plots import two_bar_charts

RESULTS = Path(__file__).resolve().parent / "results"


def shared_prompt_requests(model: str, name: str, shared: int, private: int, count: int,
                           vocab_size: int) -> list[list[int]]:
    """``count`` prompts: one ``shared``-token system prompt + ``private`` tokens each."""
    if name == "tiny":
        tokens = synthetic_prompts(shared + private * count, 1, vocab_size, seed=3)[0]
    else:
        tokens = essay_tokens(model)
        while len(tokens) < shared + private * count:
            tokens = tokens + tokens
    system = tokens[:shared]
    return [system + tokens[shared + i * private: shared + (i + 1) * private] for i in range(count)]


def _hits(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"))


def timed_run(llm, prompts, params, desc: str) -> dict[str, Any]:
    llm.reset_prefix_cache()
    before = _hits(llm)
    run = run_batch(llm, prompts, [params.clone() for _ in prompts], desc, progress=True)
    run["prefix_cache_hit_tokens"] = _hits(llm) - before
    return run


def greedy(llm, prompts, params) -> tuple[list[list[int]], list[int]]:
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
    outputs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[1:]], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens for o in outputs]


def measure(args) -> dict[str, Any]:
    _setup_env()
    from vllm import LLM, SamplingParams

    import kvcompress
    from kvcompress.vllm_glue.llm import page_stats

    model, description, dtype = resolve_model(args.model)
    shape = kv_shape(model)
    dtype = dtype or "auto"
    bytes_per_token = kv_bytes_per_token(shape, dtype)
    prompts = shared_prompt_requests(model, args.model, args.shared, args.private, args.num_prompts,
                                     shape["vocab_size"])
    kv_tokens = args.kv_tokens or args.shared + 4 * (args.private + args.output_len)
    engine_args = dict(
        skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, enable_prefix_caching=True,
        max_model_len=args.shared + args.private + args.output_len + 16,
        max_num_batched_tokens=2048, max_num_seqs=args.num_prompts, block_size=args.block_size,
        kv_cache_memory_bytes=kv_tokens * bytes_per_token, disable_log_stats=False, seed=0,
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    results: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{cpu_model_name()}, {usable_cores()} usable cores",
        "model": description, "shared": args.shared, "private": args.private,
        "output_len": args.output_len, "num_prompts": args.num_prompts,
        "kv_tokens_uncompressed": kv_tokens, "kv_cache_memory_bytes": kv_tokens * bytes_per_token,
        "rows": [],
    }
    check = shared_prompt_requests(model, args.model, args.shared, 64, 4, shape["vocab_size"])
    check_params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with engine_core_in_process():
        stock = LLM(model=model, **engine_args)
        try:
            results["stock_kv_capacity_tokens"] = stock_capacity_tokens(
                stock.llm_engine.vllm_config.cache_config, results["kv_cache_memory_bytes"], bytes_per_token)
            stock_greedy = greedy(stock, check, check_params)
            run = timed_run(stock, prompts, params, "stock vLLM + APC")
            results["rows"].append({"engine": STOCK, "rate": 1.0, **run})
            _print(results["rows"][-1])
        finally:
            _shutdown(stock)
        kvc = kvcompress.LLM(
            model, kv_compress_rate=max(args.rates), kv_compress_shared_prefix_tokens=args.shared,
            kv_compress_protected_window=args.protected_window, **engine_args,
        )
        try:
            results["kvcompress_kv_capacity_tokens"] = kvcompress_capacity_tokens(page_stats(kvc))
            # The token blocks vLLM's scheduler counts (its prefix cache's)
            cache = kvc.llm_engine.vllm_config.cache_config
            results["kvcompress_scheduler_tokens"] = cache.num_gpu_blocks * cache.block_size
            rate_1 = check_params.clone()
            rate_1.extra_args = {"kv_compress_rate": 1}
            kvc_greedy = greedy(kvc, check, rate_1)
            results["rate1_tokens_equal_stock"] = kvc_greedy[0] == stock_greedy[0]
            results["rate1_cached_tokens"] = {"stock": stock_greedy[1], "kvcompress": kvc_greedy[1]}
            results["rate1_cached_tokens_equal_stock"] = kvc_greedy[1] == stock_greedy[1]
            for rate in args.rates:
                run_params = params.clone()
                run_params.extra_args = {"kv_compress_rate": rate}
                before = page_stats(kvc)
                run = timed_run(kvc, prompts, run_params, f"kvcompress + APC r={rate:g}")
                after = page_stats(kvc)
                run.update(
                    compressions=after["compressions"] - before["compressions"],
                    mismatches=after["mismatches"] - before["mismatches"],
                )
                results["rows"].append({"engine": KVC, "rate": float(rate), **run})
                _print(results["rows"][-1])
        finally:
            _shutdown(kvc)
    stock_row = results["rows"][0]
    for row in results["rows"]:
        row["throughput_multiplier"] = row["output_tokens_per_s"] / stock_row["output_tokens_per_s"]
        row["max_batch_multiplier"] = row["max_decode_batch"] / max(1, stock_row["max_decode_batch"])
    return results


def _print(row: dict[str, Any]) -> None:
    print(f"{row['engine']:>12} r={row['rate']:<4g} {row['seconds']:7.1f} s  "
          f"{row['output_tokens_per_s']:7.1f} out tok/s  max batch {row['max_decode_batch']:3d}  "
          f"hits {row['prefix_cache_hit_tokens']}", file=sys.stderr)


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# Prefix caching with compression ({results['date']})", "",
        f"- machine: {results['machine']}",
        f"- model: {results['model']}",
        f"- requests: {results['num_prompts']} x ({results['shared']} shared + {results['private']} "
        f"private tokens), {results['output_len']} output tokens each (ignore_eos)",
        f"- KV memory (both engines): {results['kv_cache_memory_bytes']} bytes = "
        f"{results['kv_tokens_uncompressed']} tokens uncompressed; usable: stock "
        f"{results.get('stock_kv_capacity_tokens', '-')} tokens (its blocks less vLLM's null block), kvcompress "
        f"{results.get('kvcompress_kv_capacity_tokens', '-')} tokens in its pages, "
        f"{results.get('kvcompress_scheduler_tokens', '-')} in the token blocks it tells vLLM (num_gpu_blocks)",
        f"- rate 1 greedy tokens equal stock's: {results.get('rate1_tokens_equal_stock')}; "
        f"cached tokens per request equal stock's: {results.get('rate1_cached_tokens_equal_stock')} "
        f"({results.get('rate1_cached_tokens')})",
        "",
        "| engine | rate | seconds | output tok/s | total tok/s | x stock | max decode batch | x stock "
        "| mean batch | preemptions | hit tokens | compressions | mismatches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['engine']} | {row['rate']:g} | {row['seconds']:.1f} | {row['output_tokens_per_s']:.1f} "
            f"| {row['total_tokens_per_s']:.1f} | {row['throughput_multiplier']:.2f} | {row['max_decode_batch']} "
            f"| {row['max_batch_multiplier']:.2f} | {row['mean_decode_batch']:.1f} | {row.get('preemptions')} "
            f"| {row['prefix_cache_hit_tokens']} | {row.get('compressions', '-')} | {row.get('mismatches', '-')} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> str | None:
    rows = results["rows"]
    labels = ["stock+APC" if r["engine"] == STOCK else f"kvc+APC r={r['rate']:g}" for r in rows]
    title = (f"{results['num_prompts']} x ({results['shared']} shared + {results['private']} private) "
             f"tokens, {results['output_len']} out, {results['kv_tokens_uncompressed']} KV tokens")
    return two_bar_charts(str(path), labels, ([r["output_tokens_per_s"] for r in rows], "output tokens/s"),
                          ([r["max_decode_batch"] for r in rows], "max decode batch"), title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model path")
    parser.add_argument("--shared", type=int, default=1500)
    parser.add_argument("--private", type=int, default=500)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 4, 8])
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="KV memory in uncompressed tokens (default: shared + 4 x (private + output))")
    parser.add_argument("--protected-window", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64,
                        help="both engines' block / page size (hits are counted in whole blocks)")
    parser.add_argument("--out", default=str(RESULTS / "prefix-caching-cpu"))
    args = parser.parse_args(argv)
    results = measure(args)
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    prefix.with_suffix(".md").write_text(table)
    png = plot(results, prefix.with_suffix(".png"))
    print(table)
    best = max(results["rows"][1:], key=lambda r: r["output_tokens_per_s"], default=None)
    if best is not None:
        print(f"summary: best kvcompress+APC r={best['rate']:g}: {best['throughput_multiplier']:.2f}x stock+APC "
              f"output tokens/s, max batch {best['max_batch_multiplier']:.2f}x; rate 1 tokens equal stock: "
              f"{results.get('rate1_tokens_equal_stock')}" + (f"; plot {png}" if png else ""))
    ok = results.get("rate1_tokens_equal_stock") and all(r.get("mismatches", 0) == 0 for r in results["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
