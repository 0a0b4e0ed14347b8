"""Passkey retrieval with SmolLM2-135M-Instruct (or ``--model``, e.g. ``gemma3``): stock
vLLM vs kvcompress at several compression rates, greedy, float32 on CPU.

A pass key sentence ("The pass key is 12345. Remember it. 12345 is the pass key.") is
hidden at a sentence boundary at a given depth of a ~3K-token haystack of Paul Graham
essays; the prompt ends with "What is the pass key? The pass key is". A prompt counts as
found when the key's digits appear in the (greedy, 12-token) answer.

One stock ``vllm.LLM`` answers every prompt; then one ``kvcompress.LLM`` engine answers
the same prompts once per rate, the rate set per request
(``SamplingParams(extra_args={"kv_compress_rate": r})``; rate 1 evicts nothing and must
be token-identical to stock). Pages held after compression are read from the scheduler
(``kvc_page_stats``): per request the fewest pages held while decoding, i.e. just
after its prompt was compressed; "full" is what it would hold uncompressed.

    python benchmarks/quality/passkey.py                                  # ~15 prompts, rates 1 4 8 16
    python benchmarks/quality/passkey.py --context-tokens 3000 --depths 0.1 0.5 0.9 --trials 2 \\
        --rates 1 8 --json passkey.json
    python benchmarks/quality/passkey.py --model gemma3 --rates 1 8     # sliding-window layers
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.common.engine_args import eager_float32_engine_args, stock_cache_dtype
from benchmarks.common.engine_requests import add_token_requests
from benchmarks.common.offline_assets import essay_text, model_label, named_checkpoint, sentence_starts
from benchmarks.common.plots import two_bar_charts
from kvcompress.vllm_glue.llm import page_stats, shutdown

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

INTRO = (
    "There is a pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key."
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
PROMPT_FORMATS = ("plain", "chat", "chat-user")
"""``plain`` (default): no template, a completion prompt ending "The pass key is";
``chat``: chat template, the question in the user turn, the assistant turn opened with
"The pass key is"; ``chat-user``: chat template, question and "The pass key is" both in
the user turn.

