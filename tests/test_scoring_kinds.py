"""A scoring kind is two halves joined by one registry row (issue 58, step 4): a dummy
kind defined only here (its vLLM-free source class and ranking rule, its glue class, one
``SCORING_KINDS`` entry, a policy using it) gets its hooks called by the metric-query
selector, the runner and the attention backend, with no file of the package edited."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch

from kvcompress.config import KVCompressConfig
from kvcompress.policies import POLICIES, GlobalSplit, MetricSource, MetricSpec, PolicyDefinition


@dataclass(frozen=True)
class NewestFirst(MetricSource):
    """The dummy kind's vLLM-free half: the newest KV goes first."""

    kind: ClassVar[str] = "newest-first"


def _newest_first(source, metrics, positions, generator):
    return -positions.to(torch.float32)


def _recording_glue():
    """The dummy kind's glue half: every hook call is recorded; its prompt rows are the
    chunk's last query only (a choice no registered kind makes)."""
    from kvcompress.vllm_glue.scoring_kind import ScoringKindGlue
    from kvcompress.vllm_glue.step import PromptMetricRows

    class RecordingGlue(ScoringKindGlue):
        made: ClassVar[list] = []

        def __init__(self, context) -> None:
            super().__init__(context)
            self.calls: list[tuple] = []
            self.made.append(self)

        def prompt_rows(self, chunk):
            self.calls.append(("prompt_rows", chunk.request_id, chunk.first, chunk.count, chunk.row_start))
            end = chunk.row_start + chunk.count
            return PromptMetricRows(chunk.index, end - 1, end, True, chunk.request.compression.policy.metric,
                                    at_prompt_end=self.prompt_scored)

        def prompt_scored(self, scored) -> None:
            self.calls.append(("prompt_scored", scored.rows.seq_index, tuple(scored.query.shape)))

        def after_forward(self) -> None:
            self.calls.append(("after_forward",))

        def release(self, request_id: str) -> None:
            self.calls.append(("release", request_id))

        def record(self, on: bool) -> None:
            self.calls.append(("record", on))

    return RecordingGlue


@pytest.fixture
def dummy_kind(monkeypatch):
    """The kind's one registry row, its ranking rule and a policy ``newest`` using it."""
    from kvcompress.ops.policy_scores import RANKERS
    from kvcompress.vllm_glue.scoring_kinds import SCORING_KINDS

    glue = _recording_glue()
    monkeypatch.setitem(SCORING_KINDS, NewestFirst, glue)
    monkeypatch.setitem(RANKERS, NewestFirst, _newest_first)
    monkeypatch.setitem(POLICIES, "newest", PolicyDefinition("newest", MetricSpec(source=NewestFirst()), GlobalSplit()))
    return glue


def test_the_dummy_kinds_vllm_free_half_ranks_by_its_rule(dummy_kind):
    from kvcompress.ops.policy_scores import policy_metrics

    policy = KVCompressConfig(enabled=True, rate=4).policy_for("newest")
    positions = torch.tensor([[[[3, 0, 7, 5]]]])
    ranked = policy_metrics(policy, torch.rand(1, 1, 1, 4), positions)
    assert ranked.tolist() == [[[[-3.0, 0.0, -7.0, -5.0]]]]


def test_the_runner_and_the_selector_call_the_dummy_kinds_hooks(dummy_kind, monkeypatch):
    from test_cuda_glue_runner import pool_runner

    from kvcompress.budget import request_budget
    from kvcompress.contract import RequestCompression
    from kvcompress.vllm_glue import diagnostics

    runner = pool_runner()
    glue = runner.kvc_scoring.of(NewestFirst())
    assert isinstance(glue, dummy_kind) and dummy_kind.made[-1] is glue
    settings = KVCompressConfig(enabled=True, rate=4)
    budget = request_budget(settings, {})  # the server policy's budget; the request's policy is ours
    runner.kvc_requests.admit("d", RequestCompression(budget, settings.policy_for("newest")))
    runner.kvc_requests.admit("k", RequestCompression(budget, settings.policy_for("kvc")))
    monkeypatch.setattr(runner.kvc_requests, "request_compresses", lambda request_id: True)
    prompt_len = 40
    vllm_requests = {r: SimpleNamespace(num_prompt_tokens=prompt_len, prompt_token_ids=list(range(prompt_len)),
                                        output_token_ids=[]) for r in ("k", "d")}
    # Row 0: a kvc request's chunk [0, 24); row 1: the dummy's chunk [24, 40), tokens 24..39.
    queries = runner.kvc_planner.metric_queries.select(
        vllm_requests, ["k", "d"], np.array([0, 24]), np.array([24, 16]), np.array([0, 24, 40]),
        np.array([0, 1]), queue_decode=False,
    )
    assert glue.calls == [("prompt_rows", "d", 24, 16, 24)]
    # kvc's rows (its observation window's part of [0, 24)) and the dummy's last query, as its glue chose.
    kvc_rows, rows = queries.prompt_rows
    window = settings.policy_for("kvc").metric.observation_window
    assert (kvc_rows.seq_index, kvc_rows.row_start, kvc_rows.row_end) == (0, prompt_len - window, 24)
    assert (rows.seq_index, rows.row_start, rows.row_end) == (1, 39, 40)
    assert rows.spec.source == NewestFirst() and rows.at_prompt_end == glue.prompt_scored

    runner._kvc_after_forward(runner.kvc_planner)
    runner.kvc_scoring.release(["d"])
    diagnostics.record_compressions(runner, True)
    assert glue.calls[1:] == [("after_forward",), ("release", "d"), ("record", True)]


def test_the_attention_backend_calls_the_dummy_kinds_prompt_end_hook(dummy_kind):
    """One layer pass per layer over a planned step whose prompt rows the dummy glue
    made: its ``prompt_scored`` runs once per layer, with the rows' queries."""
    from test_cuda_mixed_step_plan import GROUP, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, _forward_all_layers, _mixed_step

    from kvcompress.vllm_glue.scoring_kind import PromptChunk
    from kvcompress.vllm_glue.step import MetricQueries

    glue = dummy_kind(None)
    state, step, names = _mixed_step([8])
    request = SimpleNamespace(compression=SimpleNamespace(policy=KVCompressConfig(enabled=True, rate=4).policy_for("newest")))
    chunk = PromptChunk(SimpleNamespace(num_prompt_tokens=8), "d", request, 0, 0, 8, 0, word_starts=lambda: None)
    step.metrics = MetricQueries(prompt_rows=[glue.prompt_rows(chunk)], decode_seqs=None, power=2)
    _forward_all_layers(state, step, names)
    assert glue.calls[1:] == [("prompt_scored", 0, (1, NUM_KV_HEADS * GROUP, HEAD_DIM))] * NUM_LAYERS


def test_a_source_without_a_registry_row_is_named():
    from test_cuda_glue_runner import pool_runner

    with pytest.raises(LookupError, match="NewestFirst"):
        pool_runner().kvc_scoring.of(NewestFirst())
