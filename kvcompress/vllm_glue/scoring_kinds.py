"""The scoring kinds the engine knows: one row per kind joining its vLLM-free half (the
``MetricSource`` class of ``kvcompress.policies``) to its glue half (a
``ScoringKindGlue``, ``scoring_kind.py``), and the per-pool set of glue objects the
runner and the metric-query selector call. A new kind adds its source class, its glue
class and one row here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvcompress.policies import (
    AttentionScores,
    ExpectedAttentionRanking,
    MetricSource,
    RandomNoise,
    ReconstructionScores,
    SentenceSurprisal,
    TokenPosition,
)
from kvcompress.vllm_glue.attention_scoring import AttentionScoring, ExpectedAttentionScoring
from kvcompress.vllm_glue.reconstruction import ReconstructionPass
from kvcompress.vllm_glue.scoring_kind import ScoringContext, ScoringKindGlue
from kvcompress.vllm_glue.surprisal import SurprisalScoring

SCORING_KINDS: dict[type[MetricSource], type[ScoringKindGlue]] = {
    AttentionScores: AttentionScoring,
    ExpectedAttentionRanking: ExpectedAttentionScoring,
    # The reconstruction pass runs before surprisal reads the forward's hidden states.
    ReconstructionScores: ReconstructionPass,
    SentenceSurprisal: SurprisalScoring,
    TokenPosition: ScoringKindGlue,
    RandomNoise: ScoringKindGlue,
}
"""Metric source class -> its glue class (hooks run in this order)."""


class ScoringKinds:
    """One glue object per registered kind for a pool (made when the pool is built);
    the runner's hooks fan out to all of them."""

    def __init__(self, context: ScoringContext) -> None:
        self.glue: dict[type[MetricSource], ScoringKindGlue] = {
            source: glue(context) for source, glue in SCORING_KINDS.items()
        }

    def of(self, source: MetricSource) -> ScoringKindGlue:
        """The glue of ``source``'s kind."""
        glue = self.glue.get(type(source))
        if glue is None:
            raise LookupError(f"kvcompress: no glue registered for scoring kind {type(source).__name__}")
        return glue

    def after_forward(self) -> None:
        for glue in self.glue.values():
            glue.after_forward()

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            for glue in self.glue.values():
                glue.release(request_id)

    def record(self, on: bool) -> None:
        for glue in self.glue.values():
            glue.record(on)

    def recorded(self, request_id: str) -> dict[str, Any]:
        return {key: value for glue in self.glue.values() for key, value in glue.recorded(request_id).items()}
