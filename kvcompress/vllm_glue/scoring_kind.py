"""A scoring kind's glue half: its hooks into the model runner and the attention backend.

A scoring kind is how a policy's per-KV scores are produced (attention metrics of prompt
and decode queries, the token position, noise, kvzip's reconstruction pass, surprisal,
kvc-ea's expected-attention ranking). Like vLLM's KV connector it has two halves: a
vLLM-free one (its ``MetricSource`` in ``kvcompress.policies``, its ranking rule in
``ops/policy_scores.py``, its kernels in ``ops``) and a glue one, a
:class:`ScoringKindGlue` whose hooks the engine calls: which prompt rows attention
scores, what runs after the step's forward, what a finished request drops, what runs
once a layer's prompt metrics are final. One row of ``scoring_kinds.SCORING_KINDS``
joins the two; the runner, the metric-query selector and the attention backend only
call the hooks (every one a no-op here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from kvcompress.vllm_glue.step import PromptMetricRows, PromptScored, WorkerCacheState
from kvcompress.worker_requests import WorkerRequest


@dataclass(frozen=True)
class ScoringContext:
    """What a kind's glue may use, one per pool.

    Attributes:
        runner: vLLM's model runner with ``KVCompressRunnerMixin`` (its ``model``,
            ``_model_forward``, ``vllm_config`` and ``execute_model_state``).
        state: the worker's pool.
        layer_names: the attention layers' names, in layer order.
    """

    runner: Any
    state: WorkerCacheState
    layer_names: list[str]


@dataclass(frozen=True)
class PromptChunk:
    """A compressing request's prompt positions ``[first, first + count)`` computed
    this step.

    Attributes:
        vllm_state: vLLM's ``CachedRequestState`` (``num_prompt_tokens``,
            ``prompt_token_ids``, ``output_token_ids``).
        request_id: the request.
        request: its worker state (policy, budget, sequence slot).
        index: its row in the step's batch.
        first: its first prompt position computed this step.
        count: the positions computed this step (a preempted request's outputs may follow).
        row_start: the row of ``first`` in the step's flattened tokens.
        word_starts: ``() -> [prompt_len]`` int64 first position of each prompt token's
            word span (None without a tokenizer or token ids).
    """

    vllm_state: Any
    request_id: str
    request: WorkerRequest
    index: int
    first: int
    count: int
    row_start: int
    word_starts: Callable[[], torch.Tensor | None]

    @property
    def prompt_len(self) -> int:
        return self.vllm_state.num_prompt_tokens


class ScoringKindGlue:
    """The hooks of one scoring kind, each a no-op: a kind overrides those it needs.
    One instance per pool and kind (``scoring_kinds.ScoringKinds``)."""

    recorded_as: ClassVar[str] = "scores"
    """The compression record's key for what ``recording`` keeps of a request."""

    def __init__(self, context: ScoringContext) -> None:
        self.context = context
        # request id -> a tensor tests read (e.g. raw scores), kept while recording is on
        # until the request's compression record takes it (None: off).
        self.recording: dict[str, torch.Tensor] | None = None

    def prompt_rows(self, chunk: PromptChunk) -> PromptMetricRows | None:
        """The chunk's query rows whose attention scores the request's keys this step
        (None: none); a kind scored otherwise may queue its own pass here."""
        return None

    def prompt_scored(self, scored: PromptScored) -> None:
        """Called by the attention backend in each layer once a prompt's metrics are
        scored and pooled (the ``at_prompt_end`` of the rows ``prompt_rows`` made)."""

    def after_forward(self) -> None:
        """Called after the step's forward (``execute_model``), before sampling."""

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: drop what is kept for it."""

    def record(self, on: bool) -> None:
        """Start (``on``) or stop keeping what tests read of this kind's scoring."""
        if not on or self.recording is None:  # kept until its compression reads it
            self.recording = {} if on else None

    def recorded(self, request_id: str) -> dict[str, Any]:
        """What was kept of the request's scoring (record keys, JSON-ready), forgotten."""
        kept = (self.recording or {}).pop(request_id, None)
        return {} if kept is None else {self.recorded_as: kept.tolist()}
