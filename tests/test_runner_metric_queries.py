"""The runner's choice of metric queries (issue 56, item 1): the decode rows whose query
adds to the metrics this step reach the attention as host ids, so the decode metric pass
of a mixed step launches for those rows only (``MetricSink.rows``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from test_cuda_glue_runner import pool_runner


def test_metric_queries_name_the_selected_decode_rows_on_the_host(monkeypatch):
    runner = pool_runner()
    selector = runner.kvc_planner.metric_queries
    stride = runner.kvc_settings.decode_metric_stride
    prompt_len = 40
    # Decode rows at positions due (multiples of the stride) and not due.
    positions = [prompt_len + 1, 2 * stride * 4, prompt_len + 3, 3 * stride * 4]
    req_ids = [f"r{i}" for i in range(len(positions))]
    vllm_requests = {r: SimpleNamespace(num_prompt_tokens=prompt_len) for r in req_ids}
    monkeypatch.setattr(runner.kvc_requests, "request_compresses", lambda request_id: True)
    computed = np.array(positions, dtype=np.int64)
    # a metric pass per step (CUDA), not vLLM's CPU kernel's queue
    queries = selector.select(vllm_requests, req_ids, computed, np.ones(4, dtype=np.int64), np.arange(5),
                              np.arange(4), queue_decode=False)
    due = [i for i, p in enumerate(positions) if p % stride == 0]
    assert due == [1, 3]  # the oracle: the stride rule by hand
    assert queries.decode_seqs.tolist() == [i in due for i in range(4)]
    assert queries.decode_seq_ids is not None and queries.decode_seq_ids.tolist() == due
    assert queries.decode_queries is None


def test_queued_decode_queries_name_the_due_rows_tokens_slots_and_positions(monkeypatch):
    """On vLLM's CPU kernel (``queue_decode``) the due decode rows are recorded for the
    queue instead: their query tokens (``query_start``), slots and positions, no metric
    pass of the step."""
    runner = pool_runner()
    selector = runner.kvc_planner.metric_queries
    stride = runner.kvc_settings.decode_metric_stride
    positions = [41, 2 * stride * 4, 43, 3 * stride * 4]
    req_ids = [f"r{i}" for i in range(len(positions))]
    vllm_requests = {r: SimpleNamespace(num_prompt_tokens=40) for r in req_ids}
    monkeypatch.setattr(runner.kvc_requests, "request_compresses", lambda request_id: True)
    slots = np.array([5, 6, 7, 8])
    queries = selector.select(vllm_requests, req_ids, np.array(positions, dtype=np.int64), np.ones(4, dtype=np.int64),
                              np.arange(5), slots, queue_decode=True)
    assert queries.decode_seqs is None and queries.decode_seq_ids is None and queries.prompt_rows == []
    queued = queries.decode_queries
    assert queued.token_rows.tolist() == [1, 3] and queued.slots.tolist() == [6, 8]
    assert queued.positions.tolist() == [positions[1], positions[3]]
    assert queued.num_layers == runner.kvc_cache.num_layers
