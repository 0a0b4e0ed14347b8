"""Expected attention of the queries still to come, estimated at the prompt's end with no
pass over them, and a ranking of each head's KVs by it and kvc's metric together (the
``kvc-ea`` policy). No vLLM.

The estimate (``benchmarks/quality/ppl_eviction_ceiling.py`` measured it first): the last prompt
queries of a query head, each moved by RoPE to the positions that come next and averaged
over them, form a Gaussian (mean ``mu``, covariance ``S``); a key ``k`` then gets
``E[exp(s q . k)] = exp(s mu . k + s^2 k' S k / 2)``, normalised over the head's keys and
summed over its query group.

Moving a query: RoPE rotates each frequency pair of dimensions by ``position * f``. A
query at position ``t`` rotated for position ``p`` is ``R(p - t) q_t`` (the rotation of
the un-rotated query by ``p``), so averaging over ``p`` in ``[P, P + horizon)`` needs
only the relative offsets ``p - t``, the frequencies and the pairing (NeoX halves or
GPT-J neighbours) -- never the un-rotated query.

Ranking (:func:`rank_within_heads`): the eviction schedule splits a sequence's budget
over its heads by kvc's metric (the cheapest blocks across all heads); measured on
SmolLM2, kvc's split is the better one, a ranking that also counts the expected
attention the better one within a head (one eviction at the prompt's end, rate 8: 96.1%
of full perplexity against kvc's 94.0%). So each head keeps its kvc values as a
multiset -- the split is unchanged -- but they are handed out to its slots in the order
of the combined score (kvc's and the expected attention's per-head distributions,
summed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.ops.kv_pool import gather_pages
from kvcompress.ops.metrics import _logical_slots, write_held_slots


def rope_frequencies(cos_sin_cache: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``[rotary_dim / 2]`` float64 angular frequencies of a RoPE table whose row ``p``
    is ``[cos(p f), sin(p f)]`` (vLLM's ``RotaryEmbedding.cos_sin_cache``; scaled
    frequencies included): read back from position 1 (every ``f`` is in ``(0, pi)``)."""
    half = rotary_dim // 2
    row = cos_sin_cache[1].double().cpu()
    return torch.atan2(row[half : 2 * half], row[:half])


