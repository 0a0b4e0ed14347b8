"""Which queries of a step with prompt rows add to the eviction metrics, per request's
policy, and which requests the post-forward scoring passes (kvzip's reconstruction,
surprisal) take up after the step's forward.

Prompt queries: the last ``observation_window`` prompt positions (every prompt query in
``full`` mode; none for the position, random, reconstruction and surprisal policies).
Decode queries: every ``decode_metric_stride``-th token past the prompt, added by the
attention kernel or a metric pass of its own, or (vLLM's CPU kernel) recorded for the
runner's queue of decode queries. Reads vLLM's per-request state (``CachedRequestState``:
``num_prompt_tokens``, ``prompt_token_ids``, ``output_token_ids``) as the runner holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.logger import init_logger

from kvcompress.config import KVCompressConfig
from kvcompress.ops.deferred_metrics import StepDecodeQueries
from kvcompress.ops.word_spans import WordEdges, span_starts
from kvcompress.policies import MetricSpec
from kvcompress.vllm_glue.reconstruction import PendingReconstruction
from kvcompress.vllm_glue.step import MetricQueries, PromptMetricRows
from kvcompress.vllm_glue.surprisal import SurprisalRows, SurprisalScoring
from kvcompress.vllm_glue.tokenizer_checks import word_edges
from kvcompress.worker_requests import WorkerRequests

logger = init_logger(f"vllm.{__name__}")


@dataclass
class MetricQuerySelector:
    """Chooses a step's metric queries and queues its post-forward scoring.

    ``requests``: the worker's live requests; ``model_config``: vLLM's (the tokenizer's
    word edges are loaded from it); ``device``: the pool's; ``num_layers``: the pool's
    layers; ``metric_power``: the server policy's decode metric power (1 or 2);
    ``surprisal``: the surprisal pass whose pending rows this selector fills;
    ``reconstructions``: requests whose prompt finishes prefilling this step and whose
    policy scores KVs by a reconstruction pass (kvzip), run after the step's forward;
    ``word_edges``: the vocabulary's word edges (False: no tokenizer, pooling over tokens
    only; None: not loaded yet), loaded at once when the server's policy pools over
    words (~0.3 s for 49K ids), else at the first request whose policy does."""

    settings: KVCompressConfig
    requests: WorkerRequests
    model_config: Any
    device: torch.device
    num_layers: int
    metric_power: int
    surprisal: SurprisalScoring
    reconstructions: list[PendingReconstruction] = field(default_factory=list)
    word_edges: WordEdges | bool | None = None

    def __post_init__(self) -> None:
        if self.word_edges is None and self.settings.policy_for().metric.pool_words:
            self.word_edges = word_edges(self.model_config) or False

    def select(self, vllm_requests, req_ids, computed: np.ndarray, num_new: np.ndarray,
               query_start: np.ndarray, slots: np.ndarray, queue_decode: bool) -> MetricQueries | None:
        """The step's metric queries (None: none), compressing requests only.

        ``vllm_requests``: vLLM's request states by id; ``req_ids`` / ``computed`` /
        ``num_new`` / ``slots``: ``[num_reqs]`` the batch's rows; ``query_start``:
        ``[num_reqs + 1]``; ``queue_decode``: decode rows' queries are recorded for the
        queue (``MetricQueries.decode_queries``) instead of a metric pass of the step."""
        if not self.settings.compresses and not self.requests.any_compresses():
            return None
        prompt_rows = []
        decode_seqs = np.zeros(len(req_ids), dtype=bool)
        for index, request_id in enumerate(req_ids):
            if not self.requests.request_compresses(request_id):
                continue
            state = vllm_requests[request_id]
            first, count = int(computed[index]), int(num_new[index])
            if first >= state.num_prompt_tokens:
                decode_seqs[index] = count == 1 and self.decode_metric_due(first)
                continue
            row = self._prompt_row(state, request_id, index, first, count, int(query_start[index]))
            if row is not None:
                prompt_rows.append(row)
        any_decode = bool(decode_seqs.any())
        if not prompt_rows and not any_decode:
            return None
        decode_queries = None
        if any_decode and queue_decode:
            metric_rows = np.flatnonzero(decode_seqs)
            decode_queries = StepDecodeQueries(
                torch.from_numpy(query_start[metric_rows].astype(np.int64)), slots[metric_rows],
                computed[metric_rows], self.num_layers,
            )
        pass_rows = any_decode and decode_queries is None
        return MetricQueries(
            prompt_rows=prompt_rows,
            decode_seqs=torch.from_numpy(decode_seqs).to(self.device) if pass_rows else None,
            power=self.metric_power,
            prompt_weight=1.0 / self.settings.decode_metric_stride,
            decode_queries=decode_queries,
            # The metric pass of a mixed step launches for these rows only.
            decode_seq_ids=np.flatnonzero(decode_seqs) if pass_rows else None,
        )

    def _prompt_row(self, state, request_id: str, index: int, first: int, count: int,
                    row_start: int) -> PromptMetricRows | None:
        """Row ``index``'s prompt queries ``[first, first + count)`` (``row_start``: the
        first in the step's flattened tokens) by its policy: queued for reconstruction or
        surprisal, or the metric rows its observation window covers (None: none)."""
        prompt_len = state.num_prompt_tokens
        compression = self.requests[request_id].compression
        spec = compression.policy.metric
        if spec.reconstructs and first + count >= prompt_len:
            pending = self._pending_reconstruction(state, request_id, first + count, spec)
            if pending is not None:
                self.reconstructions.append(pending)
        if spec.scores_surprisal:
            self._queue_surprisal(state, request_id, first, min(count, prompt_len - first), row_start)
        if not spec.scores_prompt:
            return None  # position / random / reconstruction / surprisal policies: no prompt queries
        scoring_from = 0 if spec.queries == "full" else prompt_len - spec.observation_window
        lo, hi = max(first, scoring_from), min(first + count, prompt_len)
        if hi <= lo:
            return None
        start = row_start - first
        done = hi == prompt_len
        words = self.word_starts(state) if done and spec.pool_words else None
        return PromptMetricRows(
            index, start + lo, start + hi, done, spec, words,
            protected_prefix=compression.budget.protected_prefix,
            protected_window=compression.budget.protected_window,
            end_position=hi,
        )

    def _queue_surprisal(self, state, request_id: str, first: int, count: int, row_start: int) -> None:
        """Score this step's prompt positions of a surprisal request after the forward
        (prompt embeddings have no next tokens to score: a warning, decode metrics only)."""
        token_ids = state.prompt_token_ids
        if token_ids is None:
            if first == 0:
                logger.warning(
                    "kvcompress: request %s has prompt embeddings, which policy 'surprisal' cannot "
                    "score: its KVs are ranked by decode metrics only", request_id,
                )
            return
        seq_slot = self.requests[request_id].seq_slot
        self.surprisal.pending.append(SurprisalRows(request_id, seq_slot, token_ids, first, count, row_start))

    def _pending_reconstruction(self, state, request_id: str, num_cached: int,
                                spec: MetricSpec) -> PendingReconstruction | None:
        """The reconstruction of a request holding ``num_cached`` tokens' KVs after
        this step (its prompt, and its outputs when it resumes after a preemption);
        None, with a warning, for prompt embeddings (no tokens to repeat: its KVs
        keep the decode metrics only)."""
        context = [*(state.prompt_token_ids or ()), *state.output_token_ids][:num_cached]
        if len(context) < num_cached:
            logger.warning(
                "kvcompress: request %s has prompt embeddings, which the kvzip reconstruction "
                "pass cannot repeat: its KVs are ranked without reconstruction scores", request_id,
            )
            return None
        words = self.word_starts(state) if spec.pool_words else None
        return PendingReconstruction(request_id, self.requests[request_id].seq_slot, context, spec, words)

    def word_starts(self, state) -> torch.Tensor | None:
        """``[prompt_len]`` first position of each prompt token's word span (None
        without a tokenizer or token ids, e.g. prompt embeddings: token pooling only)."""
        if self.word_edges is None:
            self.word_edges = word_edges(self.model_config) or False
        token_ids = state.prompt_token_ids
        if not self.word_edges or token_ids is None:
            return None
        return torch.from_numpy(span_starts(token_ids, self.word_edges)).to(self.device)

    def decode_metric_due(self, position: int) -> bool:
        """Whether the decode query at ``position`` adds to the metrics
        (``decode_metric_stride``: every N-th token of a sequence)."""
        return position % self.settings.decode_metric_stride == 0

    def take_reconstructions(self) -> list[PendingReconstruction]:
        """The reconstructions queued since the last call (the step's forward ran)."""
        pending, self.reconstructions = self.reconstructions, []
        return pending
