"""vLLM's own serving benchmark (``vllm bench serve``) against ``vllm serve``: stock vLLM vs
``--kv-compress-rate 4`` and ``8``, same model, flags and KV memory (CPU, SmolLM2-135M-Instruct).

The dataset is long prompts of real text: the demo's documents (Paul Graham essays of ~2K
tokens, each hiding a "special magic number", then the question; eval_quality's
``niah_single``) written as a ``custom`` JSONL dataset and sent as plain completions
(``--skip-chat-template``), ``--ignore-eos`` so every server generates the same
``--output-len`` tokens, greedy. Requests arrive all at once by default (``--request-rate
inf``). Each server gets ``--kv-cache-memory-bytes`` for ``--kv-documents`` uncompressed
documents (default 3). While the benchmark runs, the server's ``/metrics`` is polled every
0.5 s for the most requests running at once (``vllm:num_requests_running``).

Servers are started one at a time on 127.0.0.1 (a free port); ``--repeats N`` runs every
configuration N times, the order reversed on every other repetition, and reports each
configuration's median-throughput run (all runs in the JSON). Writes ``OUT.md``,
``OUT.json`` and ``OUT.png``; needs ``pandas`` (vLLM reads the JSONL with it: ``pip install
pandas``).

    python benchmarks/throughput/bench_serve.py                        # ~12 min on 2 cores (2 repeats)
    python benchmarks/throughput/bench_serve.py --num-prompts 8 --repeats 1 --rates 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

DEFAULT_OUT = "benchmarks/results/bench-serve-smollm2-cpu"
PERCENTILES = "50,90,99"
SERVER_FLAGS = [
    "--dtype", "float32", "--no-enable-prefix-caching", "--served-model-name", "smollm2",
    "--max-num-batched-tokens", "1024",
]  # fmt: skip
METRICS = (  # (bench serve result key, column)
    ("request_throughput", "requests/s"),
    ("output_throughput", "output tokens/s"),
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p90_ttft_ms", "TTFT p90 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"),
    ("p90_tpot_ms", "TPOT p90 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
)


def write_dataset(path: Path, model: str, count: int, length: int, seed: int) -> list[int]:
    """``count`` documents as ``{"prompt": text}`` lines; returns their token counts."""
    from transformers import AutoTokenizer

    from benchmarks.serving.demo import build_documents

    tokenizer = AutoTokenizer.from_pretrained(model)
    documents = build_documents(tokenizer, count, length, seed)
    with open(path, "w") as handle:
        for document in documents:
            handle.write(json.dumps({"prompt": tokenizer.decode(document["prompt_token_ids"])}) + "\n")
    return [d["prompt_tokens"] for d in documents]


class RunningPoller:
    """The most ``vllm:num_requests_running`` seen on ``/metrics`` while active."""

    def __init__(self, base: str) -> None:
        self.base, self.peak, self._stop = base, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        from benchmarks.serving.soak import scrape_metrics

        while not self._stop.is_set():
            try:
                running = [v for k, v in scrape_metrics(self.base).items() if k.startswith("vllm:num_requests_running")]
                self.peak = max(self.peak, int(sum(running)))
            except Exception:  # a scrape during shutdown; the peak stays
                pass
            self._stop.wait(0.5)

    def __enter__(self) -> RunningPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def process_role(pid: int) -> str:
    """``api server`` (``vllm serve`` itself), ``engine core`` (``VLLM::EngineCore``: the
    scheduler), ``worker`` (``VLLM::Worker``: the model runner) or ``other``."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "EngineCore" in title:
        return "engine core"
    if "VLLM::Worker" in title:
        return "worker"
    return "api server" if " serve " in title else "other"


def cpu_seconds_by_role(root: int) -> dict[int, tuple[str, float]]:
    """``{pid: (role, user + system CPU seconds)}`` of ``root``'s process tree, now."""
    from benchmarks.serving.soak import proc_stat_fields, process_tree

    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in process_tree(root):
        fields = proc_stat_fields(pid)
        if fields is not None:  # utime, stime: proc(5)'s fields 14 and 15
            found[pid] = (process_role(pid), (int(fields[11]) + int(fields[12])) / ticks)
    return found


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between two :func:`cpu_seconds_by_role` snapshots."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return {role: round(value, 2) for role, value in sorted(spent.items())}