def _pairs(rotary_dim: int, neox: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dimension indices ``(a, b)`` of each rotated pair: ``(x_a, x_b)`` turns by the
    angle of its frequency. NeoX: halves of the rotary part; GPT-J: neighbours. Made on
    ``device`` (a copy from the host would wait for a CUDA stream)."""
    half = rotary_dim // 2
    if neox:
        return torch.arange(half, device=device), torch.arange(half, 2 * half, device=device)
    return torch.arange(0, rotary_dim, 2, device=device), torch.arange(1, rotary_dim, 2, device=device)


def future_gaussian(
    query: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, neox: bool,
    start: int, horizon: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[Hq, D]`` and covariance ``[Hq, D, D]`` (float64) of the queries
    ``query [W, Hq, D]`` (post-RoPE, at ``positions [W]``) each averaged over the
    rotations to positions ``start ... start + horizon - 1``."""
    queries = query.shape[0]
    rotary_dim = 2 * inv_freq.shape[0]
    device = query.device
    first, second = _pairs(rotary_dim, neox, device)
    coming = torch.arange(start, start + horizon, dtype=torch.float64, device=device)
    offsets = coming[None, :] - positions.to(device).double()[:, None]
    angles = offsets[:, :, None] * inv_freq.to(device).double()[None, None, :]  # [W, horizon, D/2]
    cos_mean = angles.cos().mean(1)[:, None, :]  # [W, 1, D/2]
    sin_mean = angles.sin().mean(1)[:, None, :]
    q = query.double()
    moved = q.clone()
    qa, qb = q[..., first], q[..., second]
    moved[..., first] = qa * cos_mean - qb * sin_mean
    moved[..., second] = qa * sin_mean + qb * cos_mean
    mean = moved.mean(0)  # [Hq, D]
    centred = moved - mean
    cov = torch.einsum("whd,whe->hde", centred, centred) / max(1, queries - 1)
    return mean, cov


def expected_attention(
    mean: torch.Tensor, cov: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``[H, P]`` float64: each key's expected attention from the Gaussian queries of
    its head's group (``mean [Hq, D]``, ``cov [Hq, D, D]``, ``Hq = H * G``), softmax over
    the head's first ``lens[h]`` keys of ``keys [H, P, D]`` (post-RoPE), summed over the
    group; zero past ``lens``."""
    heads, length, head_dim = keys.shape
    group = mean.shape[0] // heads
    k = keys.double()
    mu = mean.view(heads, group, head_dim)
    sigma = cov.view(heads, group, head_dim, head_dim)
    logits = scale * torch.einsum("hgd,hpd->hgp", mu, k)
    logits += 0.5 * scale**2 * torch.einsum("hpd,hgde,hpe->hgp", k, sigma, k)
    held = torch.arange(length, device=keys.device)[None, :] < lens.to(keys.device)[:, None]  # [H, P]
    logits.masked_fill_(~held[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(1)


def rank_within_heads(kvc: torch.Tensor, expected: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``[H, P]``: each head's first ``lens[h]`` values of ``kvc`` handed out again in
    the order of ``kvc / sum(kvc) + expected / sum(expected)`` (both over the head's held
    slots): the smallest kvc value to the slot of smallest combined score, and so on.
    Each head keeps its multiset of values; slots past ``lens`` keep theirs."""
    heads, length = kvc.shape
    device = kvc.device
    held = torch.arange(length, device=device)[None, :] < lens.to(device)[:, None]
    values = kvc.double().masked_fill(~held, 0.0)
    weights = expected.to(device).double().masked_fill(~held, 0.0)
    combined = values / values.sum(-1, keepdim=True).clamp_min(1e-300)
    combined = combined + weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    by_value = values.masked_fill(~held, float("inf")).sort(dim=-1).values  # padding last
    order = combined.masked_fill(~held, float("inf")).argsort(dim=-1, stable=True)  # padding last
    ranked = torch.empty_like(values).scatter_(-1, order, by_value)
    return torch.where(held, ranked, kvc.double()).to(kvc.dtype)


HORIZON = 256
"""Coming positions a prompt-end query is averaged over (the harness's measured setting)."""


@dataclass(frozen=True)
class RopeFrequencies:
    """A model's RoPE as the estimate needs it.

    Attributes:
        inv_freq: ``[rotary_dim / 2]`` float64 angular frequencies (scaling applied).
        neox: NeoX pairing (dims ``i`` and ``i + rotary_dim / 2``) rather than GPT-J's
            (``2i`` and ``2i + 1``).
    """

    inv_freq: torch.Tensor
    neox: bool

    def to(self, device: torch.device | str) -> "RopeFrequencies":
        """The same frequencies on ``device`` (kept there: one copy, not one per call)."""
        return RopeFrequencies(self.inv_freq.to(device), self.neox)


def rank_prompt_metrics(
    slot_metrics: torch.Tensor, key_cache: torch.Tensor, query: torch.Tensor, positions: torch.Tensor,
    tables: torch.Tensor, lens: torch.Tensor, scale: float, rope: RopeFrequencies, horizon: int = HORIZON,
    sinks: int = 0, protected: int = 0, start: int | None = None, meta_tables: torch.Tensor | None = None,
) -> None:
    """One sequence's heads of one layer, at its prompt's end: hand each head's pooled kvc
    metrics out again in the order of kvc's and the expected attention's distributions
    together (:func:`rank_within_heads`), in place.

    Args:
        slot_metrics: ``[num_pages, b]`` float32, the pool's metrics (written at held
            slots only).
        key_cache: ``[num_pages, b, D]`` (any strides), post-RoPE keys.
        query, positions: ``[W, Hq, D]`` the prompt's last queries and ``[W]`` their
            positions (the observation window).
        tables: ``[H, P]`` page ids of the heads; lens ``[H]`` KVs each holds (slot
            ``i`` at position ``i``: nothing evicted yet).
        sinks, protected: the first ``sinks`` and last ``protected`` slots of each head,
            never evicted, keep their values: only the evictable slots trade values, so
            the evictable multiset, and with it the split, stays kvc's.
        start: the position after the window's last query (the prompt's length), from
            the host; None reads it from ``positions`` (a stream sync on CUDA).
        meta_tables: ``[H, P]`` the rows of ``slot_metrics`` holding ``tables``' pages'
            metrics (``KVPool.meta_tables``; None: the page ids).

    Every head holds at least one KV (a prompt's end). Nothing is read on the host
    (given ``start``): the table columns past a head's length write the head's first
    slot's new value again instead of being masked out.
    """
    heads, num_pages = tables.shape
    block_size = key_cache.shape[1]
    if start is None:
        start = int(positions.max()) + 1
    mean, cov = future_gaussian(query, positions, rope.inv_freq, rope.neox, start, horizon)
    pages = tables.long()
    keys = gather_pages(key_cache, pages).reshape(heads, num_pages * block_size, key_cache.shape[2])
    expected = expected_attention(mean, cov, keys, lens, scale)
    # [H, P * b] flat metric slots (row * b + offset), logical order
    slots = _logical_slots(pages if meta_tables is None else meta_tables.long(), block_size)
    kvc = slot_metrics.view(-1)[slots]
    lens = lens.to(tables.device)
    evictable = (lens - protected - sinks).clamp_min(0)
    updated = kvc.clone()  # slots outside the evictable range keep their values
    updated[:, sinks:] = rank_within_heads(kvc[:, sinks:], expected[:, sinks:], evictable)
    held = torch.arange(slots.shape[1], device=tables.device)[None, :] < lens[:, None]
    write_held_slots(slot_metrics, slots, held, updated)
