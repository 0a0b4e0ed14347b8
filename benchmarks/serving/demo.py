"""Demo: what KV-Compress buys, on a real model (SmolLM2-135M-Instruct, float32, CPU).

The same long-document questions (Paul Graham essays of ~2K tokens, each with one
"special magic number" hidden in it, then the question; RULER's single-needle task) go to
stock vLLM and to kvcompress at compression rates 1, 4 and 8, under the SAME KV memory
(``kv_cache_memory_bytes``, by default room for about three uncompressed documents).
Per engine it prints:

- KV held per request: stock holds every token's K and V in its blocks (128 tokens on
  CPU); kvcompress holds its per-(layer, KV head) pages, read from its scheduler after
  each prompt was compressed (the fewest pages a request held while decoding);
- max concurrent requests: the most requests decoding in one engine step;
- output tokens/s: output tokens over the wall time of that engine's own run
  (prefill included; no subtraction of separately timed runs; kvcompress's runs also
  read its page counts after every step, their cost kept in the JSON);
- the answers, next to the expected numbers.

One stock ``vllm.LLM`` answers all documents and is shut down; then one
``kvcompress.LLM`` answers them once per rate (the rate set per request, the
``vllm_xargs`` field ``kv_compress_rate``). Rate 1 evicts nothing: its answers must equal
stock's token for token. The engine cores run in this process so each step's schedule can
be read (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Writes ``OUT.md``, ``OUT.json`` and
``OUT.png`` (``--out``, default ``demo-smollm2`` in the current directory).

    python benchmarks/serving/demo.py                     # ~3 min on 2 cores once SmolLM2 is cached
    python benchmarks/serving/demo.py --documents 4 --rates 1 8 --length 1024
    python benchmarks/serving/demo.py --model gemma3 --dtype bfloat16 --kv-cache-dtype fp8

``--dtype`` / ``--kv-cache-dtype`` set the model's dtype and the pages' (stock takes the same
FP8 cache where vLLM's CPU kernel does); ``--kv-documents`` counts documents in the pages'
dtype, so each dtype meets the same pressure, and the report gives the pool's bytes per slot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.common.engine_args import eager_float32_engine_args  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the tables are the point; VLLM_LOGGING_LEVEL=INFO for more

DEFAULT_OUT = "demo-smollm2"
ENGINE_ARGS = eager_float32_engine_args(max_num_batched_tokens=1024)  # chunked prefill


@dataclass
class EngineRun:
    """One engine's answers to every document, and what it held and how fast."""

    label: str
    rate: float | None  # None: stock vLLM
    answers: list[str]
    token_ids: list[list[int]]
    correct: list[bool]
    seconds: float
    output_tokens: int
    max_concurrent: int
    kv_bytes_per_request: float  # mean over documents, once the prompt is in (compressed)
    preempted: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# --------------------------------------------------------------------------------------
# Documents


def build_documents(tokenizer, count: int, length: int, seed: int) -> list[dict]:
    """``count`` single-needle documents of at most ``length`` tokens (eval_quality's
    ``niah_single`` samples, needle depths spread evenly); each has
    ``prompt_token_ids``, ``prompt_tokens`` and ``answers`` (the expected number)."""
    from benchmarks.quality.eval_quality import build_samples
    from benchmarks.common.offline_assets import paul_graham_essays

    return build_samples(tokenizer, paul_graham_essays(), ["niah_single"], [length], count, seed)


def answer_text(tokenizer, token_ids: list[int]) -> str:
    """The answer: the output up to the model's first end-of-sequence token (requests
    run on past it, ``ignore_eos``, so every engine does the same decode work)."""
    eos = tokenizer.eos_token_id
    end = token_ids.index(eos) if eos in token_ids else len(token_ids)
    return tokenizer.decode(token_ids[:end], skip_special_tokens=True)


# --------------------------------------------------------------------------------------
# Running one batch