def serve_and_bench(label: str, rate: float | None, model: str, dataset: Path, args, work: Path) -> dict[str, Any]:
    """Start ``vllm serve`` (kvcompress at ``rate``, or stock), run ``vllm bench serve``
    against it, stop it; the bench's result JSON plus the peak running requests."""
    from benchmarks.serving.soak import Server, free_port, scrape_metrics

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    vllm = str(Path(sys.executable).parent / "vllm")
    command = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port), *SERVER_FLAGS,
               "--max-model-len", str(args.length + args.output_len + 64),
               "--kv-cache-memory-bytes", str(args.kv_bytes)]
    if rate is not None:
        command += ["--kv-compress-rate", f"{rate:g}"]
    tag = label.replace(" ", "-")
    server = Server(command, work / f"{tag}.log", dict(os.environ))
    try:
        started = time.monotonic()
        server.wait_healthy(base, args.startup_timeout)
        startup = time.monotonic() - started
        result_name = f"{tag}-{time.monotonic_ns()}.json"
        bench = [
            vllm, "bench", "serve", "--backend", "openai", "--base-url", base, "--model", "smollm2",
            "--tokenizer", model, "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--skip-chat-template", "--custom-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
            "--temperature", "0", "--seed", str(args.seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
            "--save-result", "--result-dir", str(work), "--result-filename", result_name,
        ]  # fmt: skip
        cpu_before = cpu_seconds_by_role(server.pid)
        client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with RunningPoller(base) as poller:
            done = subprocess.run(bench, capture_output=True, text=True, timeout=args.bench_timeout)
        client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = cpu_delta(cpu_before, cpu_seconds_by_role(server.pid))
        cpu["client"] = round(client_after.ru_utime + client_after.ru_stime
                              - client_before.ru_utime - client_before.ru_stime, 2)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({label}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result = json.loads((work / result_name).read_text())
        preemptions = int(scrape_metrics(base).get("vllm:num_preemptions_total", 0))
    except Exception:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop(timeout=60)
    keep = {key: result.get(key) for key in ("duration", "completed", "failed", "total_input_tokens",
                                              "total_output_tokens", "total_token_throughput",
                                              *(k for k, _ in METRICS))}
    return {"label": label, "rate": rate, "startup_s": round(startup, 1),
            "peak_running_requests": poller.peak, "preemptions": preemptions,
            "cpu_seconds": cpu, **keep}


def paired_ratios(runs: list[dict]) -> dict[str, list[float]]:
    """Per kvcompress configuration, its output tokens/s over stock's in the same
    repetition, one ratio per repetition (machines drift: only same-repetition pairs are
    compared)."""
    stock = {r["repeat"]: r["output_throughput"] for r in runs if r["rate"] is None}
    ratios: dict[str, list[float]] = {}
    for run in runs:
        if run["rate"] is not None and stock.get(run["repeat"]):
            ratios.setdefault(run["label"], []).append(run["output_throughput"] / stock[run["repeat"]])
    return ratios


def median_runs(runs: list[dict]) -> list[dict]:
    """Per configuration (in first-seen order), the run with the median output tokens/s."""
    labels = list(dict.fromkeys(r["label"] for r in runs))
    chosen = []
    for label in labels:
        mine = sorted((r for r in runs if r["label"] == label), key=lambda r: r["output_throughput"])
        chosen.append(mine[(len(mine) - 1) // 2])
    return chosen


def table(rows: list[dict], ratios: dict[str, list[float]] | None = None) -> list[str]:
    """Markdown rows; ``ratios`` (:func:`paired_ratios`) adds the paired median ratio
    column (with every repetition's ratio)."""
    import statistics

    stock = rows[0]
    ratios = ratios or {}
    header = ["server", "peak running", "preemptions", *(column for _, column in METRICS),
              "x stock (paired median; per repeat)", "completed/failed"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [row["label"], str(row["peak_running_requests"]), str(row.get("preemptions", "-"))]
        for key, _ in METRICS:
            value = row[key]
            cell = f"{value:.2f}" if value < 10 else f"{value:.0f}"
            if key.endswith("throughput"):
                cell += f" ({value / stock[key]:.2f}x)"
            cells.append(cell)
        mine = ratios.get(row["label"])
        cells.append(f"{statistics.median(mine):.2f} ({', '.join(f'{r:.2f}' for r in mine)})" if mine else "-")
        cells.append(f"{row['completed']}/{row['failed']}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cpu_table(rows: list[dict]) -> list[str]:
    """CPU seconds per completed request of each process role during the benchmark
    (:func:`process_role`'s, and the benchmark client's), roles that spent none left out;
    runs from before this was recorded have none."""
    rows = [r for r in rows if r.get("cpu_seconds")]
    if not rows:
        return []
    roles = sorted({role for r in rows for role, seconds in r["cpu_seconds"].items() if seconds})
    lines = ["| server | " + " | ".join(f"{role} CPU s / request" for role in roles) + " |",
             "|" + " --- |" * (len(roles) + 1)]
    for row in rows:
        done = max(row["completed"], 1)
        cells = [f"{row['cpu_seconds'].get(role, 0.0) / done:.2f}" for role in roles]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return lines


def write_plot(rows: list[dict], path: str) -> str | None:
    from benchmarks.common.plots import bar_panels

    labels = ["stock" if r["rate"] is None else f"kvc r{r['rate']:g}" for r in rows]
    panels = [("output_throughput", "output tokens/s"), ("p50_ttft_ms", "TTFT p50 (ms)"),
              ("p50_tpot_ms", "TPOT p50 (ms)"), ("peak_running_requests", "peak running requests")]
    return bar_panels(path, labels, [([r[key] for r in rows], title) for key, title in panels],
                      "vllm bench serve, SmolLM2-135M on CPU, same KV memory")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[4, 8], help="kvcompress servers (stock always runs)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--length", type=int, default=2048, help="tokens per prompt (at most)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", default="inf", help="requests/s, or inf (all at once)")
    parser.add_argument("--kv-documents", type=float, default=3.0, help="KV memory, in uncompressed requests")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--bench-timeout", type=float, default=1800)
    parser.add_argument("--out", default=DEFAULT_OUT, help="writes OUT.md, OUT.json, OUT.png")
    args = parser.parse_args(argv)
    if any(r < 1 for r in args.rates) or args.repeats < 1 or args.num_prompts < 1:
        parser.error("--rates >= 1, --repeats >= 1, --num-prompts >= 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    try:
        import pandas  # noqa: F401  (vLLM's custom dataset reader)
    except ImportError:
        sys.exit("bench_serve: vllm bench serve's custom dataset needs pandas: pip install pandas")
    from tqdm import tqdm

    from benchmarks.throughput.benchmark_throughput import kv_bytes_per_token, kv_shape, machine_description
    from benchmarks.common.offline_assets import smollm2_checkpoint

    wall = time.perf_counter()
    model = str(smollm2_checkpoint())
    bytes_per_token = kv_bytes_per_token(kv_shape(model), "float32")
    args.kv_bytes = int(args.kv_documents * (args.length + args.output_len) * bytes_per_token)
    configs = [("stock vLLM", None)] + [(f"kvcompress rate {r:g}", r) for r in args.rates]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        lengths = write_dataset(work / "documents.jsonl", model, args.num_prompts, args.length, args.seed)
        print(f"{len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.output_len} output "
              f"tokens each, request rate {args.request_rate}; KV memory {args.kv_bytes / 2**20:.0f} MiB "
              f"per server; {machine_description()}", flush=True)
        order = [(rep, c) for rep in range(args.repeats) for c in (configs if rep % 2 == 0 else configs[::-1])]
        with tqdm(order, desc="vllm bench serve", unit="run", file=sys.stderr) as bar:
            for rep, (label, rate) in bar:
                bar.set_postfix_str(f"{label}, repeat {rep + 1}")
                run = serve_and_bench(label, rate, model, work / "documents.jsonl", args, work)
                runs.append({**run, "repeat": rep})
                tqdm.write(f"{label} (repeat {rep + 1}): {run['output_throughput']:.1f} output tokens/s, "
                           f"peak running {run['peak_running_requests']}, failed {run['failed']}")
    rows = median_runs(runs)
    ratios = paired_ratios(runs)
    rows.sort(key=lambda r: -1 if r["rate"] is None else r["rate"])
    lines = [
        f"`vllm bench serve` (custom dataset: {args.num_prompts} essay documents of <= {args.length} tokens "
        f"with a question, completions, --ignore-eos, {args.output_len} output tokens, request rate "
        f"{args.request_rate}); every server: SmolLM2-135M-Instruct float32, "
        f"--kv-cache-memory-bytes {args.kv_bytes} ({args.kv_documents:g} uncompressed requests), "
        f"{' '.join(SERVER_FLAGS)}; "
        f"{machine_description()}; median of {args.repeats} run(s) by output tokens/s, order alternated; "
        "the paired column: each repetition's output tokens/s over stock's in the same repetition.",
        "", *table(rows, ratios),
    ]
    cpu_lines = cpu_table(rows)
    if cpu_lines:
        lines += ["", "CPU seconds of each process while the benchmark ran (user + system, the "
                  "median run's), per completed request; the worker's include the model's compute; "
                  "/metrics polled every 0.5 s:", "", *cpu_lines]
    print("\n" + "\n".join(lines))
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items()}, "machine": machine_description(),
         "runs": runs, "median_rows": rows, "paired_ratios": ratios,
         "wall_seconds": time.perf_counter() - wall}, indent=1))
    plot = write_plot(rows, f"{args.out}.png")
    stock, best = rows[0], rows[-1]
    print(f"wrote {args.out}.md, .json{', .png' if plot else ''} in {time.perf_counter() - wall:.0f} s")
    print(f"summary: {best['label']} {best['output_throughput'] / stock['output_throughput']:.2f}x stock's "
          f"output tokens/s, TTFT p50 {best['p50_ttft_ms']:.0f} vs {stock['p50_ttft_ms']:.0f} ms, "
          f"TPOT p50 {best['p50_tpot_ms']:.0f} vs {stock['p50_tpot_ms']:.0f} ms, peak running "
          f"{best['peak_running_requests']} vs {stock['peak_running_requests']}")
    return rows


if __name__ == "__main__":
    main()
