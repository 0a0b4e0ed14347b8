"""Split a sequence's kept KVs over its (layer, KV head) pairs, by policy.

``keep_targets`` turns a policy's budget split (a strategy of ``kvcompress.policies``)
into a target ``t[l, h]`` in tokens per head; the block-eviction schedule then frees
whole pages from the heads furthest above their targets (rounding rule below), and
within a head evicts the lowest-metric KVs, as for every policy.

Notation per sequence: ``L`` layers, ``H`` KV heads, ``p[l, h]`` protected KVs held by
the head (window and sinks; never evicted), ``T`` the tokens' worth of slots kept
(``kept pages * b``), ``F = T - sum(p)`` the non-protected budget and ``B = F / (L H)``
its per-head average. Targets always sum to ``T``:

- ``UniformSplit`` (SnapKV, H2O, StreamingLLM, random): ``t = p + B``.
- ``PyramidSplit`` (PyramidKV's arithmetic schedule): ``t[l] = p + k_l``, with
  ``k_{L-1} = B / beta``, ``k_0 = 2B - B / beta`` and ``k_l`` linear in between.
- ``AdaSplit`` over a layer split (Ada-KV): layer ``l``'s per-head average ``B'_l``
  is the layer split's (``B`` for uniform, ``k_l`` for pyramid); ``f[l, h]`` = how
  many of the layer's top-``round(H B'_l)`` non-protected metrics (across its heads)
  head ``h`` holds; ``t = p + (1 - alpha) f + alpha B'_l``.
- ``XKVSplit`` (XKV, Algorithm 1 = a global top-N): metrics divided by their layer's
  sum (non-protected KVs of all its heads); ``n_l`` = how many of the top-``round(F)``
  normalised values over all layers fall in layer ``l``; ``t[l] = p + n_l / H`` (heads
  of a layer share its allocation). With a saved profile, ``n_l = share_l F``.
- ``GlobalSplit`` (KV-Compress) has no targets: the schedule's global order applies.

Each split class has one rule here (``SPLIT_RULES``, registered with
``@split_rule``): a :class:`SplitRule` giving the non-protected tokens per head, or a
:class:`LayerRule` giving them per layer (heads of a layer alike) — the layer totals
an ``AdaSplit`` wraps.

Rounding to pages: pages are taken one at a time from the head whose held slots most
exceed its target, ``(pages_left * b) - t``, ties going to the lower (layer, head); a
head never gives up a page holding a protected KV. So every head ends within one page
of its target unless protection or its length stops it, and the sequence frees
exactly the ``E_s`` pages the scheduler asked for (or all it can).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvcompress.policies import AdaSplit, BudgetSplit, PyramidSplit, UniformSplit, XKVSplit


@dataclass(frozen=True)
class SplitInputs:
    """What a split rule reads, batched over ``S`` sequences.

    Attributes:
        metrics: ``[S, L, H, K]`` metric of each logical slot.
        candidate: ``[S, L, H, K]`` bool, held non-protected KVs.
        free: ``[S]`` float64 ``F``, non-protected tokens kept per sequence.
    """

    metrics: torch.Tensor
    candidate: torch.Tensor
    free: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.metrics.shape[0]

    @property
    def num_layers(self) -> int:
        return self.metrics.shape[1]

    @property
    def num_heads(self) -> int:
        return self.metrics.shape[2]

    @property
    def per_head(self) -> torch.Tensor:
        """``[S]`` ``B = F / (L H)``."""
        return self.free / (self.num_layers * self.num_heads)


class SplitRule:
    """The torch rule of a budget split class."""

    def shares(self, split: BudgetSplit, inputs: SplitInputs) -> torch.Tensor:
        """``[S, L, H]`` float64 non-protected tokens each head keeps (sum ``F``)."""
        raise NotImplementedError


class LayerRule(SplitRule):
    """A rule whose heads of a layer keep alike."""

    def layer_shares(self, split: BudgetSplit, inputs: SplitInputs) -> torch.Tensor:
        """``[S, L]`` float64 non-protected tokens per head of each layer."""
        raise NotImplementedError

    def shares(self, split: BudgetSplit, inputs: SplitInputs) -> torch.Tensor:
        layers = self.layer_shares(split, inputs)
        return layers.unsqueeze(-1).expand(inputs.num_seqs, inputs.num_layers, inputs.num_heads)


SPLIT_RULES: dict[type[BudgetSplit], SplitRule] = {}
"""Budget split class -> its rule."""


def split_rule(split_type: type[BudgetSplit]) -> Callable[[type[SplitRule]], type[SplitRule]]:
    """Register a :class:`SplitRule` subclass as the rule of ``split_type``."""

    def register(rule: type[SplitRule]) -> type[SplitRule]:
        SPLIT_RULES[split_type] = rule()
        return rule

    return register


def rule_for(split: BudgetSplit) -> SplitRule:
    """The rule of ``split``; ``ValueError`` if it has no per-head targets."""
    try:
        return SPLIT_RULES[type(split)]
    except KeyError:
        raise ValueError(f"no per-head targets for budget split {split.kind!r}") from None


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


@split_rule(UniformSplit)
class _Uniform(LayerRule):
    def layer_shares(self, split: UniformSplit, inputs: SplitInputs) -> torch.Tensor:
        return inputs.per_head.view(-1, 1).expand(inputs.num_seqs, inputs.num_layers)


@split_rule(PyramidSplit)
class _Pyramid(LayerRule):
    def layer_shares(self, split: PyramidSplit, inputs: SplitInputs) -> torch.Tensor:
        return pyramid_layers(inputs.per_head, inputs.num_layers, split.beta)


@split_rule(AdaSplit)
class _Ada(SplitRule):
    def shares(self, split: AdaSplit, inputs: SplitInputs) -> torch.Tensor:
        layer_rule = rule_for(split.layers)
        if not isinstance(layer_rule, LayerRule):
            raise ValueError(f"Ada-KV needs layer totals; budget split {split.layers.kind!r} has none")
        base = layer_rule.layer_shares(split.layers, inputs)  # [S, L]
        num_seqs, num_layers, num_heads, num_slots = inputs.metrics.shape
        count = torch.round(base * num_heads).to(torch.int64)  # [S, L]
        winners = _top_count(
            inputs.metrics.reshape(num_seqs * num_layers, -1),
            inputs.candidate.reshape(num_seqs * num_layers, num_heads * num_slots),
            count.reshape(-1),
        )
        wins = winners.view(num_seqs, num_layers, num_heads, num_slots).sum(dim=-1)
        alpha = split.floor
        return (1 - alpha) * wins.to(torch.float64) + alpha * base.unsqueeze(-1)


@split_rule(XKVSplit)
class _XKV(LayerRule):
    def layer_shares(self, split: XKVSplit, inputs: SplitInputs) -> torch.Tensor:
        num_seqs, num_layers = inputs.num_seqs, inputs.num_layers
        free, device = inputs.free, inputs.metrics.device
        if split.layer_profile is not None:
            if len(split.layer_profile) != num_layers:
                raise ValueError(
                    f"XKV profile has {len(split.layer_profile)} layers, the model {num_layers}"
                )
            shares = torch.tensor(split.layer_profile, dtype=torch.float64, device=device)
            layer_tokens = free.view(-1, 1) * shares.view(1, -1)  # [S, L]
        else:
            candidate = inputs.candidate
            values = torch.where(candidate, inputs.metrics.to(torch.float64), torch.zeros((), dtype=torch.float64, device=device))
            layer_sum = values.sum(dim=(2, 3), keepdim=True)  # [S, L, 1, 1]
            normalised = torch.where(layer_sum > 0, values / layer_sum.clamp(min=1e-300), torch.zeros_like(values))
            count = torch.round(free).to(torch.int64)
            winners = _top_count(
                normalised.reshape(num_seqs, -1), candidate.reshape(num_seqs, -1), count
            )
            layer_tokens = winners.view(num_seqs, num_layers, -1).sum(dim=-1).to(torch.float64)
        return layer_tokens / inputs.num_heads


def keep_targets(
    split: BudgetSplit,
    metrics: torch.Tensor,
    held: torch.Tensor,
    protected: torch.Tensor,
    kept_slots: torch.Tensor,
) -> torch.Tensor:
    """Target KVs kept per (layer, head), in tokens (module docstring).

    Args:
        split: the policy's budget split (not global).
        metrics: ``[S, L, H, K]`` float, metric of each logical slot (>= 0, finite).
        held: ``[S, L, H, K]`` bool, slots holding a KV.
        protected: ``[S, L, H, K]`` bool, held KVs that are never evicted.
        kept_slots: ``[S]`` ``T``, slots' worth of KVs each sequence keeps.

    Returns:
        ``[S, L, H]`` float64 targets, summing to ``T`` per sequence.
    """
    rule = rule_for(split)
    protected = protected & held
    prot = protected.sum(dim=-1).to(torch.float64)  # [S, L, H]
    free = (kept_slots.to(metrics.device, torch.float64) - prot.sum(dim=(1, 2))).clamp(min=0)  # [S]
    inputs = SplitInputs(metrics=metrics, candidate=held & ~protected, free=free)
    return prot + rule.shares(split, inputs)
