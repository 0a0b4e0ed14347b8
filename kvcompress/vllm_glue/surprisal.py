"""The ``surprisal`` policy's scores, from the prefill's own hidden states.

A request whose policy's metric source is ``SentenceSurprisal`` (this module's
:class:`SurprisalScoring` is that scoring kind's glue) has no prompt query score its keys. In every step that prefills some of its prompt, after the
forward, the model's head turns the final hidden states of those positions into
logits, and each next prompt token's surprisal (``-log p`` in nats) is kept in a
per-request buffer. In the step its prompt completes (before the scheduler can order
it compressed), every prompt KV, in every layer and head, is given its sentence's
mean surprisal normalised to [0, 1] (``kvcompress.ops.surprisal``) as its slot metric;
the block-eviction schedule ranks them like any other metrics, and decode metrics add
to them later as for every policy.

Cost: the model's head over every prompt position of such a request (vLLM computes it
for the last one only); no extra forward. Positions not computed in this engine
(prefix-cache hits) have no surprisal; their sentences score the mean of the others.
After a preemption the prompt is prefilled again and scored again from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.logger import init_logger

from kvcompress.ops.metrics import accumulate_metrics
from kvcompress.ops.surprisal import SentenceEnds, sentence_scores, sentence_starts, token_surprisal
from kvcompress.vllm_glue.scoring_kind import PromptChunk, ScoringContext, ScoringKindGlue
from kvcompress.vllm_glue.step import StepTables
from kvcompress.vllm_glue.tokenizer_checks import sentence_ends

logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class SurprisalRows:
    """One request's prompt positions prefilled in this step.

    Attributes:
        request_id: the request.
        seq_slot: its row in the cache's tables.
        prompt: its prompt token ids.
        first: position of the step's first prompt token of it.
        count: how many of its prompt positions the step computed.
        row_start: the first of them in the step's flattened tokens (hidden-state row).
    """

    request_id: str
    seq_slot: int
    prompt: list[int]
    first: int
    count: int
    row_start: int

    @property
    def completes(self) -> bool:
        return self.first + self.count >= len(self.prompt)


class SurprisalScoring(ScoringKindGlue):
    """The glue of ``SentenceSurprisal``: keeps the surprisal of prompt tokens across a
    request's prefill chunks and writes the sentence scores as its slot metrics when
    its prompt completes."""

    recorded_as = "surprisal_nats"  # each prompt token's -log p, [prompt_len] (NaN: not computed)

    def __init__(self, context: ScoringContext) -> None:
        super().__init__(context)
        self.runner = context.runner  # its model's head (``compute_logits``) and vLLM's config
        self.state = context.state
        self._ends: SentenceEnds | None | bool = False  # False: not looked up yet
        # request id -> ([prompt_len] float32 nats, [prompt_len] bool known)
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: list[SurprisalRows] = []

    def sentence_ends(self) -> SentenceEnds | None:
        if self._ends is False:
            self._ends = sentence_ends(self.runner.vllm_config.model_config)
        return self._ends

    def prompt_rows(self, chunk: PromptChunk) -> None:
        """Queue this step's prompt positions, scored after the forward (prompt
        embeddings have no next tokens to score: a warning, decode metrics only); no
        prompt query scores keys."""
        token_ids = chunk.vllm_state.prompt_token_ids
        if token_ids is None:
            if chunk.first == 0:
                logger.warning(
                    "kvcompress: request %s has prompt embeddings, which policy 'surprisal' cannot "
                    "score: its KVs are ranked by decode metrics only", chunk.request_id,
                )
            return None
        count = min(chunk.count, chunk.prompt_len - chunk.first)
        self.pending.append(SurprisalRows(
            chunk.request_id, chunk.request.seq_slot, token_ids, chunk.first, count, chunk.row_start,
        ))
        return None

    def after_forward(self) -> None:
        if not self.pending:
            return
        executed = self.runner.execute_model_state
        if executed is None:  # nothing ran (vLLM returned early): nothing to score
            self.pending.clear()
        else:
            self.run(executed.hidden_states)

    def release(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    @torch.inference_mode()
    def run(self, hidden_states: torch.Tensor) -> None:
        """Score this step's pending rows from ``hidden_states [num_tokens, hidden]``."""
        pending, self.pending = self.pending, []
        for rows in pending:
            nats, known = self._buffer(rows)
            # position p's hidden state predicts prompt token p + 1
            count = min(rows.count, len(rows.prompt) - 1 - rows.first)
            if count > 0:
                hidden = hidden_states[rows.row_start : rows.row_start + count]
                next_ids = torch.tensor(rows.prompt[rows.first + 1 : rows.first + 1 + count], dtype=torch.int64)
                nats[rows.first + 1 : rows.first + 1 + count] = token_surprisal(
                    hidden, next_ids.to(hidden.device), self.runner.model.compute_logits,
                ).to(nats.device)
                known[rows.first + 1 : rows.first + 1 + count] = True
            if rows.completes:
                self._write_metrics(rows, nats, known)
                self._buffers.pop(rows.request_id, None)

    def _buffer(self, rows: SurprisalRows) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = self._buffers.get(rows.request_id)
        if buffer is None or rows.first == 0:  # a new prompt, or prefilled again after a preemption
            length = len(rows.prompt)
            buffer = (torch.zeros(length, dtype=torch.float32), torch.zeros(length, dtype=torch.bool))
            self._buffers[rows.request_id] = buffer
        return buffer

    def _write_metrics(self, rows: SurprisalRows, nats: torch.Tensor, known: torch.Tensor) -> None:
        cache, pool = self.state.cache, self.state.pool
        length = len(rows.prompt)
        if self.recording is not None:
            self.recording[rows.request_id] = torch.where(known, nats, torch.full_like(nats, float("nan")))
        starts = torch.from_numpy(sentence_starts(rows.prompt, self.sentence_ends()))
        scores = sentence_scores(nats, known, starts).to(cache.device)  # [prompt_len], position order
        slots = torch.tensor([rows.seq_slot], dtype=torch.int64, device=cache.device)
        tables, _ = StepTables.for_rows(cache, slots, np.array([length]))
        width = tables.num_pages * cache.block_size
        # Nothing is evicted before the prompt ends, so slot i holds position i; the
        # columns past the prompt (a resumed request's outputs) keep their metrics.
        per_slot = torch.zeros(width, dtype=torch.float32, device=cache.device)
        per_slot[: min(width, length)] = scores[:width]
        head_lens = cache.head_lens[rows.seq_slot].clamp_max(length)
        for layer in range(cache.num_layers):
            layer_tables = tables.layer(layer)[0]
            metric = per_slot.expand(layer_tables.shape[0], width)
            accumulate_metrics(pool.slot_metrics, pool.meta_tables(layer_tables), head_lens[layer], metric)
