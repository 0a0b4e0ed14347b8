"""Issue 56, items 1 and 3: what a mixed step (a prompt chunk and decode rows) hands
every layer's attention is worked out once per step. A real per-head cache on CPU, the
attention backend's impl run layer by layer; vLLM is imported inside the functions (the
Triton interpreter tests must import triton first).

Item 3: the batch's starts are scanned once per step (decode-only or not, the longest
chunk), not in Python at every layer call.

Item 1, the glue: the decode rows that add to the eviction metrics reach every layer as
one sink carrying the rows the runner selected on the host, so the metric pass of vLLM's
unified attention launches for those rows only (the kernel side:
tests/test_triton_kernels.py,
``test_decode_metric_pass_of_a_mixed_step_launches_only_the_selected_rows``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.ops import PerHeadPagedCache
from kvcompress.ops.dispatch import KernelOps

NUM_LAYERS, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 4, 2, 2, 64, 16


def _mixed_step(query_lens: list[int], context: int = 30, metric_seqs: list[int] | None = None,
               with_host_ids: bool = True, backend: str = "reference", kernel_layout: bool | None = None):
    """A worker state and a planned step: sequence ``s`` holds ``context + 3 * s``
    earlier tokens and has ``query_lens[s]`` new ones; ``metric_seqs``: the decode rows
    whose query adds to the metrics (with the runner's host ids when ``with_host_ids``).
    ``kernel_layout``: pages in vLLM's CPU kernel layout (default: for ``vllm_cpu``).
    Returns ``(state, step, layer names)``."""
    from kvcompress.vllm_glue.step import MetricQueries, PerHeadStep, StepTables, WorkerCacheState

    from kvcompress.ops import cpu_attention
    from kvcompress.ops.flattened import flat_query_starts

    num_seqs = len(query_lens)
    cache = PerHeadPagedCache(1024, NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, max_seqs=num_seqs + 1,
                              max_pages_per_head=16)
    slots = torch.tensor([cache.new_sequence() for _ in range(num_seqs)])
    held = torch.tensor([context + 3 * s for s in range(num_seqs)])
    cache.append(slots, held, torch.cat([torch.arange(int(n)) for n in held]))
    new = torch.tensor(query_lens)
    positions = torch.cat([torch.arange(int(h), int(h) + int(n)) for h, n in zip(held, new)])
    plan = cache.append(slots, new, positions)
    starts = [0, *np.cumsum(query_lens).tolist()]
    tables, max_head_len = StepTables.for_rows(cache, slots, (held + new).numpy())
    metrics = None
    if metric_seqs:
        flags = np.zeros(num_seqs, dtype=bool)
        flags[metric_seqs] = True
        metrics = MetricQueries(prompt_rows=[], decode_seqs=torch.from_numpy(flags), power=2,
                                decode_seq_ids=np.flatnonzero(flags) if with_host_ids else None)
    step = PerHeadStep(
        num_reqs=num_seqs, num_tokens=starts[-1], query_start_loc=starts, query_positions=positions,
        tables=tables, head_lens=cache.head_lens[slots], max_head_len=max_head_len, plan=plan,
        metrics=metrics, flat_query_start_loc=torch.from_numpy(flat_query_starts(starts, NUM_KV_HEADS)),
    )
    buffer = torch.randn(2, cache.num_pages + 1, BLOCK_SIZE, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    # vLLM's CPU kernel reads its own page layout (the engine's pool for it).
    if kernel_layout is None:
        kernel_layout = backend == "vllm_cpu"
    key_cache, value_cache = cpu_attention.pool_views(buffer) if kernel_layout else buffer
    names = [f"layers.{layer}.attn" for layer in range(NUM_LAYERS)]
    ops = KernelOps(torch.device("cpu"), {"paged_attention": backend, "paged_decode_by_slot": backend,
                                          "move_cache": "reference", "fill_page_tables": "reference"})
    state = WorkerCacheState(cache=cache, layer_index={name: i for i, name in enumerate(names)},
                             key_cache=key_cache, value_cache=value_cache, ops=ops)
    return state, step, names


class _Layer:
    """What the impl reads of vLLM's attention layer."""

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name


def _forward_all_layers(state, step, names, seed: int = 1) -> list[torch.Tensor]:
    """Every layer's attention of ``step`` through the backend's impl (new K / V and
    queries random); the layers' outputs ``[T, Hq * D]``."""
    from kvcompress.vllm_glue import step as step_state
    from kvcompress.vllm_glue.attention_backend import KVCompressAttentionImpl, KVCompressAttentionMetadata

    impl = KVCompressAttentionImpl(NUM_KV_HEADS * GROUP, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, None, None, "auto")
    generator = torch.Generator().manual_seed(seed)
    tokens = step.num_tokens
    metadata = KVCompressAttentionMetadata(tokens, step)
    outputs = []
    step_state.set_worker_state(state)
    try:
        for name in names:
            query = torch.randn(tokens, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
            key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
            value = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
            output = torch.empty(tokens, NUM_KV_HEADS * GROUP * HEAD_DIM)
            impl.forward(_Layer(name), query, key, value, None, metadata, output)
            outputs.append(output)
    finally:
        step_state.set_worker_state(None)
    return outputs





def _record_sinks(monkeypatch) -> list:
    """The ``metrics`` argument of every ``KernelOps.paged_attention`` call."""
    sinks = []
    attend = KernelOps.paged_attention

    def recorded(self, query, pool, batch, scale, out=None, metrics=None, **knobs):
        sinks.append(metrics)
        return attend(self, query, pool, batch, scale, out, metrics, **knobs)

    monkeypatch.setattr(KernelOps, "paged_attention", recorded)
    return sinks


def test_every_layer_gets_one_sink_with_the_selected_rows(monkeypatch):
    """1 prompt chunk + 8 decode rows, decode row 5 selected: one sink for all layers,
    its rows (sequence 5, query row 5 + 8) made once, the metrics those of the flags."""
    query_lens = [8] + [1] * 8
    sinks = _record_sinks(monkeypatch)
    state, step, names = _mixed_step(query_lens, metric_seqs=[5])
    _forward_all_layers(state, step, names)
    assert len(sinks) == NUM_LAYERS and all(sink is sinks[0] for sink in sinks)
    assert sinks[0].rows.tolist() == [[5], [5 + 7]]
    assert sinks[0].selected is step.metrics.decode_seqs

    # Same metrics as the flags alone give (the runner without host ids).
    plain_state, plain_step, _ = _mixed_step(query_lens, metric_seqs=[5], with_host_ids=False)
    _forward_all_layers(plain_state, plain_step, names)
    assert sinks[-1].rows is None
    assert state.pool.slot_metrics.sum() > 0
    torch.testing.assert_close(state.pool.slot_metrics, plain_state.pool.slot_metrics)


@pytest.mark.parametrize("backend", ["vllm_cpu", "cuda"])
def test_the_batch_rows_are_scanned_once_per_step(monkeypatch, backend):
    """Every layer's call scanned the starts in Python: ``PagedBatch.decode_only()`` (a
    loop over all rows: in the dispatch, ``cuda``, and the flattened kernels,
    ``vllm_cpu``) and the longest chunk's ``max(...)`` (flattened; 140 rows take the
    by-head call): ~33K iterations per mixed step at 1,024 rows x 32 layers, on the host's
    critical path (attention runs eagerly between piecewise graphs). Now the step scans
    them once (``QueryLayout.of``) and every layer's batch shares the result; the
    outputs are those of the reference."""
    from kvcompress.ops import cpu_attention
    from kvcompress.ops.kv_pool import QueryLayout

    if backend == "vllm_cpu" and cpu_attention.unavailable_reason() is not None:
        pytest.skip(cpu_attention.unavailable_reason())
    scans = []
    scan = QueryLayout.of.__func__
    monkeypatch.setattr(QueryLayout, "of", classmethod(lambda cls, starts: scans.append(1) or scan(cls, starts)))
    layouts = []
    attend = KernelOps.paged_attention

    def recorded(self, query, pool, batch, *args, **kwargs):
        layouts.append(batch.layout)
        return attend(self, query, pool, batch, *args, **kwargs)

    monkeypatch.setattr(KernelOps, "paged_attention", recorded)
    query_lens = [140] + [1] * 8
    state, step, names = _mixed_step(query_lens, backend=backend)
    outputs = _forward_all_layers(state, step, names)
    assert len(scans) == 1 and len(layouts) == NUM_LAYERS
    assert all(layout is step.query_layout for layout in layouts)
    assert step.query_layout.longest_chunk == 140 and not step.query_layout.decode_only

    ref_state, ref_step, _ = _mixed_step(query_lens, backend="reference", kernel_layout=backend == "vllm_cpu")
    for got, want in zip(outputs, _forward_all_layers(ref_state, ref_step, names)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
