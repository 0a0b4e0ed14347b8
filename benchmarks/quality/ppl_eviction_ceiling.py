"""How much perplexity one eviction of a prompt's KVs can keep at a budget, whatever the
scoring: kvc's window scoring against an oracle that knows the continuation (SmolLM2, CPU).

Issue 18 asks kvc for >= 95% of the full cache's perplexity at rate 8; every setting
screened in the engine gives 91% (`results/quality-ppl-screen-smollm2-cpu.md`). This
asks whether any per-head selection of the same size does better. For each of
``eval_quality.py``'s Shakespeare windows (same seed, same 2048 + 256 tokens):

1. prefill the 2048-token prompt once (Hugging Face's Llama, float32, attention written
   here) and record kvc's scores: the last ``--window`` prompt queries' probabilities
   squared, summed over each KV head's group (L2), max-pooled over ``--pool`` tokens;
2. run the 256 continuation tokens on the full cache: the full perplexity, and the
   oracle's scores, the attention probability the continuation's own queries give each
   prompt KV, summed over queries and group (known only in hindsight);
3. per rate and scoring, keep the top ``L * H * ceil(2048 / rate)`` prompt KVs over all
   (layer, KV head) pairs (the global split kvc uses) plus each head's last
   ``--protected`` prompt tokens, then run the continuation again on that cache.

``--extra expected`` adds an expected-attention scoring that needs no pass over the
continuation (:func:`expected_scores`: the recent prompt queries as a Gaussian moved by
RoPE to the coming positions); ``--extra kvc+expected`` adds kvc's and its per-head
distributions summed, which ``--hybrids`` also ranks under kvc's per-head split.

One eviction at the prompt's end, the continuation's own KVs all kept: this is rate
``r`` without continual compression, so its figures are not the engine's (which
recompresses every 64 steps); the two scorings are compared under the same protocol.
No word-span pooling (kvc's default has it; its effect on perplexity is not measured here).

Usage: ``python benchmarks/quality/ppl_eviction_ceiling.py [--samples 8] [--rates 4 8 16]
[--hybrids] [--lookahead 8 16 32 64] [--metric-variants] [--extra window128 ...] --out
PREFIX`` (1-2.5 min per window on one thread; the commands behind the results are in
``results/ppl-eviction-ceiling-smollm2-cpu.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

ATTENTION_NAME = "kvcompress_ceiling"


@dataclass
class Recorder:
    """What the attention function records or applies, per layer.

    Attributes:
        prompt_len: P, the prompt's tokens (keys ``[0, P)`` are the prompt's KVs).
        window: prompt queries that score keys for kvc (the last ``window`` of P).
        mode: ``prefill`` (record kvc's scores), ``future`` (record the oracle's), or
            ``masked`` (apply ``keep``).
        window_scores / future_scores: layer -> ``[H, P]`` float64 scores.
        keep: layer -> ``[H, P]`` bool, the prompt KVs each KV head keeps.
    """

    prompt_len: int
    window: int
    mode: str = "prefill"
    window_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    future_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    keep: dict[int, torch.Tensor] = field(default_factory=dict)
    extra: bool = False
    lookahead: tuple[int, ...] = ()
    lookahead_scores: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    future_l2_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    window_l1_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    extra_scores: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    inv_freq: torch.Tensor | None = None  # RoPE frequencies [D/2] (expected attention)


def prefill_scores(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Other question-free scorings from the prompt's own attention ``[H, G, P, P]``
    (float64), each ``[H, P]``: longer windows (L2), and every query's probability
    averaged over the queries that see the key (``all-mean``: a key at position k is
    seen by ``P - k`` queries, so a plain sum favours early keys)."""
    heads, group, length, _ = probs.shape
    seen = group * (length - torch.arange(length, dtype=torch.float64))
    scores = {}
    for size in (128, 512):
        scores[f"window{size}"] = probs[:, :, -size:].square().sum(dim=(1, 2))
    scores["all-mean"] = probs.sum(dim=(1, 2)) / seen
    scores["all-mean-l2"] = probs.square().sum(dim=(1, 2)) / seen
    # the last quarter of the prompt's queries, averaged like all-mean
    tail = length // 4
    tail_seen = group * (length - torch.clamp(torch.arange(length), min=length - tail)).double()
    scores["tail-mean"] = probs[:, :, -tail:].sum(dim=(1, 2)) / tail_seen
    return scores


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's RoPE pairing: dims ``i`` and ``i + D/2`` rotate together."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def expected_scores(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inv_freq: torch.Tensor,
                    scaling: float, stats_queries: int = 128, horizon: int = 256) -> dict[str, torch.Tensor]:
    """Expected attention of future queries, with no pass over them: the last
    ``stats_queries`` prompt queries, un-rotated (RoPE removed), give a Gaussian per query
    head (mean, covariance); its RoPE rotation averaged over the next ``horizon``
    positions moves it to where the continuation's queries will be; then
    ``E[exp(s q.k)] = exp(s mu.k + s^2 k'Sk / 2)`` per prompt key, normalised over the
    keys, summed over each KV head's group (``expected``) and times ``||v||``
    (``expected+vnorm``).

    q ``[H, G, P, D]`` post-RoPE prompt queries; key / value ``[H, P, D]`` (post-RoPE
    keys); inv_freq ``[D/2]``. Returns ``[H, P]`` float64 scores."""
    heads, group, length, head_dim = q.shape
    q = q.double()
    positions = torch.arange(length, dtype=torch.float64)
    angles = positions[:, None] * inv_freq.double()[None, :]  # [P, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    unrotated = q * cos - rotate_half(q) * sin  # RoPE by -position
    recent = unrotated[:, :, -stats_queries:]  # [H, G, W, D]
    mean = recent.mean(dim=2)  # [H, G, D]
    centred = recent - mean.unsqueeze(2)
    cov = torch.einsum("hgwd,hgwe->hgde", centred, centred) / max(1, recent.shape[2] - 1)
    future = torch.arange(length, length + horizon, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    cos_bar = torch.cat([future.cos().mean(0)] * 2)
    sin_bar = torch.cat([future.sin().mean(0)] * 2)
    eye = torch.eye(head_dim, dtype=torch.float64)
    rotation = torch.diag(cos_bar) + torch.diag(sin_bar) @ rotate_half(eye).T  # x -> x cos + rh(x) sin
    mean_future = mean @ rotation.T
    cov_future = rotation @ cov @ rotation.T
    keys = key.double()  # [H, P, D]
    logits = scaling * torch.einsum("hgd,hpd->hgp", mean_future, keys)
    logits = logits + 0.5 * scaling**2 * torch.einsum("hpd,hgde,hpe->hgp", keys, cov_future, keys)
    probs = torch.softmax(logits, dim=-1).sum(dim=1)  # [H, P]
    return {"expected": probs, "expected+vnorm": probs * value.double().norm(dim=-1)}


RECORDER: Recorder | None = None


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal attention of one sequence (the queries are the last ``Q`` of ``K``
    positions; the passed mask is not used), recording or masking per ``RECORDER``.

    query ``[1, Hq, Q, D]``, key / value ``[1, H, K, D]``; returns ``[1, Q, Hq, D]``."""
    rec = RECORDER
    _, num_q_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    group = num_q_heads // num_kv_heads
    layer = module.layer_idx
    q = query[0].reshape(num_kv_heads, group, num_queries, head_dim)
    logits = torch.einsum("hgqd,hkd->hgqk", q, key[0]) * scaling
    first = num_keys - num_queries
    future = torch.arange(num_keys) > (first + torch.arange(num_queries)).unsqueeze(-1)
    logits.masked_fill_(future, float("-inf"))
    if rec.mode == "masked":
        dropped = ~rec.keep[layer]  # [H, P]
        logits[..., : rec.prompt_len].masked_fill_(dropped[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if rec.mode == "prefill":
        rows = probs[:, :, -rec.window :, : rec.prompt_len].double()
        rec.window_scores[layer] = rows.square().sum(dim=(1, 2))
        rec.window_l1_scores[layer] = rows.sum(dim=(1, 2))
        if rec.extra:
            scores = prefill_scores(probs.double())
            scores.update(expected_scores(q, key[0], value[0], rec.inv_freq, scaling))
            for name, score in scores.items():
                rec.extra_scores.setdefault(name, {})[layer] = score
    elif rec.mode == "future":
        future_probs = probs[:, :, :, : rec.prompt_len].double()
        rec.future_scores[layer] = future_probs.sum(dim=(1, 2))
        rec.future_l2_scores[layer] = future_probs.square().sum(dim=(1, 2))
        for first in rec.lookahead:  # kvc's metric (L2) from the first decode queries only
            rec.lookahead_scores.setdefault(first, {})[layer] = future_probs[:, :, :first].square().sum(dim=(1, 2))
    out = torch.einsum("hgqk,hkd->hgqd", probs, value[0])
    return out.reshape(num_q_heads, num_queries, head_dim).transpose(0, 1).unsqueeze(0), None


def select(scores: torch.Tensor, rate: float, protected: int) -> torch.Tensor:
    """``[L, H, P]`` scores -> ``[L, H, P]`` bool: the top ``L * H * ceil(P / rate)``
    KVs outside each head's last ``protected`` positions, over all heads at once, plus
    those positions."""
    layers, heads, prompt_len = scores.shape
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[..., prompt_len - protected :] = True
    open_scores = scores[..., : prompt_len - protected].reshape(-1)
    count = min(open_scores.numel(), layers * heads * math.ceil(prompt_len / rate))
    chosen = torch.topk(open_scores, count).indices
    flat = keep[..., : prompt_len - protected].reshape(-1).clone()
    flat[chosen] = True
    keep[..., : prompt_len - protected] = flat.view(layers, heads, prompt_len - protected)
    return keep


def select_per_head(scores: torch.Tensor, counts: torch.Tensor, protected: int) -> torch.Tensor:
    """Like :func:`select`, but each head keeps its own ``counts[l, h]`` top KVs
    (outside the protected positions): one scoring's ranking under another's split."""
    layers, heads, prompt_len = scores.shape
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[..., prompt_len - protected :] = True
    order = torch.argsort(scores[..., : prompt_len - protected], dim=-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(prompt_len - protected).expand_as(order))
    keep[..., : prompt_len - protected] = rank < counts.unsqueeze(-1)
    return keep


DISTANCE_BINS = (256, 512, 1024, 2048)
"""Upper edges, in tokens from the prompt's end, of the bins the kept KVs are counted in:
[protected, 256), [256, 512), [512, 1024), [1024, 2048)."""


def distance_shares(keep: torch.Tensor, protected: int) -> list[float]:
    """Share of the kept unprotected KVs ``[L, H, P]`` in each ``DISTANCE_BINS`` bin of
    distance from the prompt's end (the last ``protected``, always kept, left out)."""
    prompt_len = keep.shape[-1]
    distance = prompt_len - 1 - torch.arange(prompt_len)
    edges = (protected, *DISTANCE_BINS)
    counts = [int(keep[..., (distance >= lo) & (distance < hi)].sum())
              for lo, hi in zip(edges[:-1], edges[1:])]  # fmt: skip
    total = max(1, sum(counts))
    return [c / total for c in counts]


def max_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max over ``kernel`` neighbouring positions (odd, centred) of ``[L, H, P]``."""
    if kernel <= 1:
        return scores
    layers, heads, length = scores.shape
    pooled = torch.nn.functional.max_pool1d(
        scores.reshape(layers * heads, 1, length), kernel, stride=1, padding=kernel // 2
    )
    return pooled.view(layers, heads, length)


def continuation_nll(model, cache, forced: list[int], prompt_len: int, first_logits: torch.Tensor) -> list[float]:
    """Negative log-likelihood of each forced token: the first from the prompt's last
    logits, the others from the continuation pass on ``cache`` (cropped back after)."""
    ids = torch.tensor([forced[:-1]])
    positions = torch.arange(prompt_len, prompt_len + len(forced) - 1).unsqueeze(0)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    cache.crop(-(len(forced) - 1))
    logits = torch.cat([first_logits.view(1, -1), out.logits[0]], dim=0).double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [-float(logprobs[i, token]) for i, token in enumerate(forced)]


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def recorded_scorings(rec: Recorder, layers: list[int], pool: int, extra, metric_variants: bool) -> dict:
    """Every scoring asked for, each ``[L, H, P]``, from what ``rec`` recorded."""

    def stacked(per_layer: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.stack([per_layer[i] for i in layers])

    window = stacked(rec.window_scores)
    scorings = {"kvc": max_pool(window, pool), "oracle": stacked(rec.future_scores)}
    if metric_variants:  # the power of the metric: L1 for kvc, L2 for the oracle
        scorings["kvc-l1"] = max_pool(stacked(rec.window_l1_scores), pool)
        scorings["oracle-l2"] = stacked(rec.future_l2_scores)
    for first, per_layer in rec.lookahead_scores.items():
        scorings[f"kvc+first{first}"] = max_pool(window + stacked(per_layer), pool)
    for name, per_layer in rec.extra_scores.items():
        if name in extra:
            scorings[name] = stacked(per_layer)
        if f"{name}+pool" in extra:
            scorings[f"{name}+pool"] = max_pool(stacked(per_layer), pool)
    if "kvc+expected" in extra:  # both as per-head distributions, summed (for kvc's split)
        expected = stacked(rec.extra_scores["expected"])
        scorings["kvc+expected"] = (scorings["kvc"] / scorings["kvc"].sum(-1, keepdim=True)
                                    + expected / expected.sum(-1, keepdim=True))
    return scorings


def run(samples: int, rates: list[float], window: int, pool: int, protected: int, extra=(), hybrids=False,
        lookahead=(), metric_variants=False, log=print) -> dict:
    global RECORDER
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from benchmarks.quality.eval_quality import build_ppl_samples
    from benchmarks.common.offline_assets import smollm2_checkpoint

    AttentionInterface.register(ATTENTION_NAME, attention)
    path = str(smollm2_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=ATTENTION_NAME)
    model.eval()
    windows = build_ppl_samples(tokenizer, samples, 2048, 256, seed=0)
    results = {"config": {"samples": samples, "rates": rates, "window": window, "pool": pool,
                          "protected": protected, "extra": list(extra), "hybrids": hybrids,
                          "lookahead": list(lookahead), "metric_variants": metric_variants,
                          "context": 2048, "forced": 256},
               "samples": []}  # fmt: skip
    started = time.perf_counter()
    with torch.inference_mode():
        for sample in windows:
            prompt, forced = sample["prompt_token_ids"], sample["forced"]
            RECORDER = Recorder(prompt_len=len(prompt), window=window, extra=bool(extra), lookahead=tuple(lookahead),
                                inv_freq=model.model.rotary_emb.inv_freq)
            out = model(input_ids=torch.tensor([prompt]), use_cache=True)
            cache, first_logits = out.past_key_values, out.logits[0, -1]
            RECORDER.mode = "future"
            nll = {"full": continuation_nll(model, cache, forced, len(prompt), first_logits)}
            layers = sorted(RECORDER.window_scores)
            scorings = recorded_scorings(RECORDER, layers, pool, extra, metric_variants)
            RECORDER.mode = "masked"
            where: dict[str, list[float]] = {}
            for rate in rates:
                kept = {name: select(scores, rate, protected) for name, scores in scorings.items()}
                counts = {name: keep[..., : len(prompt) - protected].sum(-1) for name, keep in kept.items()}
                if hybrids:  # each scoring's ranking under the other's per-head split
                    kept["kvc-rank+oracle-split"] = select_per_head(scorings["kvc"], counts["oracle"], protected)
                    kept["oracle-rank+kvc-split"] = select_per_head(scorings["oracle"], counts["kvc"], protected)
                    for name in scorings:
                        if name not in ("kvc", "oracle"):  # every other scoring's ranking, kvc's split
                            kept[f"{name}-rank+kvc-split"] = select_per_head(scorings[name], counts["kvc"], protected)
                for name, keep in kept.items():
                    where[f"{name}/r{rate:g}"] = distance_shares(keep, protected)
                    RECORDER.keep = {layer: keep[i] for i, layer in enumerate(layers)}
                    nll[f"{name}/r{rate:g}"] = continuation_nll(model, cache, forced, len(prompt), first_logits)
            row = {"play": sample["play"], "start": sample["start"],
                   "ppl": {key: perplexity(values) for key, values in nll.items()}, "nll": nll,
                   "kept_by_distance": where}  # fmt: skip
            results["samples"].append(row)
            log(f"{sample['play']}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["ppl"].items()))
    results["seconds"] = time.perf_counter() - started
    results["summary"] = summarize(results)
    return results


def summarize(results: dict) -> dict:
    """Pooled perplexity (all windows' tokens) per setting and its % of full."""
    keys = list(results["samples"][0]["nll"])
    pooled = {key: perplexity([x for row in results["samples"] for x in row["nll"][key]]) for key in keys}
    return {key: {"ppl": value, "pct_of_full": 100 * pooled["full"] / value} for key, value in pooled.items()}


def write(results: dict, prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # per-token log-likelihoods stay out of the file (MBs); per-window perplexities stay in
    slim = {**results, "samples": [{k: v for k, v in row.items() if k != "nll"} for row in results["samples"]]}
    prefix.with_suffix(".json").write_text(json.dumps(slim, indent=1) + "\n")
    config, summary = results["config"], results["summary"]
    lines = [
        "# One eviction at the prompt's end: kvc's scoring against an oracle (SmolLM2-135M-Instruct, CPU)",
        "",
        f"- {config['samples']} Shakespeare windows of eval_quality.py (seed 0): {config['context']} prompt "
        f"tokens, {config['forced']} teacher-forced; Hugging Face Llama in float32, attention from "
        "`benchmarks/quality/ppl_eviction_ceiling.py`",
        f"- kept per rate r: the top L x H x ceil(2048 / r) prompt KVs over all heads, plus each head's "
        f"last {config['protected']} prompt tokens; the continuation's KVs all kept (no continual compression)",
        f"- kvc: last {config['window']} prompt queries, probabilities squared, summed over the group, "
        f"max-pooled over {config['pool']} tokens; oracle: the continuation's own attention to each prompt KV",
        f"- wall time {results['seconds']:.0f} s",
        "",
        "| scoring | rate | perplexity | % of full |",
        "| --- | ---: | ---: | ---: |",
        f"| full cache | 1 | {summary['full']['ppl']:.2f} | 100% |",
    ]
    names = [key.split("/")[0] for key in summary if key.endswith(f"/r{config['rates'][0]:g}")]
    for rate in config["rates"]:
        for name in names:
            cell = summary[f"{name}/r{rate:g}"]
            lines.append(f"| {name} | {rate:g} | {cell['ppl']:.2f} | {cell['pct_of_full']:.1f}% |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--window", type=int, default=32, help="kvc's scoring prompt queries")
    parser.add_argument("--pool", type=int, default=31, help="kvc's max-pool width (odd)")
    parser.add_argument("--protected", type=int, default=64, help="last prompt tokens always kept")
    parser.add_argument("--extra", nargs="*", default=[],
                        help="more scorings (prefill_scores names, '+pool' for max-pooled)")
    parser.add_argument("--hybrids", action="store_true",
                        help="also kvc's ranking under the oracle's per-head split, the reverse, and every "
                             "other scoring's ranking under kvc's split")
    parser.add_argument("--lookahead", type=int, nargs="*", default=[],
                        help="also kvc's metric plus that of the continuation's first N queries (a "
                             "compression deferred by N decode steps)")
    parser.add_argument("--metric-variants", action="store_true",
                        help="also kvc's scoring with L1 (probabilities summed) and the oracle's with L2")
    parser.add_argument("--out", type=Path, required=True, help="output prefix (.json, .md)")
    args = parser.parse_args(argv)
    results = run(args.samples, args.rates, args.window, args.pool, args.protected, extra=args.extra,
                  hybrids=args.hybrids, lookahead=args.lookahead, metric_variants=args.metric_variants)
    write(results, args.out)
    print(args.out.with_suffix(".md").read_text())
    return results


if __name__ == "__main__":
    main()
