"""The values a policy ranks a sequence's KVs by (torch; no vLLM)."""

from __future__ import annotations

import torch

from kvcompress.policies import Policy


def policy_metrics(
    policy: Policy | None,
    metrics: torch.Tensor,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The metrics a policy ranks KVs by, ``[S, L, H, K]`` in logical slot order.

    ``attention`` policies use the stored metrics; ``position`` (StreamingLLM) the
    token position, so the oldest unprotected KVs go first; ``random`` uniform noise
    from ``generator``.
    """
    source = policy.metric.source if policy is not None else "attention"
    if source == "position":
        return positions.to(torch.float32)
    if source == "random":
        return torch.rand(metrics.shape, generator=generator, device=metrics.device)
    return metrics
