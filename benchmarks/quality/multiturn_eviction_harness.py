"""The multi-turn second question after ONE eviction at the prompt's end, in a Hugging
Face harness (no vLLM): which question-agnostic scoring keeps a fact nobody asked about yet.

How the ``surprisal`` policy was found (2026-11-28). Each of ``eval_quality.py``'s
``niah_multiturn`` prompts (an essay holding a magic number, asked about at the prompt's
end, and a vault's access code) is prefilled once with ``ppl_eviction_ceiling.py``'s
attention (it records kvc's window scores); the prompt's own logits give every token's
surprisal. Each scoring then picks the KVs kept at ``--rate`` (``select``: the top
scores over every (layer, head) at once, plus the last ``PROTECTED`` positions), the
first answer and the second question are teacher-forced on the masked cache, and the
answer is generated greedily and scored as ``eval_quality.py`` scores it.

Scorings (``[L, H, P]``; the surprisal ones alike in every head, the first
``SINK_TOKENS`` positions kept):

* ``kvc``: the last 32 queries' L2 attention, max-pooled over 31 tokens (the question
  is in that window: it keeps the first needle, not the second);
* ``surprisal``: the sentence's mean surprisal (``kvcompress.ops.surprisal``: what the
  engine's ``surprisal`` policy computes);
* ``surprisal-max``: the sentence's largest surprisal;
* ``surprisal-top3``: the mean of the sentence's 3 largest surprisals;
* ``surprisal-mean+max``: half the normalised mean, half the normalised largest;
* ``surprisal-pool31``: surprisal max-pooled over 31 tokens.

``--task niah_multikey`` asks about one of four needles worded alike instead (the
question at the prompt's end, answered right after it).

    python benchmarks/quality/multiturn_eviction_harness.py --samples 20 --rate 8 \\
        --out benchmarks/results/multiturn-harness-smollm2-cpu

Measured (SmolLM2-135M, 20 prompts of 2K tokens, rate 8; ~10 min on one core): the full
cache answers 13, surprisal 14, surprisal-max 10, surprisal-pool31 6, kvc 5.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

from benchmarks.quality import ppl_eviction_ceiling as ceiling  # noqa: E402

from kvcompress.ops.surprisal import SentenceEnds, sentence_scores, sentence_starts  # noqa: E402
from kvcompress.ops.word_spans import span_max_pool  # noqa: E402

PROTECTED = 64
"""Last prompt positions always kept (the engine's protected window)."""
SINK_TOKENS = 4
"""First prompt positions always kept under the surprisal scorings (the policy's sinks)."""
WINDOW = 32
"""kvc's scoring queries."""
MAX_NEW_TOKENS = 12
SCORINGS = ("kvc", "surprisal", "surprisal-max", "surprisal-top3", "surprisal-mean+max", "surprisal-pool31")
TASKS = ("niah_multiturn", "niah_multikey")


def prompt_surprisal(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """``[P]`` float64 ``-log p(token t | tokens < t)`` from the prompt's logits ``[P, V]``; 0 at t = 0."""
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    nats = -logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return torch.cat([torch.zeros(1, dtype=torch.float64), nats])


def scorings(kvc: torch.Tensor, nats: torch.Tensor, ids: list[int], ends: SentenceEnds) -> dict[str, torch.Tensor]:
    """Every scoring ``[L, H, P]`` from kvc's window scores ``[L, H, P]`` and the prompt's surprisal."""
    layers, heads, length = kvc.shape
    starts = torch.from_numpy(sentence_starts(ids, ends))
    known = torch.ones(length, dtype=torch.bool)
    known[0] = False
    sentence_max = span_max_pool(nats.view(1, -1), starts)[0]
    top3 = torch.empty(length, dtype=torch.float64)
    for start in starts.unique().tolist():
        members = (starts == start).nonzero()[:, 0]
        values = nats[members[members > 0]] if (members > 0).any() else nats[members]
        top3[members] = values.topk(min(3, len(values))).values.mean()
    mean = sentence_scores(nats, known, starts).double()
    per_token = {
        "surprisal": mean,
        "surprisal-max": sentence_max,
        "surprisal-top3": top3,
        "surprisal-mean+max": 0.5 * mean + 0.5 * sentence_max / sentence_max[1:].max(),
        "surprisal-pool31": ceiling.max_pool(nats.view(1, 1, -1), 31)[0, 0],
    }
    out = {"kvc": ceiling.max_pool(kvc, 31)}
    for name, values in per_token.items():
        values = values.clone()
        values[:SINK_TOKENS] = float("inf")
        out[name] = values.expand(layers, heads, length).clone()
    return out


def answer(model, tokenizer, cache, prompt_len: int, forced: list[int], keep: dict[int, torch.Tensor] | None,
           first_logits: torch.Tensor) -> str:
    """Teacher-force ``forced`` after the prompt on ``cache`` (masked to ``keep`` per
    layer; None: every KV), then generate greedily (from ``first_logits``, the prompt's
    last, when nothing is forced); the cache is cropped back after."""
    rec = ceiling.RECORDER
    rec.mode = "masked"
    rec.keep = keep if keep is not None else {
        layer: torch.ones_like(k, dtype=torch.bool) for layer, k in rec.window_scores.items()
    }
    if forced:
        out = model(input_ids=torch.tensor([forced]), position_ids=torch.arange(prompt_len, prompt_len + len(forced)).unsqueeze(0),
                    past_key_values=cache, use_cache=True)  # fmt: skip
        first_logits = out.logits[0, -1]
    token, generated, position = int(first_logits.argmax()), [], prompt_len + len(forced)
    for _ in range(MAX_NEW_TOKENS):
        generated.append(token)
        out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                    past_key_values=cache, use_cache=True)  # fmt: skip
        token, position = int(out.logits[0, -1].argmax()), position + 1
    cache.crop(prompt_len)
    return tokenizer.decode(generated)


def run(samples: int, rate: float, task: str = "niah_multiturn", log=print) -> dict:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from benchmarks.quality.eval_quality import build_samples, score
    from benchmarks.common.offline_assets import paul_graham_essays, smollm2_checkpoint

    AttentionInterface.register(ceiling.ATTENTION_NAME, ceiling.attention)
    path = str(smollm2_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=ceiling.ATTENTION_NAME).eval()
    ends = SentenceEnds.from_texts(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))
    prompts = build_samples(tokenizer, paul_graham_essays(), [task], [2048], samples)
    rows, started = [], time.perf_counter()
    with torch.inference_mode():
        for sample in prompts:
            ids = sample["prompt_token_ids"]
            ceiling.RECORDER = ceiling.Recorder(prompt_len=len(ids), window=WINDOW)
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            layers = sorted(ceiling.RECORDER.window_scores)
            kvc = torch.stack([ceiling.RECORDER.window_scores[i] for i in layers])
            row = {"index": sample["index"], "answers": sample["answers"]}
            forced, last = sample.get("forced", []), out.logits[0, -1]
            row["full"] = score(sample["answers"], answer(model, tokenizer, out.past_key_values, len(ids), forced, None, last))
            for name, values in scorings(kvc, prompt_surprisal(out.logits[0], ids), ids, ends).items():
                keep = ceiling.select(values, rate, PROTECTED)
                text = answer(model, tokenizer, out.past_key_values, len(ids), forced,
                              {layer: keep[j] for j, layer in enumerate(layers)}, last)  # fmt: skip
                row[name] = score(sample["answers"], text)
            rows.append(row)
            log(f"{sample['index']}: " + ", ".join(f"{k} {row[k]:.0f}" for k in ("full", *SCORINGS)))
    totals = {name: sum(r[name] for r in rows) for name in ("full", *SCORINGS)}
    return {"config": {"samples": samples, "rate": rate, "task": task, "protected": PROTECTED, "sink_tokens": SINK_TOKENS,
                       "window": WINDOW, "length": 2048},
            "rows": rows, "totals": totals, "seconds": time.perf_counter() - started}  # fmt: skip


def write(results: dict, prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(results, indent=1))
    totals, config = results["totals"], results["config"]
    lines = [
        "# One eviction at the prompt's end, question-agnostic scorings (Hugging Face harness, SmolLM2-135M)", "",
        f"- command: `python benchmarks/quality/multiturn_eviction_harness.py --samples {config['samples']} --rate {config['rate']:g} "
        f"--task {config['task']}`",
        f"- {config['samples']} prompts of {config['length']} tokens, rate {config['rate']:g}, "
        f"{results['seconds']:.0f} s", "",
        "| scoring | answered | % of full |", "| --- | ---: | ---: |",
    ]  # fmt: skip
    for name, total in totals.items():
        share = 100 * total / totals["full"] if totals["full"] else float("nan")
        lines.append(f"| {name} | {total:g} | {share:.0f}% |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--task", choices=TASKS, default="niah_multiturn")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = run(args.samples, args.rate, args.task)
    for name, total in results["totals"].items():
        print(f"{name}: {total:g}")
    if args.out is not None:
        write(results, args.out)
    return results


if __name__ == "__main__":
    main()