Measured with stock vLLM (the default 15 prompts: 3K tokens, 5 depths x 3 trials):
``plain`` finds 10/15, ``chat`` 1/15, ``chat-user`` 0/15 (SmolLM2 answers "a term coined
by ..."); with a generic intro ("an important piece of information" instead of "a pass
key") ``plain`` found 8/15, ``chat`` 2/15, ``chat-user`` 0/15; ``plain`` without any intro 6/15."""

ENGINE_ARGS = eager_float32_engine_args(
    max_model_len=4096,
    max_num_batched_tokens=1024,  # chunked prefill of every prompt
    kv_cache_memory_bytes=512 << 20,
)


# --------------------------------------------------------------------------------------
# Prompts


def _leading_bos(tokenizer) -> list[int]:
    """``[bos]`` when the tokenizer puts one first by default (Gemma reads garbage
    without it), else ``[]`` (SmolLM2's adds none)."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer("x")["input_ids"][:1] == [bos] else []


def _render(tokenizer, haystack: str, prompt_format: str) -> list[int]:
    """Token ids of the whole prompt around ``haystack`` (the text with the needle)."""
    body = f"{INTRO}\n\n{haystack}\n\n"
    if prompt_format == "plain":
        text = body + f"{QUESTION} {ANSWER_PREFIX}"
        return _leading_bos(tokenizer) + tokenizer(text, add_special_tokens=False)["input_ids"]
    if prompt_format == "chat":
        messages = [{"role": "user", "content": body + QUESTION}]
        suffix = ANSWER_PREFIX
    elif prompt_format == "chat-user":
        messages = [{"role": "user", "content": body + f"{QUESTION} {ANSWER_PREFIX}"}]
        suffix = ""
    else:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text + suffix, add_special_tokens=False)["input_ids"]


def build_prompt(
    tokenizer,
    essays: list[str],
    context_tokens: int,
    depth: float,
    key: int,
    first_essay: int = 0,
    prompt_format: str = "plain",
) -> dict[str, Any]:
    """One passkey prompt of about ``context_tokens`` tokens (never more).

    The haystack is cut at a sentence end so that the rendered prompt fits; the needle
    goes in at the sentence start nearest ``depth`` x the haystack's length.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = NEEDLE.format(key=key)
    source = essay_text(essays, first_essay, min_chars=8 * context_tokens)
    encoded = tokenizer(source, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    overhead = len(_render(tokenizer, needle, prompt_format))
    budget = context_tokens - overhead
    if budget <= 32:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for a haystack")
    starts = sentence_starts(source)
    for _ in range(8):  # shrink until the whole prompt fits
        cut_at = offsets[min(budget, len(offsets) - 1)][0]
        ends = [s for s in starts if s <= cut_at]
        haystack = source[: ends[-1]].rstrip() if ends else source[:cut_at]
        inner = [s for s in sentence_starts(haystack)] or [0]
        target = depth * len(haystack)
        at = min([0, *inner, len(haystack)], key=lambda s: (abs(s - target), s))
        if at >= len(haystack):
            text = f"{haystack} {needle}"
        elif at == 0:
            text = f"{needle} {haystack}"
        else:
            text = f"{haystack[:at]}{needle} {haystack[at:]}"
        ids = _render(tokenizer, text, prompt_format)
        if len(ids) <= context_tokens:
            break
        budget -= len(ids) - context_tokens + 4
    else:
        raise RuntimeError("could not fit the passkey prompt")
    return {
        "depth": depth,
        "key": key,
        "first_essay": first_essay,
        "needle_char_depth": at / max(1, len(haystack)),
        "prompt_token_ids": ids,
        "prompt_tokens": len(ids),
    }


def build_prompts(
    tokenizer,
    essays: list[str],
    context_tokens: int = 3000,
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    trials: int = 3,
    seed: int = 0,
    prompt_format: str = "plain",
) -> list[dict[str, Any]]:
    """``len(depths) x trials`` prompts; pass keys from ``random.Random(seed)``; trial t
    of every depth uses the haystack that starts at essay ``7 t`` (so trials differ)."""
    rng = random.Random(seed)
    prompts = []
    for trial in range(trials):
        for depth in depths:
            key = rng.randint(10000, 99999)
            prompt = build_prompt(
                tokenizer, essays, context_tokens, depth, key,
                first_essay=7 * trial, prompt_format=prompt_format,
            )
            prompt["trial"] = trial
            prompts.append(prompt)
    return prompts


def found(key: int, text: str) -> bool:
    """The pass key's digits appear in the answer (thousands separators ignored)."""
    return str(key) in text.replace(",", "")


# --------------------------------------------------------------------------------------
# Engines


def _generate(llm, prompts, params_list, track_pages: bool = False) -> dict[str, Any]:
    """Add every request, step to completion. With ``track_pages``, also read the
    scheduler's pages after every step: per request, the fewest pages it held while
    decoding, i.e. just after its prompt was compressed (the engine core steps on its
    own, so the snapshots are a sample of its steps)."""
    engine = llm.llm_engine
    internal = add_token_requests(  # engine-core request id -> prompt index
        engine, f"pk{time.monotonic_ns()}", [p["prompt_token_ids"] for p in prompts], params_list
    )
    outputs: list[Any] = [None] * len(prompts)
    after_compression: dict[int, dict] = {}
    before = page_stats(llm) if track_pages else None
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id.split("-")[1])] = output.outputs[0]
        if track_pages:
            stats = page_stats(llm)
            heads = stats["num_layers"] * stats["num_kv_heads"]
            for rid, request in stats["requests"].items():
                index = internal.get(rid)
                if index is None or request["logical_len"] <= prompts[index]["prompt_tokens"]:
                    continue  # not ours, or still in prefill (not compressed yet)
                seen = after_compression.get(index)
                if seen is None or request["pages_held"] < seen["pages_held"]:
                    after_compression[index] = {
                        "pages_held": request["pages_held"],
                        "full_pages": heads * -(-request["logical_len"] // stats["block_size"]),
                        "kvs_held": sum(map(sum, request["head_lens"])),
                        "full_kvs": heads * request["logical_len"],
                        "logical_len": request["logical_len"],
                    }
    seconds = time.perf_counter() - started
    result = {
        "texts": [o.text for o in outputs],
        "token_ids": [list(o.token_ids) for o in outputs],
        "seconds": seconds,
    }
    if track_pages:
        after = page_stats(llm)
        for key in ("compressions", "compressions_after_prefill", "pages_freed", "num_preemptions"):
            result[key] = after[key] - before[key]
        result["mismatches"] = after["mismatches"]
        result["pages_after_compression"] = [after_compression.get(i) for i in range(len(prompts))]
    return result


def _score(prompts, run: dict) -> None:
    run["found"] = [found(p["key"], t) for p, t in zip(prompts, run["texts"])]
    run["num_found"] = sum(run["found"])
    run["accuracy"] = run["num_found"] / max(1, len(prompts))


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def run_passkey(
    context_tokens: int = 3000,
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    rates=(1, 4, 8, 16),
    trials: int = 3,
    max_tokens: int = 12,
    seed: int = 0,
    prompt_format: str = "plain",
    protected_window: int | None = None,
    engine_args: dict | None = None,
    model: str | None = None,
    kv_cache_dtype: str = "auto",
    dtype: str = "float32",
    log=print,
) -> dict[str, Any]:
    """Stock vLLM, then kvcompress at every rate, on the same passkey prompts.
    ``kv_cache_dtype``: kvcompress's pages (e.g. "fp8"); stock's cache too where vLLM's
    CPU kernel takes FP8 caches (AVX-512 / AMX hosts: :func:`stock_cache_dtype`), else
    the model's dtype. ``dtype``: the model's (and so the queries') dtype in both engines.

    Returns ``{"config", "prompts", "stock", "kvcompress": {rate: run}, "rate1_identical"
    (None without rate 1), "wall_seconds"}``; a run has ``texts``, ``token_ids``,
    ``found``, ``num_found``, ``accuracy``, ``seconds``; kvcompress runs also
    ``pct_of_stock``, ``compressions``, ``pages_freed``, ``num_preemptions``,
    ``mismatches``, ``pages_after_compression`` (per prompt) and their means.
    """
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    import kvcompress
    from benchmarks.common.offline_assets import paul_graham_essays, smollm2_checkpoint

    wall = time.perf_counter()
    rates = [float(r) for r in rates]
    model = model or str(smollm2_checkpoint())
    args = {**ENGINE_ARGS, "dtype": dtype, **(engine_args or {})}
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = build_prompts(
        tokenizer, paul_graham_essays(), context_tokens, depths, trials, seed, prompt_format
    )
    if max(p["prompt_tokens"] for p in prompts) + max_tokens > args["max_model_len"]:
        raise ValueError("context_tokens + max_tokens exceeds max_model_len")

    def params(extra=None):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)

    log(f"{len(prompts)} prompts of {min(p['prompt_tokens'] for p in prompts)}-"
        f"{max(p['prompt_tokens'] for p in prompts)} tokens ({prompt_format} format)")

    started = time.perf_counter()
    stock_dtype = stock_cache_dtype(kv_cache_dtype)
    stock = LLM(model=model, kv_cache_dtype=stock_dtype, **args)
    log(f"stock vLLM engine (--kv-cache-dtype {stock_dtype}) up in {time.perf_counter() - started:.0f} s")
    try:
        stock_run = _generate(stock, prompts, [params() for _ in prompts])
    finally:
        shutdown(stock)
    _score(prompts, stock_run)
    log(f"stock vLLM: {stock_run['num_found']}/{len(prompts)} in {stock_run['seconds']:.0f} s")

    kv_kwargs = {} if protected_window is None else {"kv_compress_protected_window": protected_window}
    started = time.perf_counter()
    kvc = kvcompress.LLM(model, kv_compress=True, kv_cache_dtype=kv_cache_dtype, **kv_kwargs, **args)
    log(f"kvcompress engine up in {time.perf_counter() - started:.0f} s")
    runs: dict[float, dict] = {}
    try:
        stats = page_stats(kvc)
        pool = {"pages": stats["num_pages"], "block_size": stats["block_size"],
                "kv_cache_memory_bytes": args["kv_cache_memory_bytes"]}
        for rate in rates:
            extra = {"kv_compress_rate": rate}
            run = _generate(kvc, prompts, [params(extra) for _ in prompts], track_pages=True)
            _score(prompts, run)
            run["rate"] = rate
            run["pct_of_stock"] = (
                100.0 * run["num_found"] / stock_run["num_found"] if stock_run["num_found"] else None
            )
            pages = run["pages_after_compression"]
            run["pages_held_mean"] = _mean([p and p["pages_held"] for p in pages])
            run["full_pages_mean"] = _mean([p and p["full_pages"] for p in pages])
            run["kvs_held_fraction_mean"] = _mean(
                [p and p["kvs_held"] / p["full_kvs"] for p in pages]
            )
            runs[rate] = run
            log(f"kvcompress rate {rate:g}: {run['num_found']}/{len(prompts)} in {run['seconds']:.0f} s")
    finally:
        shutdown(kvc)

    rate1 = runs.get(1.0)
    return {
        "config": {
            "model": f"{model_label(model)}, {args['dtype']}",
            "context_tokens": context_tokens,
            "depths": list(depths),
            "trials": trials,
            "rates": rates,
            "max_tokens": max_tokens,
            "seed": seed,
            "prompt_format": prompt_format,
            "protected_window": protected_window,
            "engine_args": args,
            "kvcompress_kv_cache_dtype": kv_cache_dtype,
            "stock_kv_cache_dtype": stock_dtype,
        },
        "prompts": [
            {k: v for k, v in p.items() if k != "prompt_token_ids"} for p in prompts
        ],
        "stock": stock_run,
        "kvcompress": runs,
        "kvcompress_pool": pool,
        "rate1_identical": None if rate1 is None else rate1["token_ids"] == stock_run["token_ids"],
        "wall_seconds": time.perf_counter() - wall,
    }