class PageTracker:
    """Per request, the fewest KV pages held while decoding (just after its prompt was
    compressed), read from kvcompress's scheduler after every step."""

    def __init__(self, llm) -> None:
        from kvcompress.vllm_glue.llm import page_stats

        self.read = lambda: page_stats(llm)
        self.fewest: dict[str, int] = {}
        self.block_size = self.read()["block_size"]
        self.seconds = 0.0  # spent reading, inside the timed run (counted against kvcompress)

    def after_step(self, prompt_lens: dict[str, int]) -> None:
        started = time.perf_counter()
        for request_id, held in self.read()["requests"].items():
            if request_id in prompt_lens and held["logical_len"] > prompt_lens[request_id]:
                previous = self.fewest.get(request_id, held["pages_held"])
                self.fewest[request_id] = min(previous, held["pages_held"])
        self.seconds += time.perf_counter() - started


def run_documents(llm, documents, output_tokens: int, extra_args, desc: str,
                  track_pages: bool) -> dict[str, Any]:
    """Add every document as a request generating ``output_tokens`` (greedy,
    ``ignore_eos``), step the engine until all finished (a tqdm bar of finished
    requests); output token ids, wall time, max decode batch and, with
    ``track_pages``, each request's fewest pages held while decoding."""
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.throughput.benchmark_throughput import StepLog

    engine = llm.llm_engine
    log = getattr(llm, "_demo_step_log", None) or StepLog(llm)
    llm._demo_step_log = log
    tracker = PageTracker(llm) if track_pages else None
    tag = f"d{time.monotonic_ns()}"
    prompt_lens, index_of = {}, {}
    started = time.perf_counter()
    for index, document in enumerate(documents):
        params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True,
                                extra_args=extra_args)
        request_id = engine.add_request(
            f"{tag}-{index}", TokensPrompt(prompt_token_ids=document["prompt_token_ids"]), params
        )
        prompt_lens[request_id] = document["prompt_tokens"]
        index_of[request_id] = index
    log.take()
    outputs: list[Any] = [None] * len(documents)
    max_concurrent = 0
    with tqdm(total=len(documents), desc=desc, unit="doc", file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[int(output.request_id.rsplit("-", 1)[1])] = output.outputs[0]
                    bar.update(1)
            _, decode_rows = log.take()
            max_concurrent = max(max_concurrent, decode_rows)
            if tracker:
                tracker.after_step(prompt_lens)
    seconds = time.perf_counter() - started
    result = {
        "token_ids": [list(o.token_ids) for o in outputs],
        "seconds": seconds,
        "max_concurrent": max_concurrent,
    }
    if tracker:
        result["pages_held"] = [tracker.fewest.get(rid) for rid in sorted(index_of, key=index_of.get)]
        result["block_size"] = tracker.block_size
        result["page_reading_seconds"] = tracker.seconds
    return result


# --------------------------------------------------------------------------------------
# The two engines


@dataclass
class Workload:
    """What every engine gets: the model, the documents, the engine arguments (the same
    KV memory) and the per-token sizes the report needs."""

    model: str
    tokenizer: Any
    documents: list[dict]
    output_tokens: int
    engine_args: dict
    bytes_per_token: int  # uncompressed K and V of one token, all layers and KV heads (kvcompress's pages)
    head_token_bytes: int  # K and V of one token of one (layer, KV head)
    kv_cache_dtype: str  # kvcompress's pages
    stock_kv_cache_dtype: str  # stock's cache: the same where vLLM's CPU kernel takes it
    stock_bytes_per_token: int  # bytes_per_token in stock's cache dtype

    def stock_kv_bytes(self, block_size: int) -> float:
        """What stock vLLM holds per request once its prompt is in: whole blocks of every
        prompt token and the first output token (mean over documents)."""
        held = [math.ceil((d["prompt_tokens"] + 1) / block_size) * block_size * self.stock_bytes_per_token
                for d in self.documents]
        return sum(held) / len(held)

    def engine_run(self, label: str, rate: float | None, run: dict, kv_bytes: float) -> EngineRun:
        from benchmarks.quality.eval_quality import score

        answers = [answer_text(self.tokenizer, ids) for ids in run["token_ids"]]
        return EngineRun(
            label=label, rate=rate, answers=answers, token_ids=run["token_ids"],
            correct=[score(d["answers"], a) == 1.0 for d, a in zip(self.documents, answers)],
            seconds=run["seconds"], output_tokens=sum(map(len, run["token_ids"])),
            max_concurrent=run["max_concurrent"], kv_bytes_per_request=kv_bytes,
        )


def stock_run(work: Workload, log) -> EngineRun:
    from vllm import LLM

    from kvcompress.vllm_glue.llm import shutdown

    started = time.perf_counter()
    llm = LLM(model=work.model, kv_cache_dtype=work.stock_kv_cache_dtype, **work.engine_args)
    log(f"stock vLLM engine (--kv-cache-dtype {work.stock_kv_cache_dtype}) up in {time.perf_counter() - started:.0f} s")
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    try:
        run_documents(llm, work.documents[:1], 4, None, "stock vLLM: warm-up", False)
        run = run_documents(llm, work.documents, work.output_tokens, None, "stock vLLM: answering", False)
    finally:
        shutdown(llm)
    stock = work.engine_run("stock vLLM", None, run, work.stock_kv_bytes(block_size))
    stock.extra = {"block_size": block_size}
    return stock


def kvcompress_runs(work: Workload, rates, log) -> list[EngineRun]:
    """One kvcompress engine, the documents once per rate (set per request)."""
    import kvcompress
    from kvcompress.vllm_glue.llm import page_stats, shutdown

    started = time.perf_counter()
    llm = kvcompress.LLM(work.model, kv_compress=True, kv_cache_dtype=work.kv_cache_dtype, **work.engine_args)
    log(f"kvcompress engine (--kv-cache-dtype {work.kv_cache_dtype}) up in {time.perf_counter() - started:.0f} s")
    runs = []
    try:
        pool = page_stats(llm)
        pool = {"pages": pool["num_pages"], "block_size": pool["block_size"]}
        run_documents(llm, work.documents[:1], 4, {"kv_compress_rate": 1}, "kvcompress: warm-up", False)
        for rate in rates:
            label = f"kvcompress rate {rate:g}"
            before = page_stats(llm)
            run = run_documents(llm, work.documents, work.output_tokens, {"kv_compress_rate": rate},
                                f"{label}: answering", True)
            after = page_stats(llm)
            page_bytes = run["block_size"] * work.head_token_bytes  # one (layer, KV head) page
            held = [pages * page_bytes for pages in run["pages_held"] if pages is not None]
            engine_run = work.engine_run(label, rate, run, sum(held) / max(1, len(held)))
            engine_run.preempted = after["num_preemptions"] - before["num_preemptions"]
            engine_run.extra = {"pool": pool, "pages_freed": after["pages_freed"] - before["pages_freed"],
                                "mismatches": after["mismatches"],
                                "page_reading_seconds": run["page_reading_seconds"]}
            runs.append(engine_run)
            log(f"{label}: {sum(engine_run.correct)}/{len(engine_run.correct)} answers right, "
                f"{run['seconds']:.0f} s")
    finally:
        shutdown(llm)
    return runs


# --------------------------------------------------------------------------------------
# Report


def _short(text: str, width: int = 22) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def summary_table(runs: list[EngineRun]) -> list[str]:
    stock = runs[0]
    lines = [
        "| engine | KV held per request | max concurrent requests | output tokens/s | wall s | answers right |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        share = run.kv_bytes_per_request / stock.kv_bytes_per_request
        lines.append(
            f"| {run.label} | {run.kv_bytes_per_request / 2**20:.1f} MiB ({share:.0%}) "
            f"| {run.max_concurrent} ({run.max_concurrent / max(1, stock.max_concurrent):.1f}x) "
            f"| {run.output_tokens_per_s:.1f} ({run.output_tokens_per_s / stock.output_tokens_per_s:.2f}x) "
            f"| {run.seconds:.0f} | {sum(run.correct)}/{len(run.correct)} |"
        )
    return lines


def answers_table(documents, runs: list[EngineRun]) -> list[str]:
    header = "| document | expected | " + " | ".join(r.label for r in runs) + " |"
    lines = [header, "| --- | --- |" + " --- |" * len(runs)]
    for i, document in enumerate(documents):
        cells = [f"{'ok' if r.correct[i] else 'WRONG'}: {_short(r.answers[i])}" for r in runs]
        lines.append(f"| {i + 1} ({document['prompt_tokens']} tokens) | {document['answers'][0]} | "
                     + " | ".join(cells) + " |")
    return lines


def write_plot(runs: list[EngineRun], path: str, model: str = "SmolLM2-135M") -> str | None:
    """Three bar charts: KV MiB per request, max concurrent requests, output tokens/s."""
    from benchmarks.common.plots import bar_panels

    labels = ["stock" if r.rate is None else f"kvc r{r.rate:g}" for r in runs]
    panels = [
        ([r.kv_bytes_per_request / 2**20 for r in runs], "KV held per request (MiB)"),
        ([r.max_concurrent for r in runs], "max concurrent requests"),
        ([r.output_tokens_per_s for r in runs], "output tokens/s"),
    ]
    answers = ", ".join(f"{label} {sum(r.correct)}/{len(r.correct)}" for label, r in zip(labels, runs))
    return bar_panels(path, labels, panels, f"{model} on CPU, same KV memory; answers right: {answers}")


def summary_line(runs: list[EngineRun]) -> str:
    stock, best = runs[0], runs[-1]
    return (
        f"summary: {best.label} holds {best.kv_bytes_per_request / stock.kv_bytes_per_request:.0%} "
        f"of stock's KV per request, runs {best.max_concurrent} requests at once vs "
        f"{stock.max_concurrent}, {best.output_tokens_per_s / stock.output_tokens_per_s:.2f}x "
        f"stock's output tokens/s, answers right {sum(best.correct)}/{len(best.correct)} "
        f"(stock {sum(stock.correct)}/{len(stock.correct)})"
    )


# --------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=8, help="documents (one request each)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per document, question included")
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="tokens each request generates (ignore_eos; the answer is the text "
                             "before the first end-of-sequence token)")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 4, 8])
    parser.add_argument("--kv-documents", type=float, default=3.0,
                        help="KV memory of both engines, in uncompressed documents (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (SmolLM2-135M-Instruct), 'gemma3' (Gemma 3 270M: sliding-window "
                             "layers), or a model directory")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype in both engines (and the pages', unless --kv-cache-dtype)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                        help="kvcompress's pages; stock's cache too where vLLM's CPU kernel takes FP8 "
                             "(AVX-512 / AMX), else the model's dtype. --kv-documents counts documents "
                             "in this dtype, so both dtypes face the same pressure")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="writes OUT.md (the tables), OUT.json (every figure and answer), OUT.png")
    args = parser.parse_args(argv)
    if args.documents < 1 or args.length < 256 or args.output_tokens < 16:
        parser.error("--documents >= 1, --length >= 256, --output-tokens >= 16")
    if args.kv_documents * args.length < args.length + args.output_tokens:
        parser.error("--kv-documents must leave room for one whole request (document + output)")
    if any(r < 1 for r in args.rates):
        parser.error("--rates must be >= 1")
    return args


