"""Issue 56 item 2: the workspaces one attention layer call allocates on the CUDA path
are outside vLLM's profile run (it builds no attention metadata), so the KV memory was
sized without them: the decode launch's split-softmax partials (1 GiB per layer call at
1,023 decode rows x 32 query heads x head 128 past 32K-token heads), the head-major
query copies of the flattened prompt call, the split-KV scratch, the gathered tables.
``PerHeadLayout.transient_attention_bytes`` bounds them and the memory budget takes
it out of a profiled KV memory.

The bound is checked against what the launchers allocate at the layout's worst-case
shapes, counted by a ``TorchDispatchMode`` over CPU tensors with the kernels' launches
stubbed out (a launch allocates nothing; the interpreter's own copies are not the
GPU's). vLLM and triton are imported inside the tests (the Triton interpreter tests
must import triton first)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvcompress.ops import MetricSink, PagedBatch, PerHeadPagedCache, SlotBatch


class AllocatedBytes(TorchDispatchMode):
    """Bytes of every new storage an op returns inside the ``with`` (views and in-place
    results are not new): the sum of the allocations, at least their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        result = func(*args, **kwargs)
        for t in {id(t): t for t in tree_leaves(result) if isinstance(t, torch.Tensor)}.values():
            storage = t.untyped_storage()
            if storage.data_ptr() not in given:
                given.add(storage.data_ptr())
                self.total += storage.nbytes()
        return result