# --------------------------------------------------------------------------------------
# Report


def format_table(results: dict) -> str:
    config, stock, prompts = results["config"], results["stock"], results["prompts"]
    total = len(prompts)
    lines = [
        f"passkey retrieval: {config['model']}",
        f"{total} prompts ({len(config['depths'])} depths x {config['trials']} trials), "
        f"{min(p['prompt_tokens'] for p in prompts)}-{max(p['prompt_tokens'] for p in prompts)} "
        f"tokens, {config['prompt_format']} format, greedy, {config['max_tokens']} output tokens",
        "",
        f"{'engine':<12} {'rate':>5} {'found':>7} {'accuracy':>9} {'% stock':>8} "
        f"{'pages held':>11} {'full pages':>11} {'KVs kept':>9} {'evictions':>10} {'seconds':>8}",
        f"{'stock vLLM':<12} {'-':>5} {stock['num_found']:>3}/{total:<3} "
        f"{stock['accuracy']:>9.2f} {100.0:>7.0f}% {'-':>11} {'-':>11} {'-':>9} {'-':>10} "
        f"{stock['seconds']:>8.0f}",
    ]
    for rate, run in results["kvcompress"].items():
        pct = "-" if run["pct_of_stock"] is None else f"{run['pct_of_stock']:.0f}%"
        held = "-" if run["pages_held_mean"] is None else f"{run['pages_held_mean']:.0f}"
        full = "-" if run["full_pages_mean"] is None else f"{run['full_pages_mean']:.0f}"
        kept = "-" if run["kvs_held_fraction_mean"] is None else f"{100 * run['kvs_held_fraction_mean']:.1f}%"
        lines.append(
            f"{'kvcompress':<12} {float(rate):>5g} {run['num_found']:>3}/{total:<3} "
            f"{run['accuracy']:>9.2f} {pct:>8} {held:>11} {full:>11} {kept:>9} "
            f"{run['compressions']:>10} {run['seconds']:>8.0f}"
        )
    lines.append("")
    depth_line = ["found by depth:"]
    for depth in config["depths"]:
        idx = [i for i, p in enumerate(prompts) if p["depth"] == depth]
        cells = [f"stock {sum(stock['found'][i] for i in idx)}/{len(idx)}"]
        for rate, run in results["kvcompress"].items():
            cells.append(f"r{float(rate):g} {sum(run['found'][i] for i in idx)}/{len(idx)}")
        depth_line.append(f"  depth {depth:g}: " + ", ".join(cells))
    lines.extend(depth_line)
    cache_dtype = config.get("kvcompress_kv_cache_dtype", "auto")
    stock_dtype = config.get("stock_kv_cache_dtype", "auto")
    if cache_dtype != stock_dtype:
        lines.append(f"kvcompress pages: --kv-cache-dtype {cache_dtype}; stock: the model's dtype "
                     "(rate 1 is not expected to be token-identical)")
    elif cache_dtype != "auto":
        lines.append(f"kvcompress and stock: --kv-cache-dtype {cache_dtype}")
    pool = results.get("kvcompress_pool")
    if pool:
        lines.append(f"kvcompress pool: {pool['pages']} pages of {pool['block_size']} KV slots (one layer, "
                     f"one KV head each) in --kv-cache-memory-bytes {pool['kv_cache_memory_bytes']}")
    identical = results["rate1_identical"]
    if identical is not None:
        lines.append(
            "rate 1 outputs token-identical to stock vLLM: " + ("yes" if identical else "NO")
        )
    lines.append(
        "pages held: per-(layer, KV head) pages (--kv-compress-block-size tokens each) while decoding, just after "
        "the prompt was compressed, mean over prompts; full: the same uncompressed; "
        "KVs kept: of the full cache; evictions: compressions that freed pages"
    )
    lines.append(f"wall time: {results['wall_seconds']:.0f} s")
    return "\n".join(lines)


