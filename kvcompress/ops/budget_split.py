"""Split a sequence's kept KVs over its (layer, KV head) pairs, by policy.

``keep_targets`` turns a policy's rule (``kvcompress.policies.BudgetSplit``) into a
target ``t[l, h]`` in tokens per head; the block-eviction schedule then frees whole
pages from the heads furthest above their targets (rounding rule below), and within a
head evicts the lowest-metric KVs, as for every policy.

Notation per sequence: ``L`` layers, ``H`` KV heads, ``p[l, h]`` protected KVs held by
the head (window and sinks; never evicted), ``T`` the tokens' worth of slots kept
(``kept pages * b``), ``F = T - sum(p)`` the non-protected budget and ``B = F / (L H)``
its per-head average. Targets always sum to ``T``:

- ``uniform`` (SnapKV, H2O, StreamingLLM, random): ``t = p + B``.
- ``pyramid`` (PyramidKV's arithmetic schedule): ``t[l] = p + k_l``, with
  ``k_{L-1} = B / beta``, ``k_0 = 2B - B / beta`` and ``k_l`` linear in between.
- ``ada`` / ``ada-pyramid`` (Ada-KV): layer ``l``'s per-head average ``B'_l`` is ``B``
  (or ``k_l`` of the pyramid); ``f[l, h]`` = how many of the layer's top-``round(H B'_l)``
  non-protected metrics (across its heads) head ``h`` holds;
  ``t = p + (1 - alpha) f + alpha B'_l``.
- ``xkv`` (XKV, Algorithm 1 = a global top-N): metrics divided by their layer's sum
  (non-protected KVs of all its heads); ``n_l`` = how many of the top-``round(F)``
  normalised values over all layers fall in layer ``l``; ``t[l] = p + n_l / H`` (heads
  of a layer share its allocation). With a saved profile, ``n_l = share_l F``.

Rounding to pages: pages are taken one at a time from the head whose held slots most
exceed its target, ``(pages_left * b) - t``, ties going to the lower (layer, head); a
head never gives up a page holding a protected KV. So every head ends within one page
of its target unless protection or its length stops it, and the sequence frees
exactly the ``E_s`` pages the scheduler asked for (or all it can).
"""

from __future__ import annotations

import torch

from kvcompress.policies import BudgetSplit


def pyramid_layers(per_head: torch.Tensor, num_layers: int, beta: float) -> torch.Tensor:
    """PyramidKV's per-layer, per-head budgets ``[S, L]`` from their average ``[S]``."""
    per_head = per_head.to(torch.float64)
    if num_layers == 1:
        return per_head.view(-1, 1)
    low = per_head / beta
    high = 2 * per_head - low
    step = (high - low) / (num_layers - 1)
    layer = torch.arange(num_layers, dtype=torch.float64, device=per_head.device)
    return high.view(-1, 1) - layer.view(1, -1) * step.view(-1, 1)


def _top_count(values: torch.Tensor, candidate: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Per row of ``values [R, N]``: which candidates are among its ``count[R]`` largest.

    Ties go to the lower index. Returns ``[R, N]`` bool.
    """
    keys = torch.where(candidate, values.to(torch.float64), torch.tensor(float("-inf"), dtype=torch.float64, device=values.device))
    # Stable descending sort: equal keys keep index order.
    order = torch.sort(-keys, dim=-1, stable=True).indices
    rank_ok = torch.arange(values.shape[-1], device=values.device) < count.view(-1, 1)
    chosen_sorted = rank_ok & torch.gather(candidate, -1, order)
    return torch.zeros_like(candidate).scatter_(-1, order, chosen_sorted)


def keep_targets(
    split: BudgetSplit,
    metrics: torch.Tensor,
    held: torch.Tensor,
    protected: torch.Tensor,
    keep_tokens: torch.Tensor,
) -> torch.Tensor:
    """Target KVs kept per (layer, head), in tokens (module docstring).

    Args:
        split: the policy's budget split (not ``global``).
        metrics: ``[S, L, H, K]`` float, metric of each logical slot (>= 0, finite).
        held: ``[S, L, H, K]`` bool, slots holding a KV.
        protected: ``[S, L, H, K]`` bool, held KVs that are never evicted.
        keep_tokens: ``[S]`` ``T``, slots' worth of KVs each sequence keeps.

    Returns:
        ``[S, L, H]`` float64 targets, summing to ``T`` per sequence.
    """
    num_seqs, num_layers, num_heads, num_slots = metrics.shape
    device = metrics.device
    protected = protected & held
    prot = protected.sum(dim=-1).to(torch.float64)  # [S, L, H]
    free = (keep_tokens.to(device, torch.float64) - prot.sum(dim=(1, 2))).clamp(min=0)  # [S]
    per_head = free / (num_layers * num_heads)  # [S]
    kind = split.kind
    if kind == "uniform":
        share = per_head.view(-1, 1, 1).expand(num_seqs, num_layers, num_heads)
    elif kind == "pyramid":
        layers = pyramid_layers(per_head, num_layers, split.pyramid_beta)
        share = layers.unsqueeze(-1).expand(num_seqs, num_layers, num_heads)
    elif kind in ("ada", "ada-pyramid"):
        if kind == "ada":
            base = per_head.view(-1, 1).expand(num_seqs, num_layers)
        else:
            base = pyramid_layers(per_head, num_layers, split.pyramid_beta)
        count = torch.round(base * num_heads).to(torch.int64)  # [S, L]
        candidate = (held & ~protected).reshape(num_seqs * num_layers, num_heads * num_slots)
        winners = _top_count(
            metrics.reshape(num_seqs * num_layers, -1), candidate, count.reshape(-1)
        )
        wins = winners.view(num_seqs, num_layers, num_heads, num_slots).sum(dim=-1)
        alpha = split.ada_floor
        share = (1 - alpha) * wins.to(torch.float64) + alpha * base.unsqueeze(-1)
    elif kind == "xkv":
        if split.layer_profile is not None:
            if len(split.layer_profile) != num_layers:
                raise ValueError(
                    f"XKV profile has {len(split.layer_profile)} layers, the model {num_layers}"
                )
            shares = torch.tensor(split.layer_profile, dtype=torch.float64, device=device)
            layer_tokens = free.view(-1, 1) * shares.view(1, -1)  # [S, L]
        else:
            candidate = held & ~protected
            values = torch.where(candidate, metrics.to(torch.float64), torch.zeros((), dtype=torch.float64, device=device))
            layer_sum = values.sum(dim=(2, 3), keepdim=True)  # [S, L, 1, 1]
            normalised = torch.where(layer_sum > 0, values / layer_sum.clamp(min=1e-300), torch.zeros_like(values))
            count = torch.round(free).to(torch.int64)
            winners = _top_count(
                normalised.reshape(num_seqs, -1), candidate.reshape(num_seqs, -1), count
            )
            layer_tokens = winners.view(num_seqs, num_layers, -1).sum(dim=-1).to(torch.float64)
        share = (layer_tokens / num_heads).unsqueeze(-1).expand(num_seqs, num_layers, num_heads)
    else:
        raise ValueError(f"no per-head targets for budget split {kind!r}")
    return prot + share