class _NoLaunch:
    """A Triton kernel whose launches do nothing (``kernel[grid](...)``)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.fixture
def no_launches(monkeypatch):
    # Not imported at module level: triton must first be imported with its interpreter
    # on, by tests/test_triton_kernels.py.
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from kvcompress.ops import triton_attention, unified_attention

    for name in ("_decode_kernel", "_decode_reduce_kernel", "_decode_metric_kernel", "_varlen_kernel"):
        monkeypatch.setattr(triton_attention, name, _NoLaunch(), raising=False)
    monkeypatch.setitem(unified_attention._state, "kernel", lambda *args, **kwargs: None)
    monkeypatch.setitem(unified_attention._state, "reason", None)
    monkeypatch.setitem(unified_attention._state, "split_kv", {})


def _layout(**overrides):
    from kvcompress.vllm_glue.memory import PerHeadLayout

    dims = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_size=16, max_num_seqs=6,
                max_model_len=1024, max_rows=8, num_q_heads=8, max_num_batched_tokens=40)
    return PerHeadLayout(**{**dims, **overrides})


def _worst_mixed_step(layout):
    """The layout's largest mixed step: ``max_num_seqs`` sequences, one prompt chunk and
    the rest decode rows (every one selected), ``max_num_batched_tokens`` rows, the step's
    tables gathered for ``max_model_len``-token heads. Returns (query, pool, cache,
    slots, the gathered tables' step, starts)."""
    from kvcompress.vllm_glue.step import StepTables

    seqs, tokens = layout.max_num_seqs, layout.max_num_batched_tokens
    cache = PerHeadPagedCache(64, layout.num_layers, layout.num_kv_heads, layout.block_size,
                              max_seqs=seqs + 1, max_pages_per_head=layout.max_pages_per_head)
    slots = torch.tensor([cache.new_sequence() for _ in range(seqs)])
    cache.host = None  # as on a GPU: the longest head is the host bound, max_model_len
    tables, _ = StepTables.for_rows(cache, slots, torch.full((seqs,), layout.max_model_len).numpy())
    assert tables.num_pages == layout.max_pages_per_head
    starts = [0, tokens - seqs + 1, *range(tokens - seqs + 2, tokens + 1)]
    query = torch.zeros(tokens, layout.num_q_heads, layout.head_dim, dtype=torch.bfloat16)
    buffer = torch.zeros(2, 65, layout.block_size, layout.head_dim, dtype=torch.bfloat16)
    return query, cache.kv_pool(buffer[0], buffer[1]), cache, slots, tables, starts


def test_unified_mixed_step_allocates_within_the_bound(no_launches):
    """A mixed step on vLLM's unified attention: the layer's gathered tables, the
    flattened prompt call, and the metric pass over every decode row."""
    from kvcompress.ops import unified_attention
    from kvcompress.ops.flattened import flat_query_starts

    layout = _layout()
    query, pool, cache, slots, tables, starts = _worst_mixed_step(layout)
    decode_rows = list(range(1, len(starts) - 1))
    sink = MetricSink.of_decode_rows(decode_rows, starts, 2, query.device)
    flat_starts = torch.from_numpy(flat_query_starts(starts, layout.num_kv_heads))
    out = torch.empty_like(query)  # vLLM's, profiled
    with AllocatedBytes() as allocated:
        batch = PagedBatch(tables.layer(1), cache.head_lens[slots, 1], starts, torch.zeros(len(query), dtype=torch.int64),
                           max_head_len=layout.max_model_len, flat_query_start_loc=flat_starts)
        unified_attention.paged_attention_unified(query, pool, batch, 0.125, out=out, metrics=sink)
    query_copies = 2 * query.numel() * query.element_size()  # the head-major query and output
    assert query_copies < allocated.total <= layout.transient_attention_bytes()


def test_decode_launches_allocate_within_the_bound(no_launches):
    """The project's Triton over the worst mixed step's decode rows (output and metrics),
    the eager slot decode of a decode-only step (``max_rows`` rows), and a decode call of
    vLLM's kernel with its split-KV scratch."""
    from kvcompress.ops import triton_attention, unified_attention

    layout = _layout()
    query, pool, cache, slots, tables, starts = _worst_mixed_step(layout)
    bound = layout.transient_attention_bytes()
    batch = PagedBatch(tables.layer(0), cache.head_lens[slots, 0], starts, torch.zeros(len(query), dtype=torch.int64),
                       max_head_len=layout.max_model_len)
    flags = torch.ones(len(starts) - 1, dtype=torch.bool)
    out = torch.empty_like(query)
    with AllocatedBytes() as allocated:
        triton_attention.paged_attention_triton(query, pool, batch, 0.125, out=out, metrics=MetricSink(flags))
    assert 0 < allocated.total <= bound

    rows = layout.max_rows
    slot_batch = SlotBatch(cache.tables.chunk_tables[:, 0], cache.head_lens[:, 0], torch.zeros(rows, dtype=torch.int32),
                           torch.zeros(rows, dtype=torch.int64), max_head_len=layout.max_model_len,
                           row_index=torch.arange(rows, dtype=torch.int32), chunks=cache.tables.chunks)
    rows_query = torch.zeros(rows, layout.num_q_heads, layout.head_dim, dtype=torch.bfloat16)
    rows_out = torch.empty_like(rows_query)
    metric_slots = torch.ones(cache.head_lens.shape[0], dtype=torch.int8)
    with AllocatedBytes() as allocated:
        triton_attention.paged_decode_by_slot_triton(rows_query, pool, slot_batch, 0.125, out=rows_out,
                                                     metrics=MetricSink(metric_slots))
    assert 0 < allocated.total <= bound

    group = layout.num_q_heads // layout.num_kv_heads
    flat_query = torch.zeros(rows * layout.num_kv_heads, group, layout.head_dim, dtype=torch.bfloat16)
    seq_lens = torch.ones(rows * layout.num_kv_heads, dtype=torch.int32)
    with AllocatedBytes() as allocated:
        unified_attention._attend(flat_query, pool, torch.empty_like(flat_query), torch.arange(len(seq_lens) + 1),
                                  1, seq_lens, 16, torch.zeros(len(seq_lens), 1, dtype=torch.int32), 0.125)
    assert 0 < allocated.total <= bound


def test_many_decode_rows_take_fewer_partitions_within_the_workspace(no_launches, monkeypatch):
    """The split-softmax partials were ``[rows, Hq, <= 64 partitions, D]`` float32 however
    many rows: 1 GiB per layer call at 1,023 rows x 32 query heads x head 128. Launches
    over many rows now take fewer, longer partitions within ``DECODE_WORKSPACE_BYTES``
    (here shrunk to 1 MiB so that CPU shapes reach it)."""
    from kvcompress.ops import triton_attention

    monkeypatch.setattr(triton_attention, "DECODE_WORKSPACE_BYTES", 1 << 20)
    layout = _layout(max_num_seqs=64, max_num_batched_tokens=80, max_rows=64, max_model_len=8192)
    query, pool, cache, slots, tables, starts = _worst_mixed_step(layout)
    batch = PagedBatch(tables.layer(0), cache.head_lens[slots, 0], starts, torch.zeros(len(query), dtype=torch.int64),
                       max_head_len=layout.max_model_len)
    out, sink = torch.empty_like(query), MetricSink(torch.ones(len(starts) - 1, dtype=torch.bool))
    with AllocatedBytes() as allocated:
        triton_attention.paged_attention_triton(query, pool, batch, 0.125, out=out, metrics=sink)
    decode_rows, padded = len(starts) - 2, 64
    before = decode_rows * layout.num_q_heads * (8192 // 512) * (padded + 2) * 4  # 16 partitions of 512 keys
    assert allocated.total <= (1 << 20) + (1 << 16) < before  # the partials within the bound, + tables
    assert triton_attention.decode_workspace_bytes(decode_rows, layout.num_q_heads, layout.head_dim) == 1 << 20


def test_the_bound_stays_modest_at_the_largest_flags():
    """Llama-3.1-8B on one GPU (32 query / 8 KV heads, head 128, bf16) at 1,024
    sequences x 128K tokens and 8,192 batched tokens: the decode partials alone were
    1 GiB per layer call; everything now stays under 0.8 GiB, most of it the step's
    tables (2 x 256 MiB for 1,024 x 8 heads x 8,192 pages)."""
    layout = _layout(num_layers=32, num_kv_heads=8, num_q_heads=32, head_dim=128, dtype_bytes=2, block_size=16,
                     max_num_seqs=1024, max_model_len=131072, max_rows=1024, max_num_batched_tokens=8192)
    assert layout.transient_attention_bytes() < 0.8 * (1 << 30)


def _worker(available: int, device_type: str, kv_cache_memory_bytes: int | None):
    """A worker with the budget mixin over a stand-in of vLLM's (its profiled memory
    ``available``) and the config :meth:`PerHeadLayout.from_vllm_config` reads."""
    import dataclasses

    from kvcompress.vllm_glue.memory import KVCompressWorkerMemory

    # A CPU engine's cache keeps identity metadata rows (kv_layout.uses_identity_rows).
    layout = dataclasses.replace(_layout(), identity_rows=device_type == "cpu")
    model = SimpleNamespace(
        get_num_layers=lambda parallel: layout.num_layers, get_num_kv_heads=lambda parallel: layout.num_kv_heads,
        get_num_attention_heads=lambda parallel: layout.num_q_heads, get_head_size=lambda: layout.head_dim,
        dtype=torch.bfloat16, max_model_len=layout.max_model_len,
    )
    config = SimpleNamespace(
        model_config=model, parallel_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=layout.max_num_seqs,
                                         max_num_batched_tokens=layout.max_num_batched_tokens),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=layout.max_rows),
        cache_config=SimpleNamespace(block_size=layout.block_size, enable_prefix_caching=False, cache_dtype="auto",
                                     kv_cache_memory_bytes=kv_cache_memory_bytes),
        device_config=SimpleNamespace(device_type=device_type),
    )

    class VllmWorker:
        def determine_available_memory(self) -> int:
            return available

    class Worker(KVCompressWorkerMemory, VllmWorker):
        vllm_config = config

    return Worker(), layout


def test_the_budget_takes_the_workspace_out_of_profiled_gpu_memory():
    """On a GPU whose KV memory vLLM profiled, the pages get what is left after the
    per-head metadata AND the attention workspace; a KV size the user gave
    (``kv_cache_memory_bytes``: vLLM leaves activations to them too) and CPU engines
    keep the metadata-only budget."""
    available = 64 << 20
    worker, layout = _worker(available, "cuda", None)
    transient = layout.transient_attention_bytes()
    assert transient > 0
    assert worker.determine_available_memory() == layout.page_bytes_for(available - transient)
    assert layout.page_bytes_for(available - transient) < layout.page_bytes_for(available)
    for device_type, given in (("cuda", available), ("cpu", None)):
        worker, layout = _worker(available, device_type, given)
        assert worker.determine_available_memory() == layout.page_bytes_for(available)
