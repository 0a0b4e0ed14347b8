"""kvcompress past one device: `vllm serve` with tensor parallelism on one node and on
two "nodes" (both on 127.0.0.1, vLLM's multi-node mp launch), and data parallelism.

Each layout serves the same concurrent completions twice (tiny random GQA Llama,
token-id prompts, greedy, under a small KV pool): at the server's rate 8, and at rate 1
per request (``vllm_xargs``). Checked from the outside: every request answered in full,
compressions on every engine, no page mismatch between the scheduler and any rank
(``kvcompress:page_mismatches_total``), every page free at the end
(``kvcompress:pages_free`` = ``pages_total``, summed over ranks), the TP=2 layouts
give the same tokens at rate 8 (same model, same ranks, another launch or executor), and at rate 1
(nothing evicted) the same tokens as stock vLLM served at TP=2 (layout ``stock-tp2``). Layout ``tp2-ray`` is TP=2 on vLLM's Ray executor
(``--distributed-executor-backend ray``; a Ray cluster of its own, started by the engine).

    python benchmarks/serving/distributed_check.py            # all five layouts, ~4 min on 2 cores
    python benchmarks/serving/distributed_check.py --layouts tp2 tp2-two-nodes

On real nodes the two-node layout is the same two commands, each on its own machine:
``vllm serve MODEL --tensor-parallel-size 2 --nnodes 2 --node-rank 0 --master-addr HEAD_IP
--master-port P --kv-compress-rate 8`` on the head, and the same with ``--node-rank 1
--headless`` on the other node (their ``VLLM_CPU_OMP_THREADS_BIND`` left to vLLM there: one
worker per node). Nothing here leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

HOST = "127.0.0.1"
LAYOUTS = {
    # name: [(extra flags, environment) per process]; the first process serves HTTP.
    "tp2": [(["--tensor-parallel-size", "2"], {})],
    "tp2-two-nodes": [
        (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
          "--master-addr", HOST, "--master-port", "{master_port}"], {"VLLM_CPU_OMP_THREADS_BIND": "0"}),
        (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
          "--master-addr", HOST, "--master-port", "{master_port}", "--headless"],
         {"VLLM_CPU_OMP_THREADS_BIND": "1"}),
    ],
    # vLLM's Ray executor (RayExecutorV2; on CPU through patches/ray_cpu.py), on a Ray
    # cluster of its own that the engine starts and stops.
    "tp2-ray": [(["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
                 {"RAY_ADDRESS": "local"})],
    "dp2": [(["--data-parallel-size", "2"], {})],
    "stock-tp2": [(["--tensor-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})],
}
STOCK = "stock-tp2"
ENGINES = {"tp2": 1, "tp2-two-nodes": 1, "tp2-ray": 1, "dp2": 2}  # engines that must compress


def tiny_model() -> str:
    from benchmarks.common.offline_assets import tiny_llama_checkpoint

    return str(tiny_llama_checkpoint(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64))


def _vllm() -> str:
    return str(Path(sys.executable).with_name("vllm"))


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://{HOST}:{port}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return json.loads(urllib.request.urlopen(request, timeout=600).read())


def _metrics(port: int) -> tuple[dict[str, float], int]:
    """From one scrape of ``/metrics``: the kvcompress series summed over engines (and
    labels), and how many engines ordered a compression."""
    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=60).read().decode()
    sums: dict[str, float] = {}
    compressing = set()
    for line in text.splitlines():
        if not line.startswith("kvcompress:"):
            continue
        name = line.split("{")[0].split(" ")[0]
        value = float(line.rsplit(" ", 1)[1])
        sums[name] = sums.get(name, 0.0) + value
        if name == "kvcompress:compressions_total" and value:
            compressing.add(line.split('engine="')[1].split('"')[0])
    return sums, len(compressing)


def run_layout(name: str, model: str, port: int, requests: list[dict], log_dir: Path) -> dict:
    common = ["--host", HOST, "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "1024",
              "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(1200 * 4096), "--enforce-eager"]
    if name != STOCK:
        common += ["--kv-compress-rate", "8", "--kv-compress-protected-window", "16"]
    master_port = str(port + 100)
    processes = []
    started = time.perf_counter()
    try:
        for index, (flags, env) in enumerate(LAYOUTS[name]):
            flags = [f.replace("{master_port}", master_port) for f in flags]
            serve = [_vllm(), "serve", model, *common, *flags]
            if index == 0:
                serve += ["--port", str(port)]
            log = open(log_dir / f"{name}-{index}.log", "w")
            processes.append(subprocess.Popen(serve, env={**os.environ, **env}, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5)
                break
            except OSError:
                if time.time() > deadline or any(p.poll() is not None for p in processes):
                    raise RuntimeError(f"{name}: the server did not come up (logs in {log_dir})")
                time.sleep(2)
        start_seconds = time.perf_counter() - started
        def serve(batch):
            with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                answers = pool.map(lambda body: _post(port, {**body, "model": model}), batch)
                return [answer["choices"][0]["token_ids"] for answer in answers]

        if name == STOCK:  # nothing evicted: the reference for the rate-1 tokens
            return {"layout": name, "start_seconds": round(start_seconds, 1), "tokens_rate_one": serve(requests)}
        tokens = serve(requests)
        tokens_rate_one = serve([{**body, "vllm_xargs": {"kv_compress_rate": 1}} for body in requests])
        metrics, engines_compressing = _metrics(port)
        return {
            "layout": name,
            "start_seconds": round(start_seconds, 1),
            "tokens": tokens,
            "tokens_rate_one": tokens_rate_one,
            "compressions": metrics.get("kvcompress:compressions_total", 0.0),
            "engines_compressing": engines_compressing,
            "page_mismatches": metrics.get("kvcompress:page_mismatches_total", 0.0),
            "pages_total": metrics.get("kvcompress:pages_total", 0.0),
            "pages_free": metrics.get("kvcompress:pages_free", 0.0),
        }
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def make_requests(count: int, max_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt": [rng.randint(3, 1000) for _ in range(rng.randint(200, 700))], "max_tokens": max_tokens,
         "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        for _ in range(count)
    ]


def check(results: list[dict], requests: list[dict], engines: dict[str, int]) -> list[str]:
    """Problems found (empty: every check holds)."""
    problems = []
    by_name = {r["layout"]: r for r in results}
    stock = by_name.get(STOCK)
    for result in results:
        name = result["layout"]
        if name == STOCK:
            continue
        if stock is not None and name.startswith("tp2") and result["tokens_rate_one"] != stock["tokens_rate_one"]:
            problems.append(f"{name}: tokens at rate 1 differ from stock vLLM's at TP=2")
        lengths = [len(tokens or []) for tokens in result["tokens"]]
        if lengths != [body["max_tokens"] for body in requests]:
            problems.append(f"{name}: answers of {lengths} tokens")
        if result["engines_compressing"] < engines[name]:
            problems.append(f"{name}: {result['engines_compressing']} of {engines[name]} engines compressed")
        if result["page_mismatches"]:
            problems.append(f"{name}: {result['page_mismatches']:g} page mismatches")
        if result["pages_free"] != result["pages_total"]:
            problems.append(f"{name}: {result['pages_free']:g} of {result['pages_total']:g} pages free")
    for other in ("tp2-two-nodes", "tp2-ray"):
        if "tp2" in by_name and other in by_name and by_name["tp2"]["tokens"] != by_name[other]["tokens"]:
            problems.append(f"tp2 and {other} gave different tokens")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--log-dir", default="/tmp/kvcompress-distributed-check")
    args = parser.parse_args(argv)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    model = tiny_model()
    requests = make_requests(args.requests, args.max_tokens)
    results = []
    for name in args.layouts:
        result = run_layout(name, model, args.port, requests, log_dir)
        results.append(result)
        if name == STOCK:
            print(f"{name}: up in {result['start_seconds']} s; {len(result['tokens_rate_one'])} answers", flush=True)
            continue
        print(f"{name}: up in {result['start_seconds']} s; {len(result['tokens'])} answers; "
              f"{result['compressions']:g} compressions on {result['engines_compressing']} engine(s); "
              f"page mismatches {result['page_mismatches']:g}; pages free {result['pages_free']:g} of "
              f"{result['pages_total']:g}", flush=True)
    problems = check(results, requests, ENGINES)
    for problem in problems:
        print(f"FAILED: {problem}")
    if not problems:
        print("all checks hold")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