def prepare(args, log) -> Workload:
    from transformers import AutoTokenizer

    from benchmarks.common.engine_args import stock_cache_dtype
    from benchmarks.common.offline_assets import named_checkpoint
    from benchmarks.throughput.benchmark_throughput import kv_bytes_per_token, kv_shape

    model = named_checkpoint(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    documents = build_documents(tokenizer, args.documents, args.length, args.seed)
    shape = kv_shape(model)
    bytes_per_token = kv_bytes_per_token(shape, args.dtype, args.kv_cache_dtype)
    stock_dtype = stock_cache_dtype(args.kv_cache_dtype)
    kv_bytes = int(args.kv_documents * args.length * bytes_per_token)
    engine_args = {**ENGINE_ARGS, "dtype": args.dtype, "kv_cache_memory_bytes": kv_bytes,
                   "max_model_len": args.length + args.output_tokens, "max_num_seqs": args.documents}
    log(f"{len(documents)} documents of {min(d['prompt_tokens'] for d in documents)}-"
        f"{max(d['prompt_tokens'] for d in documents)} tokens, {args.output_tokens} output tokens each; "
        f"KV memory of each engine {kv_bytes / 2**20:.0f} MiB = {kv_bytes // bytes_per_token} "
        f"uncompressed tokens ({bytes_per_token // 1024} KiB per token)")
    return Workload(model=model, tokenizer=tokenizer, documents=documents,
                    output_tokens=args.output_tokens, engine_args=engine_args,
                    bytes_per_token=bytes_per_token,
                    head_token_bytes=bytes_per_token // (shape["num_layers"] * shape["num_kv_heads"]),
                    kv_cache_dtype=args.kv_cache_dtype, stock_kv_cache_dtype=stock_dtype,
                    stock_bytes_per_token=kv_bytes_per_token(shape, args.dtype, stock_dtype))


def report(work: Workload, runs: list[EngineRun], args, wall: float) -> None:
    from benchmarks.throughput.benchmark_throughput import machine_description

    rate1 = next((r for r in runs[1:] if r.rate == 1), None)
    lines = [
        f"{len(work.documents)} documents of ~{args.length} tokens, {args.output_tokens} output tokens "
        f"each, KV memory {work.engine_args['kv_cache_memory_bytes'] / 2**20:.0f} MiB for every engine; "
        f"{machine_description()}", "",
        *summary_table(runs), "", *answers_table(work.documents, runs),
    ]
    pool = next((r.extra["pool"] for r in runs[1:] if "pool" in r.extra), None)
    if pool:
        kv_bytes = work.engine_args["kv_cache_memory_bytes"]
        lines += ["", f"model {args.dtype}; --kv-cache-dtype: kvcompress {work.kv_cache_dtype}, stock "
                  f"{work.stock_kv_cache_dtype}; kvcompress pool: {pool['pages']} pages of {pool['block_size']} "
                  f"slots (one layer, one KV head each) in {kv_bytes} bytes = "
                  f"{kv_bytes / (pool['pages'] * pool['block_size']):.1f} bytes per (layer, head) slot"]
    if rate1 is not None:
        lines += ["", f"rate 1 (nothing evicted) token-identical to stock: {rate1.token_ids == runs[0].token_ids}"]
    print("\n" + "\n".join(lines))
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({
        "args": vars(args), "engine_args": work.engine_args, "machine": machine_description(),
        "documents": [{k: d[k] for k in ("prompt_tokens", "answers", "depth")} for d in work.documents],
        "runs": [asdict(r) for r in runs], "wall_seconds": time.perf_counter() - wall,
    }, indent=1))
    written = [f"{args.out}.md", f"{args.out}.json"]
    if write_plot(runs, f"{args.out}.png", "SmolLM2-135M" if args.model == "smollm2" else Path(work.model).name):
        written.append(f"{args.out}.png")
    print(f"\nwrote {', '.join(written)}; done in {time.perf_counter() - wall:.0f} s")
    print(summary_line(runs))


def main(argv=None) -> list[EngineRun]:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from benchmarks.throughput.benchmark_throughput import engine_core_in_process

    wall = time.perf_counter()
    log = lambda message: print(message, flush=True)  # noqa: E731
    log(f"[1/3] the model ({args.model}) and the documents (fetched and converted once, then cached)")
    work = prepare(args, log)
    with engine_core_in_process():
        log("[2/3] stock vLLM")
        runs = [stock_run(work, log)]
        log(f"stock vLLM: {sum(runs[0].correct)}/{len(runs[0].correct)} answers right, {runs[0].seconds:.0f} s")
        log(f"[3/3] kvcompress at rates {', '.join(f'{r:g}' for r in args.rates)}, same KV memory")
        runs += kvcompress_runs(work, args.rates, log)
    report(work, runs, args, wall)
    return runs


if __name__ == "__main__":
    main()
