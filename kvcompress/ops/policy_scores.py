"""The values a policy ranks a sequence's KVs by (torch; no vLLM).

One rule per metric source kind of ``kvcompress.policies`` (``AttentionScores``, ``ExpectedAttentionRanking``,
``ReconstructionScores``, ``TokenPosition``, ``RandomNoise``), registered in ``RANKERS`` with ``@ranks``; a new
source kind adds its parameter class there, its rule here, and its glue half (how the engine scores it) in one
row of ``kvcompress.vllm_glue.scoring_kinds.SCORING_KINDS``.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvcompress.policies import (
    AttentionScores,
    ExpectedAttentionRanking,
    MetricSource,
    Policy,
    RandomNoise,
    ReconstructionScores,
    SentenceSurprisal,
    TokenPosition,
)

Ranker = Callable[[MetricSource, torch.Tensor, torch.Tensor, "torch.Generator | None"], torch.Tensor]
"""``(source, metrics, positions, generator) -> [S, L, H, K]`` values ranked by."""

RANKERS: dict[type[MetricSource], Ranker] = {}
"""Metric source class -> its rule."""


def ranks(source_type: type[MetricSource]) -> Callable[[Ranker], Ranker]:
    """Register the rule of a metric source class."""

    def register(rule: Ranker) -> Ranker:
        RANKERS[source_type] = rule
        return rule

    return register


@ranks(AttentionScores)
@ranks(ExpectedAttentionRanking)
@ranks(ReconstructionScores)
@ranks(SentenceSurprisal)
def _stored_metrics(source, metrics, positions, generator):
    """The metrics scored inside attention (by prompt or decode queries, or by the
    reconstruction pass)."""
    return metrics


@ranks(TokenPosition)
def _token_position(source, metrics, positions, generator):
    """The token position: the oldest unprotected KVs go first."""
    return positions.to(torch.float32)


@ranks(RandomNoise)
def _random_noise(source, metrics, positions, generator):
    """Uniform noise from ``generator``."""
    return torch.rand(metrics.shape, generator=generator, device=metrics.device)


_DEFAULT_SOURCE = AttentionScores()


def policy_metrics(
    policy: Policy | None,
    metrics: torch.Tensor,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The metrics a policy ranks KVs by, ``[S, L, H, K]`` in logical slot order.

    ``metrics``: the stored attention metrics; ``positions``: each slot's token
    position; ``generator``: for random sources. ``policy`` None = attention metrics.
    """
    source = policy.metric.source if policy is not None else _DEFAULT_SOURCE
    try:
        rule = RANKERS[type(source)]
    except KeyError:
        raise ValueError(f"no ranking rule for metric source {source.kind!r}") from None
    return rule(source, metrics, positions, generator)
