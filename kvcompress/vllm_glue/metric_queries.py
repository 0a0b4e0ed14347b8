"""Which queries of a step with prompt rows add to the eviction metrics, per request's
policy.

Prompt queries: those the request's scoring kind asks for (``ScoringKindGlue.prompt_rows``,
``scoring_kinds.py``: the last ``observation_window`` prompt positions of attention-scored
policies, every prompt query in ``full`` mode; none for the position, random,
reconstruction and surprisal policies, whose kinds queue their own passes there).
Decode queries: every ``decode_metric_stride``-th token past the prompt, added by the
attention kernel or a metric pass of its own, or (vLLM's CPU kernel) recorded for the
runner's queue of decode queries. Reads vLLM's per-request state (``CachedRequestState``:
``num_prompt_tokens``, ``prompt_token_ids``, ``output_token_ids``) as the runner holds it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcompress.config import KVCompressConfig
from kvcompress.ops.decode_metrics import StepDecodeQueries
from kvcompress.ops.word_spans import WordEdges, span_starts
from kvcompress.vllm_glue.scoring_kind import PromptChunk
from kvcompress.vllm_glue.scoring_kinds import ScoringKinds
from kvcompress.vllm_glue.step import MetricQueries, PromptMetricRows
from kvcompress.vllm_glue.tokenizer_checks import word_edges
from kvcompress.worker_requests import WorkerRequests


@dataclass
class MetricQuerySelector:
    """Chooses a step's metric queries (the prompt rows by each request's scoring kind).

    ``requests``: the worker's live requests; ``model_config``: vLLM's (the tokenizer's
    word edges are loaded from it); ``device``: the pool's; ``num_layers``: the pool's
    layers; ``metric_power``: the server policy's decode metric power (1 or 2);
    ``kinds``: the pool's scoring kinds, asked for each prompt chunk's rows;
    ``word_edges``: the vocabulary's word edges (False: no tokenizer, pooling over tokens
    only; None: not loaded yet), loaded at once when the server's policy pools over
    words (~0.3 s for 49K ids), else at the first request whose policy does."""

    settings: KVCompressConfig
    requests: WorkerRequests
    model_config: Any
    device: torch.device
    num_layers: int
    metric_power: int
    kinds: ScoringKinds
    word_edges: WordEdges | bool | None = None

    def __post_init__(self) -> None:
        if self.word_edges is None and self.settings.policy_for().metric.pool_words:
            self._load_word_edges()

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
        first in the step's flattened tokens) that score keys, as its policy's scoring
        kind says (None: none; the kind may queue a pass of its own)."""
        request = self.requests[request_id]
        chunk = PromptChunk(
            state, request_id, request, index, first, count, row_start,
            word_starts=functools.partial(self.word_starts, state),
        )
        return self.kinds.of(request.compression.policy.metric.source).prompt_rows(chunk)

    def word_starts(self, state) -> torch.Tensor | None:
        """``[prompt_len]`` first position of each prompt token's word span (None
        without a tokenizer or token ids, e.g. prompt embeddings: token pooling only)."""
        if self.word_edges is None:
            self._load_word_edges()
        token_ids = state.prompt_token_ids
        if not self.word_edges or token_ids is None:
            return None
        return torch.from_numpy(span_starts(token_ids, self.word_edges)).to(self.device)

    def _load_word_edges(self) -> None:
        """The vocabulary's word edges by the server's span rule (False: no tokenizer)."""
        self.word_edges = word_edges(self.model_config, self.settings.word_spans) or False

    def decode_metric_due(self, position: int) -> bool:
        """Whether the decode query at ``position`` adds to the metrics
        (``decode_metric_stride``: every N-th token of a sequence)."""
        return position % self.settings.decode_metric_stride == 0
