"""The glue of the attention-scored kinds (kvc, snapkv, h2o, pyramidkv, ada, xkv ...):
the last ``observation_window`` prompt queries (every prompt query in ``full`` mode)
score the keys inside attention; decode queries add later as for every kind. kvc-ea
then re-ranks each head at the prompt's end (``kvcompress.ops.expected_attention``).
"""

from __future__ import annotations

from kvcompress.ops.expected_attention import rank_prompt_metrics
from kvcompress.vllm_glue.scoring_kind import PromptChunk, ScoringKindGlue
from kvcompress.vllm_glue.step import PromptMetricRows, PromptScored


class AttentionScoring(ScoringKindGlue):
    """``AttentionScores``: the prompt queries of the observation window score keys."""

    def prompt_rows(self, chunk: PromptChunk) -> PromptMetricRows | None:
        """The chunk's rows inside the scoring window (None: none this step)."""
        compression = chunk.request.compression
        spec = compression.policy.metric
        prompt_len = chunk.prompt_len
        scoring_from = 0 if spec.queries == "full" else prompt_len - spec.observation_window
        lo, hi = max(chunk.first, scoring_from), min(chunk.first + chunk.count, prompt_len)
        if hi <= lo:
            return None
        start = chunk.row_start - chunk.first
        done = hi == prompt_len
        return PromptMetricRows(
            chunk.index, start + lo, start + hi, done, spec,
            chunk.word_starts() if done and spec.pool_words else None,
            protected_prefix=compression.budget.protected_prefix,
            protected_window=compression.budget.protected_window,
            end_position=hi,
            at_prompt_end=self.prompt_scored,
        )


class ExpectedAttentionScoring(AttentionScoring):
    """``ExpectedAttentionRanking``: kvc's rows; at the prompt's end each head's values
    are handed out again in the expected attention's order (models without RoPE keep
    kvc's ranking; warned at startup)."""

    def prompt_scored(self, scored: PromptScored) -> None:
        state, rows = scored.state, scored.rows
        if state.rope is None:
            return
        rank_prompt_metrics(
            state.pool.slot_metrics, state.pool.key_cache, scored.query, scored.positions,
            scored.tables, scored.lens, scored.scale, state.rope,
            sinks=rows.protected_prefix, protected=rows.protected_window, start=rows.end_position,
            meta_tables=state.pool.meta_tables(scored.tables),
        )