def write_plot(results: dict, path: str) -> str | None:
    """Accuracy and KVs kept by engine and rate (``path``, a PNG); None without matplotlib."""
    runs = results["kvcompress"]
    labels = ["stock"] + [f"r={float(rate):g}" for rate in runs]
    accuracy = [results["stock"]["accuracy"]] + [run["accuracy"] for run in runs.values()]
    kept = [1.0] + [run["kvs_held_fraction_mean"] or 0.0 for run in runs.values()]
    config = results["config"]
    title = (f"passkey retrieval, ~{config['context_tokens']} tokens, "
             f"{len(results['prompts'])} prompts, kvcompress vs stock vLLM")
    return two_bar_charts(path, labels, (accuracy, "passkeys found"),
                          (kept, "KVs kept (fraction of full)"), title, left_ylim=1.05)


def summary_line(results: dict) -> str:
    """One line: what was found at each rate, against stock."""
    total = len(results["prompts"])
    parts = [f"stock {results['stock']['num_found']}/{total}"] + [
        f"r{float(rate):g} {run['num_found']}/{total}" for rate, run in results["kvcompress"].items()
    ]
    return "summary: passkeys found: " + ", ".join(parts) + f"; rate 1 identical to stock: {results['rate1_identical']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context-tokens", type=int, default=3000)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--trials", type=int, default=3, help="prompts per depth")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="plain")
    parser.add_argument("--protected-window", type=int, default=None,
                        help="kvcompress protected window (default: the server default, 64)")
    parser.add_argument("--show-outputs", action="store_true", help="print every answer")
    parser.add_argument("--json", default=None, help="also write the results here (and a PNG beside it)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                        help="kvcompress's pages; stock's too where vLLM's CPU kernel takes FP8 "
                             "(AVX-512 / AMX), else the model's dtype")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype in both engines (bfloat16: the pages too, unless --kv-cache-dtype)")
    parser.add_argument("--model", default=None,
                        help="a model directory, or 'gemma3' (Gemma 3 270M, offline); default SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    model = None if args.model is None else named_checkpoint(args.model)
    results = run_passkey(
        context_tokens=args.context_tokens, depths=args.depths, rates=args.rates,
        trials=args.trials, max_tokens=args.max_tokens, seed=args.seed,
        prompt_format=args.prompt_format, protected_window=args.protected_window, model=model,
        kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, log=lambda message: print(message, file=sys.stderr, flush=True),
    )
    if args.show_outputs:
        for i, prompt in enumerate(results["prompts"]):
            answers = [f"stock {results['stock']['texts'][i]!r}"] + [
                f"r{float(rate):g} {run['texts'][i]!r}" for rate, run in results["kvcompress"].items()
            ]
            print(f"depth {prompt['depth']:g} trial {prompt['trial']} key {prompt['key']}: "
                  + " | ".join(answers))
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
        png = write_plot(results, str(Path(args.json).with_suffix(".png")))
        if png:
            print(f"plot: {png}")
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
