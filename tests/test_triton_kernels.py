"""Triton kernels (paged attention, decode metrics, MoveCache) and the backend dispatch
against the PyTorch reference ops.

On CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` must be set when
``triton.jit`` decorates them, so the env var is set before triton is imported here and,
for this module's tests, the kernel modules are (re)loaded under it and reloaded
without it afterwards (the variable does not leak into other tests' subprocesses).
Shapes are tiny: the interpreter is slow.

On a GPU machine, ``KVCOMPRESS_TRITON_TEST_DEVICE=cuda`` runs the same checks compiled on
CUDA tensors instead.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import replace

_WANT_CUDA = os.environ.get("KVCOMPRESS_TRITON_TEST_DEVICE", "cpu") == "cuda"
_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not _WANT_CUDA and _PREVIOUS_INTERPRET != "1" and "triton" in sys.modules:
    # Triton's own jit helpers (tl.zeros ...) are built when triton is imported; imported
    # without the interpreter they fail inside interpreted kernels ("Cannot call
    # @triton.jit'd outside of the scope of a kernel"), whatever this module reloads.
    raise RuntimeError(
        "triton was imported before test_triton_kernels (a test module collected earlier "
        "imports vLLM or triton at module level): import them inside the tests"
    )
if not _WANT_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (module top)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kvcompress.ops import dispatch  # noqa: E402
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch  # noqa: E402
from kvcompress.ops.move_cache import move_cache as reference_move_cache  # noqa: E402
from kvcompress.ops.reference_attention import reference_paged_attention as reference_attention  # noqa: E402

if _WANT_CUDA and not torch.cuda.is_available():
    pytest.skip("KVCOMPRESS_TRITON_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

DEVICE = torch.device("cuda" if _WANT_CUDA else "cpu")
KERNEL_MODULES = ("kvcompress.ops.triton_attention", "kvcompress.ops.triton_move_cache")


def _restore_interpret() -> None:
    if _PREVIOUS_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET


def _load_kernels() -> None:
    """Import the kernel modules so that their kernels match the current TRITON_INTERPRET."""
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)


if not _WANT_CUDA:
    _load_kernels()
    _restore_interpret()  # set again by the fixture while this module's tests run


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    if _WANT_CUDA:
        _load_kernels()  # compiled kernels; nothing to restore
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    _load_kernels()
    yield
    _restore_interpret()
    _load_kernels()  # leave compiled (non-interpreted) kernels for anyone after us


def _kernels():
    return sys.modules["kvcompress.ops.triton_attention"], sys.modules["kvcompress.ops.triton_move_cache"]


TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# -- cache construction -----------------------------------------------------------------


def _random_cache(seed, lengths, block_size, head_dim, dtype, num_pages=96, spread=3):
    """Pool with ragged per-head lengths (as after eviction), pages in scrambled order,
    positions distinct but neither contiguous nor sorted in slot order (as after MoveCache).

    Returns (KVPool, block_tables, max_position per sequence); the K/V caches are
    strided views ``pool[:, 0]``, ``pool[:, 1]`` of a ``[N, 2, b, D]`` buffer, the slot
    metrics zeros.
    """
    generator = torch.Generator().manual_seed(seed)
    num_seqs, num_kv_heads = lengths.shape
    pool = torch.randn(num_pages, 2, block_size, head_dim, generator=generator).to(dtype)
    slot_positions = torch.full((num_pages, block_size), -1, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=generator).tolist()
    max_pages = int(((lengths.max() + block_size - 1) // block_size).item())
    # One spare column: entries past a head's pages must be ignored.
    tables = torch.zeros(num_seqs, num_kv_heads, max(1, max_pages) + 1, dtype=torch.int64)
    top = []
    for s in range(num_seqs):
        seq_top = 0
        for h in range(num_kv_heads):
            n = int(lengths[s, h])
            pages = [order.pop() for _ in range((n + block_size - 1) // block_size)]
            if pages:
                tables[s, h, : len(pages)] = torch.tensor(pages)
            positions = torch.randperm(spread * n + 1, generator=generator)[:n]
            for i in range(n):
                slot_positions[pages[i // block_size], i % block_size] = int(positions[i])
            seq_top = max(seq_top, int(positions.max()) if n else 0)
        top.append(seq_top)
    pool = pool.to(DEVICE)
    slot_metrics = torch.zeros(num_pages, block_size, device=DEVICE)
    kv_pool = KVPool(pool[:, 0], pool[:, 1], slot_positions.to(DEVICE), slot_metrics)
    return kv_pool, tables.to(DEVICE), top


def _run_both(query, pool, batch, *, metrics=None, flags=None, power=2, **triton_kwargs):
    """Reference and Triton results (Triton's output buffer poisoned with NaN first);
    with ``metrics`` (start values) and ``flags``, each adds into its own copy."""
    triton_attention, _ = _kernels()
    scale = query.shape[-1] ** -0.5
    sink = None if metrics is None else MetricSink(flags, power)
    ref_pool = pool if metrics is None else replace(pool, slot_metrics=metrics.clone())
    tri_pool = pool if metrics is None else replace(pool, slot_metrics=metrics.clone())
    expected = reference_attention(query, ref_pool, batch, scale, metrics=sink)
    out = torch.full_like(query, float("nan"))
    result = triton_attention.paged_attention_triton(
        query, tri_pool, batch, scale, out=out, metrics=sink, **triton_kwargs
    )
    assert result is out
    if metrics is None:
        return expected, out, None, None
    return expected, out, ref_pool.slot_metrics, tri_pool.slot_metrics


def _queries_ending_at(top, query_lens, num_q_heads, head_dim, dtype):
    """Random queries, sequence ``s``'s ``query_lens[s]`` of them at the positions up to
    its ``top[s]``: (query_start_loc list, positions, query ``[T, num_q_heads, D]``)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query_pos = torch.tensor(
        [p for s, n in enumerate(query_lens) for p in range(top[s] - n + 1, top[s] + 1)], device=DEVICE)
    query = torch.randn(starts[-1], num_q_heads, head_dim).to(dtype).to(DEVICE)
    return starts, query_pos, query


def _assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    assert not torch.isnan(actual).any(), "a row was not written"
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# -- decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_partitions_matches_reference(group, dtype):
    """Ragged heads (one empty), partial pages, unsorted positions, several partitions
    per head (partition = 2 pages), some keys invisible to the query by position."""
    block_size, head_dim, kv_heads = 16, 64, 2
    lengths = torch.tensor([[37, 5], [1, 70], [33, 0], [20, 64]])
    pool, tables, top = _random_cache(group, lengths, block_size, head_dim, dtype)
    # Seq 0 sees all its keys; the others only those at positions <= their query's.
    query_pos = torch.tensor([top[0], 60, 40, 3], device=DEVICE)
    query = torch.randn(4, kv_heads * group, head_dim).to(dtype).to(DEVICE)
    batch = PagedBatch(tables, lengths.to(DEVICE), [0, 1, 2, 3, 4], query_pos)
    for partition_size in (32, 512):  # v2 (split + reduce) and v1 (single partition)
        expected, out, _, _ = _run_both(query, pool, batch, partition_size=partition_size)
        _assert_close(out, expected, dtype)
    # The empty head's query group reads nothing: zeros, like the reference.
    assert torch.equal(out[2, group:].float().cpu(), torch.zeros(group, head_dim))


@pytest.mark.parametrize(
    "head_dim,block_size,dtype",
    [(128, 32, torch.float16), (256, 16, torch.float32), (80, 32, torch.bfloat16)],
)
def test_decode_head_sizes_block_sizes_dtypes(head_dim, block_size, dtype):
    lengths = torch.tensor([[45, 100], [3, 64]])
    pool, tables, top = _random_cache(7, lengths, block_size, head_dim, dtype, num_pages=32)
    query = torch.randn(2, 4, head_dim).to(dtype).to(DEVICE)
    batch = PagedBatch(tables, lengths.to(DEVICE), [0, 1, 2], torch.tensor(top, device=DEVICE))
    expected, out, _, _ = _run_both(query, pool, batch, partition_size=64)
    _assert_close(out, expected, dtype)


def test_decode_partitions_stay_few_whatever_the_head_bound():
    """Issue 15 item 5: decode rows of a mixed step sized their split-softmax workspace
    ``[rows, Hq, parts, D]`` by the host bound of the longest head in 512-token
    partitions (256 partitions, ~1 GB per layer call at 128K). Partitions now number at
    most MAX_GRAPH_PARTITIONS; programs past a head return at once. Same result."""
    from torch.profiler import ProfilerActivity, profile

    from kvcompress.ops.decode_by_slot import MAX_GRAPH_PARTITIONS

    block_size, head_dim, kv_heads, group = 16, 64, 2, 2
    lengths = torch.tensor([[37, 5], [1, 70]])
    pool, tables, top = _random_cache(21, lengths, block_size, head_dim, torch.float32)
    query = torch.randn(2, kv_heads * group, head_dim).to(DEVICE)
    bound = 131072  # a host bound far above every head, as off the CPU
    batch = PagedBatch(tables, lengths.to(DEVICE), [0, 1, 2], torch.tensor(top, device=DEVICE), max_head_len=bound)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        expected, out, _, _ = _run_both(query, pool, batch, partition_size=512)
    _assert_close(out, expected, torch.float32)
    largest = max(event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0)
    workspace_cap = 2 * kv_heads * group * MAX_GRAPH_PARTITIONS * head_dim * 4
    assert largest <= workspace_cap < 2 * kv_heads * group * (bound // 512) * head_dim * 4


# -- decode metrics -------------------------------------------------------------------------


@pytest.mark.parametrize("power", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_metrics_match_reference_deltas(power, dtype):
    """slot_metrics gains sum_group(prob ** power) at the visible held slots of flagged
    sequences only; every other slot of the pool keeps its value bit for bit."""
    block_size, head_dim, kv_heads, group = 16, 64, 2, 2
    lengths = torch.tensor([[37, 5], [1, 70], [33, 33], [20, 64]])
    pool, tables, top = _random_cache(11, lengths, block_size, head_dim, dtype)
    num_pages = pool.key_cache.shape[0]
    base = torch.rand(num_pages, block_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    flags = torch.tensor([True, True, False, True], device=DEVICE)
    query_pos = torch.tensor([top[0], top[1], top[2], 50], device=DEVICE)
    query = torch.randn(4, kv_heads * group, head_dim).to(dtype).to(DEVICE)
    batch = PagedBatch(tables, lengths.to(DEVICE), [0, 1, 2, 3, 4], query_pos)
    for partition_size in (32, 512):
        expected, out, ref_metrics, tri_metrics = _run_both(
            query, pool, batch, metrics=base, flags=flags, power=power, partition_size=partition_size,
        )
        _assert_close(out, expected, dtype)
        ref_delta, tri_delta = ref_metrics - base, tri_metrics - base
        touched = ref_delta != 0
        assert touched.sum() > 50  # the check is not vacuous
        torch.testing.assert_close(tri_delta, ref_delta, atol=1e-6, rtol=1e-4)
        # Sparse: slots nobody read are untouched (exact), unflagged seq 2 included.
        assert torch.equal(tri_metrics[~touched], base[~touched])
        seq2_pages = tables[2, :, :3].reshape(-1)
        assert torch.equal(tri_metrics[seq2_pages], base[seq2_pages])


def test_decode_partitions_lengthen_within_the_workspace_bound(monkeypatch):
    """Issue 56 item 2: a decode launch's split-softmax workspace stays within
    DECODE_WORKSPACE_BYTES (outside vLLM's profile run) by taking fewer, longer
    partitions over many rows. Bound shrunk so that these 4 rows get 2 partitions of
    whole tiles where 32-key ones would make 3: output and metrics, and the metric pass
    alone (no output: maxima and sums only), still equal the reference."""
    triton_attention, _ = _kernels()
    block_size, head_dim, kv_heads, group = 16, 64, 2, 2
    per_partition = 4 * kv_heads * group * (head_dim + 2) * 4  # rows x Hq x (D + max, sum) float32
    monkeypatch.setattr(triton_attention, "DECODE_WORKSPACE_BYTES", 2 * per_partition)
    assert triton_attention._decode_partitions(4, kv_heads * group, head_dim, 70, 32, block_size, 4) == (4, 2)
    lengths = torch.tensor([[37, 5], [1, 70], [33, 33], [20, 64]])
    pool, tables, top = _random_cache(17, lengths, block_size, head_dim, torch.float32)
    num_pages = pool.key_cache.shape[0]
    base = torch.rand(num_pages, block_size, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    flags = torch.tensor([True, True, False, True], device=DEVICE)
    query = torch.randn(4, kv_heads * group, head_dim).to(DEVICE)
    batch = PagedBatch(tables, lengths.to(DEVICE), [0, 1, 2, 3, 4], torch.tensor(top, device=DEVICE))
    expected, out, ref_metrics, tri_metrics = _run_both(query, pool, batch, metrics=base, flags=flags, partition_size=32)
    _assert_close(out, expected, torch.float32)
    torch.testing.assert_close(tri_metrics - base, ref_metrics - base, atol=1e-6, rtol=1e-4)

    metric_pool = replace(pool, slot_metrics=base.clone())
    triton_attention.decode_metrics_triton(query, metric_pool, batch, head_dim ** -0.5, MetricSink(flags),
                                           partition_size=32)
    torch.testing.assert_close(metric_pool.slot_metrics - base, ref_metrics - base, atol=1e-6, rtol=1e-4)


def test_decode_metric_pass_of_a_mixed_step_launches_only_the_selected_rows(monkeypatch):
    """Issue 56 item 1: the metric pass of a mixed step (vLLM's unified attention returns
    no probabilities) ran the decode kernels over every decode row, though only the rows
    selected this step (1 in ``decode_metric_stride``) add to the metrics. A sink made
    from the selected sequences known on the host launches for those rows only (nothing
    read on the host); the metrics equal the reference's."""
    triton_attention, _ = _kernels()
    block_size, head_dim, kv_heads, group = 16, 64, 2, 2
    query_lens = [9] + [1] * 8  # one prompt chunk, eight decode rows
    lengths = torch.tensor([[20, 9]] + [[10 + 7 * s, 40 - 3 * s] for s in range(8)])
    pool, tables, top = _random_cache(31, lengths, block_size, head_dim, torch.float32)
    starts, query_pos, query = _queries_ending_at(top, query_lens, kv_heads * group, head_dim, torch.float32)
    batch = PagedBatch(tables, lengths.to(DEVICE), starts, query_pos)
    selected_seq, scale = 4, head_dim ** -0.5
    flags = torch.tensor([s == selected_seq for s in range(len(query_lens))], device=DEVICE)
    want_pool = replace(pool, slot_metrics=torch.zeros_like(pool.slot_metrics))
    reference_attention(query, want_pool, batch, scale, metrics=MetricSink(flags))

    launched_rows = []
    launch = triton_attention._launch_decode

    def counted_launch(*args, **kwargs):
        launched_rows.append(args[5][0].numel())  # rows = (dec_seq, dec_tok)
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "_launch_decode", counted_launch)
    got_pool = replace(pool, slot_metrics=torch.zeros_like(pool.slot_metrics))
    sink = MetricSink.of_decode_rows([selected_seq], starts, 2, DEVICE)
    triton_attention.decode_metrics_triton(query, got_pool, batch, scale, sink)
    assert launched_rows == [1]
    assert want_pool.slot_metrics.sum() > 0  # the check is not vacuous
    torch.testing.assert_close(got_pool.slot_metrics, want_pool.slot_metrics, atol=1e-6, rtol=1e-4)


# -- decode over slot-indexed tables (the CUDA-graph path) ------------------------------------


@pytest.mark.parametrize("power", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_by_slot_matches_reference(power, dtype):
    """Rows reach their tables through seq_slots (any order), padding rows point at an
    empty slot (zeros, no metrics), metrics are flagged per slot, and the partition grid
    is sized by a fixed max_head_len far above every head (as under a CUDA graph)."""
    from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference

    triton_attention, _ = _kernels()
    block_size, head_dim, kv_heads, group = 16, 64, 2, 2
    # Slot 5 is the empty padding slot.
    lengths = torch.tensor([[37, 5], [1, 70], [33, 33], [20, 64], [16, 0], [0, 0]])
    pool, tables, top = _random_cache(13, lengths, block_size, head_dim, dtype)
    # Wide tables, like PerHeadPagedCache.page_tables[:, layer] (max_model_len columns).
    wide = torch.zeros(tables.shape[0], kv_heads, 16, dtype=torch.int64, device=DEVICE)
    wide[:, :, : tables.shape[2]] = tables
    seq_slots = torch.tensor([3, 1, 5, 0, 4, 5], dtype=torch.int32, device=DEVICE)
    query_pos = torch.tensor([50, top[1], 0, top[0], top[4], 0], device=DEVICE)
    metric_slots = torch.tensor([1, 1, 0, 1, 0, 0], dtype=torch.int8, device=DEVICE)
    query = torch.randn(6, kv_heads * group, head_dim).to(dtype).to(DEVICE)
    base = torch.rand(*pool.slot_positions.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    scale = head_dim ** -0.5
    ref_metrics = base.clone()
    # Only the kernels read max_head_len: a bound far above every head, as under a graph.
    batch = SlotBatch(wide, lengths.to(DEVICE), seq_slots, query_pos, max_head_len=16 * block_size)
    sink = MetricSink(metric_slots, power)
    expected = paged_decode_by_slot_reference(
        query, replace(pool, slot_metrics=ref_metrics), batch, scale, metrics=sink
    )
    assert torch.equal(expected[2].float().cpu(), torch.zeros(kv_heads * group, head_dim))
    for partition_size in (32, 512):
        out = torch.full_like(query, float("nan"))
        tri_metrics = base.clone()
        triton_attention.paged_decode_by_slot_triton(
            query, replace(pool, slot_metrics=tri_metrics), batch, scale, out=out, metrics=sink,
            partition_size=partition_size,
        )
        _assert_close(out, expected, dtype)
        ref_delta, tri_delta = ref_metrics - base, tri_metrics - base
        touched = ref_delta != 0
        assert touched.sum() > 50
        torch.testing.assert_close(tri_delta, ref_delta, atol=1e-6, rtol=1e-4)
        assert torch.equal(tri_metrics[~touched], base[~touched])
        # Slot 4 is in the batch but not flagged: its pages keep their metrics.
        assert torch.equal(tri_metrics[wide[4, 0, :1]], base[wide[4, 0, :1]])
    # Dispatch: forced Triton runs this kernel; the reference is the CPU default.
    with dispatch.use_backend("triton"):
        out = dispatch.paged_decode_by_slot(query, pool, batch, scale)
    _assert_close(out, expected, dtype)


def test_decode_by_slot_reads_two_level_tables():
    """The engine's tables are two-level (ChunkedPageTables): the slot decode reads a chunk
    id, then the page id inside the chunk. Same output and metrics as over flat tables, with
    chunks scattered in the second level (chunk 0 unused, as in the cache)."""
    from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference

    triton_attention, _ = _kernels()
    block_size, head_dim, kv_heads, group, chunk = 16, 64, 2, 2, 4
    lengths = torch.tensor([[37, 5], [1, 70], [33, 33], [20, 64], [0, 0]])
    pool, tables, top = _random_cache(29, lengths, block_size, head_dim, torch.float32)
    flat = torch.zeros(tables.shape[0], kv_heads, 16, dtype=torch.int64, device=DEVICE)
    flat[:, :, : tables.shape[2]] = tables
    num_heads = flat.shape[0] * kv_heads
    # Every (slot, head) gets 4 chunks of 4 columns at random places of a second level.
    order = torch.randperm(num_heads * 4, generator=torch.Generator().manual_seed(1)) + 1
    chunk_ids = order.view(flat.shape[0], kv_heads, 4).to(torch.int32).to(DEVICE)
    chunks = torch.zeros(num_heads * 4 + 1, chunk, dtype=torch.int32, device=DEVICE)
    chunks[chunk_ids.long().view(-1)] = flat.view(-1, chunk).to(torch.int32)
    seq_slots = torch.tensor([3, 1, 4, 0, 2], dtype=torch.int32, device=DEVICE)
    query_pos = torch.tensor([50, top[1], 0, top[0], top[2]], device=DEVICE)
    metric_slots = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int8, device=DEVICE)
    query = torch.randn(5, kv_heads * group, head_dim).to(DEVICE)
    scale = head_dim ** -0.5
    flat_batch = SlotBatch(flat, lengths.to(DEVICE), seq_slots, query_pos, max_head_len=16 * block_size)
    two_level = replace(flat_batch, block_tables=chunk_ids, chunks=chunks)
    assert two_level.max_pages == flat_batch.max_pages == 16
    sink = MetricSink(metric_slots, 2)
    ref_metrics = pool.slot_metrics.clone()
    expected = paged_decode_by_slot_reference(query, replace(pool, slot_metrics=ref_metrics), flat_batch,
                                              scale, metrics=sink)
    chunked_metrics = pool.slot_metrics.clone()
    via_reference = paged_decode_by_slot_reference(query, replace(pool, slot_metrics=chunked_metrics),
                                                   two_level, scale, metrics=sink)
    assert torch.equal(via_reference, expected) and torch.equal(chunked_metrics, ref_metrics)
    tri_metrics = pool.slot_metrics.clone()
    out = triton_attention.paged_decode_by_slot_triton(query, replace(pool, slot_metrics=tri_metrics),
                                                       two_level, scale, metrics=sink, partition_size=32)
    _assert_close(out, expected, torch.float32)
    torch.testing.assert_close(tri_metrics, ref_metrics, atol=1e-6, rtol=1e-4)
    assert (ref_metrics != pool.slot_metrics).sum() > 50


# -- mixed batches (prefill, chunked-prefill continuations, decodes) ---------------------------


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_batch(group, dtype):
    """Seq 0: a chunked-prefill continuation (queries start mid-sequence); seq 1: decode;
    seq 2: a longer chunk split over several query blocks, some of whose queries see no
    key; seq 3: decode with several partitions; seq 4: a fresh prefill over ragged heads."""
    block_size, head_dim, kv_heads = 16, 64, 2
    lengths = torch.tensor([[37, 5], [1, 70], [33, 40], [50, 64], [9, 9]])
    pool, tables, top = _random_cache(3 + group, lengths, block_size, head_dim, dtype)
    query_lens = [3, 1, 21, 1, 9]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query_pos = []
    for s, n in enumerate(query_lens):
        if s == 2:
            query_pos += list(range(-2, n - 2))  # the first two see nothing
        else:
            query_pos += list(range(top[s] - n + 1, top[s] + 1))
    query_pos = torch.tensor(query_pos, device=DEVICE)
    query = torch.randn(starts[-1], kv_heads * group, head_dim).to(dtype).to(DEVICE)
    batch = PagedBatch(tables, lengths.to(DEVICE), starts, query_pos)
    expected, out, _, _ = _run_both(query, pool, batch, partition_size=32, block_m=16, varlen_tile=32)
    _assert_close(out, expected, dtype)
    assert torch.equal(out[4:6].float().cpu(), torch.zeros(2, kv_heads * group, head_dim))


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_in_prefill_chunks_and_decodes(window, dtype):
    """A sliding-window layer (issue 60): each query sees the stored positions in
    ``(p - W, p]`` only, in the varlen kernel (chunks, split over query blocks) and in the
    partitioned decode (partitions wholly behind the window give nothing), over compacted
    heads whose positions are neither contiguous nor sorted; as the reference, which
    tests/test_sliding_window_ops.py checks against a brute force."""
    block_size, head_dim, kv_heads, group = 16, 64, 2, 2
    lengths = torch.tensor([[37, 5], [1, 70], [33, 40], [50, 64]])
    pool, tables, top = _random_cache(41 + window, lengths, block_size, head_dim, dtype)
    starts, query_pos, query = _queries_ending_at(top, [3, 1, 21, 1], kv_heads * group, head_dim, dtype)
    batch = PagedBatch(tables, lengths.to(DEVICE), starts, query_pos, sliding_window=window)
    expected, out, _, _ = _run_both(query, pool, batch, partition_size=32, block_m=16, varlen_tile=32)
    _assert_close(out, expected, dtype)
    unwindowed, _, _, _ = _run_both(query, pool, replace(batch, sliding_window=None), partition_size=32)
    assert not torch.allclose(expected.float(), unwindowed.float(), atol=1e-2)  # the window cut keys off


def test_sliding_window_decode_by_slot_and_dispatch():
    """The slot decode (the CUDA-graph path) applies the window too, and the dispatch
    hands a windowed call to the Triton backend when it is the one chosen (it applies
    windows); a windowed call with decode metrics is refused (such a layer is never
    compressed)."""
    from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference

    triton_attention, _ = _kernels()
    block_size, head_dim, kv_heads, group, window = 16, 64, 2, 2, 9
    lengths = torch.tensor([[37, 5], [20, 70], [33, 33], [0, 0]])
    pool, tables, top = _random_cache(17, lengths, block_size, head_dim, torch.float32)
    wide = torch.zeros(tables.shape[0], kv_heads, 16, dtype=torch.int64, device=DEVICE)
    wide[:, :, : tables.shape[2]] = tables
    seq_slots = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEVICE)
    query_pos = torch.tensor([top[2], top[0], 0, top[1]], device=DEVICE)
    query = torch.randn(4, kv_heads * group, head_dim).to(DEVICE)
    scale = head_dim ** -0.5
    batch = SlotBatch(wide, lengths.to(DEVICE), seq_slots, query_pos, max_head_len=16 * block_size,
                      sliding_window=window)
    expected = paged_decode_by_slot_reference(query, pool, batch, scale)
    out = triton_attention.paged_decode_by_slot_triton(query, pool, batch, scale, partition_size=32)
    _assert_close(out, expected, torch.float32)
    with dispatch.use_backend("triton"):
        ops = dispatch.resolve_ops(DEVICE, ["paged_attention", "paged_decode_by_slot"])
    assert ops._backend_for_call("paged_decode_by_slot", query, pool, batch, None).name == "triton"
    with pytest.raises(ValueError, match="no decode metrics"):
        triton_attention.paged_decode_by_slot_triton(
            query, pool, batch, scale, metrics=MetricSink(torch.ones(4, dtype=torch.int8, device=DEVICE), 2))


def test_write_then_attend_through_the_paged_cache_in_chunks():
    """End to end with the real page tables: a prompt written in two chunks (the second a
    continuation) then one decode; each step's Triton output equals the reference's."""
    from kvcompress.ops import PerHeadPagedCache, reference_write_kv as write_kv

    triton_attention, _ = _kernels()
    torch.manual_seed(3)
    heads, group, head_dim, block_size = 2, 2, 64, 16
    cache = PerHeadPagedCache(32, 1, heads, block_size, max_seqs=2, max_pages_per_head=8, device=DEVICE)
    buffer = torch.zeros(32, 2, block_size, head_dim, device=DEVICE)
    key_cache, value_cache = buffer[:, 0], buffer[:, 1]
    pool = cache.kv_pool(key_cache, value_cache)
    seq = torch.tensor([cache.new_sequence()], device=DEVICE)
    total = 40
    queries = torch.randn(total, heads * group, head_dim, device=DEVICE)
    keys = torch.randn(total, heads, head_dim, device=DEVICE)
    values = torch.randn(total, heads, head_dim, device=DEVICE)
    for start, end in [(0, 17), (17, 39), (39, 40)]:
        plan = cache.append(seq, torch.tensor([end - start]), torch.arange(start, end))
        write_kv(key_cache, value_cache, keys[start:end], values[start:end],
                 plan.write_pages[0], plan.write_offsets[0])
        batch = PagedBatch(cache.flat_page_tables()[seq, 0], cache.head_lens[seq, 0], [0, end - start],
                           torch.arange(start, end, device=DEVICE))
        args = (queries[start:end], pool, batch, head_dim**-0.5)
        expected = reference_attention(*args)
        out = torch.full_like(expected, float("nan"))
        triton_attention.paged_attention_triton(*args, out=out, partition_size=16)
        _assert_close(out, expected, torch.float32)


# -- FP8 pages (--kv-cache-dtype fp8*, unit scales) ---------------------------------------------


def _fp8_pages(pool, page_dtype):
    """The pool with its K / V pages rounded to ``page_dtype``, halves of one buffer."""
    pages = torch.stack([pool.key_cache, pool.value_cache], dim=1).to(page_dtype)
    return replace(pool, key_cache=pages[:, 0], value_cache=pages[:, 1])


@pytest.mark.parametrize("page_dtype,dtype", [
    (torch.float8_e4m3fn, torch.float32), (torch.float8_e5m2, torch.bfloat16),
])
def test_fp8_pages_mixed_batch_decode_by_slot_and_metrics(page_dtype, dtype):
    """FP8 pages under float32 / bf16 queries: the varlen, decode and slot-decode kernels
    and their metrics match the reference reading the same pages (it upcasts them)."""
    from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference

    triton_attention, _ = _kernels()
    block_size, head_dim, kv_heads, group = 16, 64, 2, 2
    lengths = torch.tensor([[37, 5], [1, 70], [33, 40], [50, 64], [9, 9]])
    pool, tables, top = _random_cache(21, lengths, block_size, head_dim, torch.float32)
    pool = _fp8_pages(pool, page_dtype)
    assert pool.key_cache.dtype == page_dtype
    starts, query_pos, query = _queries_ending_at(top, [3, 1, 21, 1, 9], kv_heads * group, head_dim, dtype)
    batch = PagedBatch(tables, lengths.to(DEVICE), starts, query_pos)
    base = torch.rand(*pool.slot_positions.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    flags = torch.tensor([False, True, False, True, False], device=DEVICE)
    expected, out, ref_metrics, tri_metrics = _run_both(
        query, pool, batch, metrics=base, flags=flags, partition_size=32, block_m=16, varlen_tile=32)
    _assert_close(out, expected, dtype)
    assert (ref_metrics != base).sum() > 50
    torch.testing.assert_close(tri_metrics, ref_metrics, atol=1e-6, rtol=1e-4)
    # The CUDA-graph decode: rows reach their tables through slots.
    decode = [1, 3]
    slot_batch = SlotBatch(tables, lengths.to(DEVICE), torch.tensor(decode, dtype=torch.int32, device=DEVICE),
                           torch.tensor([top[s] for s in decode], device=DEVICE), max_head_len=8 * block_size)
    rows = query[[starts[s] for s in decode]]
    sink = MetricSink(torch.ones(len(lengths), dtype=torch.int8, device=DEVICE), 2)
    ref_metrics, tri_metrics = base.clone(), base.clone()
    want = paged_decode_by_slot_reference(rows, replace(pool, slot_metrics=ref_metrics), slot_batch, 0.1, metrics=sink)
    got = triton_attention.paged_decode_by_slot_triton(
        rows, replace(pool, slot_metrics=tri_metrics), slot_batch, 0.1, out=torch.empty_like(rows), metrics=sink)
    _assert_close(got, want, dtype)
    torch.testing.assert_close(tri_metrics, ref_metrics, atol=1e-6, rtol=1e-4)
    assert (ref_metrics != base).sum() > 50


# -- MoveCache ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_move_cache_is_bit_exact(dtype):
    _, triton_move_cache = _kernels()
    generator = torch.Generator().manual_seed(0)
    num_pages, block_size, head_dim = 12, 16, 64
    pool = torch.randn(num_pages, 2, block_size, head_dim, generator=generator).to(dtype)
    metrics = torch.rand(num_pages, block_size, generator=generator)
    positions = torch.randperm(num_pages * block_size, generator=generator).to(torch.int32)
    positions = positions.view(num_pages, block_size)
    slots = torch.randperm(num_pages * block_size, generator=generator)
    num_moves = 37  # not a multiple of the moves per program
    src, dst = slots[:num_moves], slots[num_moves : 2 * num_moves]  # disjoint
    moves = [
        t.to(DEVICE) for t in (src // block_size, src % block_size, dst // block_size, dst % block_size)
    ]

    def copies():
        return pool.clone().to(DEVICE), metrics.clone().to(DEVICE), positions.clone().to(DEVICE)

    ref_pool, ref_metrics, ref_positions = copies()
    reference_move_cache(KVPool(ref_pool[:, 0], ref_pool[:, 1], ref_positions, ref_metrics), *moves)
    tri_pool, tri_metrics, tri_positions = copies()
    tri_kv_pool = KVPool(tri_pool[:, 0], tri_pool[:, 1], tri_positions, tri_metrics)
    triton_move_cache.move_cache_triton(tri_kv_pool, *moves)
    assert not torch.equal(ref_pool, pool.to(DEVICE))  # something moved
    bits = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8}.get(dtype, torch.int32)
    assert torch.equal(tri_pool.view(bits), ref_pool.view(bits))
    assert torch.equal(tri_metrics, ref_metrics)
    assert torch.equal(tri_positions, ref_positions)
    # No moves: nothing happens (and no launch with an empty grid).
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    triton_move_cache.move_cache_triton(tri_kv_pool, empty, empty, empty, empty)
    assert torch.equal(tri_metrics, ref_metrics)


# -- dispatch ---------------------------------------------------------------------------------


def _small_decode_case():
    lengths = torch.tensor([[20, 7], [1, 33]])
    pool, tables, top = _random_cache(1, lengths, 16, 64, torch.float32, num_pages=16)
    query = torch.randn(2, 4, 64, device=DEVICE)
    batch = PagedBatch(tables, lengths.to(DEVICE), [0, 1, 2], torch.tensor(top, device=DEVICE))
    return query, pool, batch, 0.125


@pytest.mark.skipif(_WANT_CUDA, reason="CPU dispatch rules")
def test_dispatch_defaults_to_reference_on_cpu(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.requested_backend() == "auto"
    # Even with the interpreter on, "auto" never picks it: vLLM's CPU kernel where it
    # runs, else the reference; MoveCache always on the reference.
    from kvcompress.ops import cpu_attention

    kernel = ["vllm_cpu"] if cpu_attention.unavailable_reason() is None else []
    assert dispatch.selected_backend("cpu") == (kernel or ["reference"])[0]
    assert dispatch.selected_backend("cpu", "move_cache") == "reference"
    assert dispatch.available_backends("cpu") == ["triton", *kernel, "reference"]
    assert dispatch.available_backends("cpu", "move_cache") == ["triton", "reference"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.available_backends("cpu") == [*kernel, "reference"]
    args = _small_decode_case()
    torch.testing.assert_close(dispatch.paged_attention(*args), reference_attention(*args))


@pytest.mark.skipif(_WANT_CUDA, reason="CPU dispatch rules")
def test_dispatch_forced_triton_under_interpreter(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    args = _small_decode_case()
    expected = reference_attention(*args)
    calls = []
    triton_attention, triton_move_cache = _kernels()
    original = triton_attention.paged_attention_triton

    def spy(*a, **k):
        calls.append("attention")
        return original(*a, **k)

    monkeypatch.setattr(triton_attention, "paged_attention_triton", spy)
    with dispatch.use_backend("triton"):
        assert dispatch.selected_backend("cpu") == "triton"
        torch.testing.assert_close(dispatch.paged_attention(*args), expected, atol=1e-5, rtol=1e-5)
        with dispatch.use_backend("reference"):  # nests
            assert dispatch.selected_backend("cpu") == "reference"
        assert dispatch.requested_backend() == "triton"
    assert calls == ["attention"]
    assert dispatch.requested_backend() == "auto"
    # The environment variable works too, for both ops.
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.selected_backend("cpu", "move_cache") == "triton"
    pool = args[1]
    one = torch.tensor([0], device=DEVICE)
    moved = pool.key_cache[1, 3].clone()
    dispatch.move_cache(pool, one + 1, one + 3, one, one)
    assert torch.equal(pool.key_cache[0, 0], moved)
    # Forced Triton without the interpreter on CPU tensors is refused.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(dispatch.BackendUnavailableError, match="TRITON_INTERPRET"):
        dispatch.paged_attention(*args)


@pytest.mark.skipif(_WANT_CUDA, reason="CPU dispatch rules")
def test_dispatch_forcing_cuda_on_cpu_raises(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(dispatch.BackendUnavailableError, match="cuda.*CUDA tensors"):
        dispatch.selected_backend("cpu")
    with pytest.raises(dispatch.BackendUnavailableError, match="KVCOMPRESS_OPS_BACKEND=cuda"):
        dispatch.paged_attention(*_small_decode_case())
    monkeypatch.setenv(dispatch.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="unknown kvcompress ops backend"):
        dispatch.selected_backend("cpu")
    with pytest.raises(ValueError):
        with dispatch.use_backend("fast"):
            pass


def test_kernel_layer_imports_without_triton():
    """With triton unimportable the modules still import, dispatch runs the reference,
    and forcing Triton names the reason."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvcompress.ops import KVPool, PagedBatch, dispatch, triton_attention, triton_move_cache\n"
        "assert not triton_attention.HAS_TRITON and not triton_move_cache.HAS_TRITON\n"
        "assert dispatch.selected_backend('cpu') in ('vllm_cpu', 'reference')\n"
        "q = torch.randn(1, 2, 64); kc = torch.randn(2, 16, 64)\n"
        "pos = torch.arange(32, dtype=torch.int32).view(2, 16)\n"
        "tables = torch.zeros(1, 1, 1, dtype=torch.long)\n"
        "pool = KVPool(kc, kc, pos, torch.zeros(2, 16))\n"
        "batch = PagedBatch(tables, torch.tensor([[5]]), [0, 1], torch.tensor([9]))\n"
        "out = dispatch.paged_attention(q, pool, batch, 0.1)\n"
        "assert out.shape == q.shape and not out.isnan().any()\n"
        "with dispatch.use_backend('triton'):\n"
        "    try:\n"
        "        dispatch.selected_backend('cpu')\n"
        "    except dispatch.BackendUnavailableError as e:\n"
        "        assert 'triton is not importable' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('forced triton did not raise')\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", dispatch.ENV_VAR)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# The schemas registered by csrc/torch_bindings.cpp, implemented on CPU by the reference:
# checks the CUDA branch of the dispatch (argument names, decode-only routing) without a GPU.
_FAKE_SCHEMAS = {
    "paged_decode_attention": (
        "paged_decode_attention(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor slot_positions, Tensor block_tables, Tensor head_lens, Tensor query_positions, "
        "float scale, int partition_size, Tensor!? slot_metrics, Tensor? metric_seqs, "
        "int metric_power) -> ()"
    ),
    "move_cache": (
        "move_cache(Tensor! key_cache, Tensor! value_cache, Tensor! slot_metrics, "
        "Tensor! slot_positions, Tensor src_pages, Tensor src_offsets, Tensor dst_pages, "
        "Tensor dst_offsets) -> ()"
    ),
}
_fake_calls = []
_fake_library = None


def _fake_cuda_ops():
    global _fake_library
    if _fake_library is None:
        _fake_library = torch.library.Library("kvcompress_dispatch_test", "DEF")
        for schema in _FAKE_SCHEMAS.values():
            _fake_library.define(schema)

        def decode(out, query, key_cache, value_cache, slot_positions, block_tables, head_lens,
                   query_positions, scale, partition_size, slot_metrics, metric_seqs, metric_power):
            _fake_calls.append(("paged_decode_attention", partition_size))
            pool = KVPool(key_cache, value_cache, slot_positions, slot_metrics)
            batch = PagedBatch(block_tables, head_lens, list(range(query.shape[0] + 1)), query_positions)
            sink = None if slot_metrics is None else MetricSink(metric_seqs, metric_power)
            reference_attention(query, pool, batch, scale, out=out, metrics=sink)

        def move(key_cache, value_cache, slot_metrics, slot_positions, *moves):
            _fake_calls.append(("move_cache",))
            reference_move_cache(KVPool(key_cache, value_cache, slot_positions, slot_metrics), *moves)

        _fake_library.impl("paged_decode_attention", decode, "CPU")
        _fake_library.impl("move_cache", move, "CPU")
    namespace = torch.ops.kvcompress_dispatch_test
    return {"paged_attention": namespace.paged_decode_attention, "move_cache": namespace.move_cache}


@pytest.mark.skipif(_WANT_CUDA, reason="CPU stand-in for the CUDA ops")
def test_dispatch_cuda_branch_with_stand_in_ops(monkeypatch):
    """Forced "cuda" with the CUDA ops replaced by CPU stand-ins of the same schemas:
    decode-only batches (with metrics) reach the op with the right arguments, mixed
    batches and unsupported shapes go to Triton, move_cache reaches its op."""
    ops = _fake_cuda_ops()
    from kvcompress.ops import backend_cuda

    monkeypatch.setattr(backend_cuda.BACKEND, "unavailable_reason", lambda device, op: None)
    monkeypatch.setattr(backend_cuda.BACKEND, "op", lambda op: ops[op])
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    _fake_calls.clear()
    query, pool, batch, scale = _small_decode_case()
    metrics = torch.rand(pool.slot_positions.shape, generator=torch.Generator().manual_seed(0))
    sink = MetricSink(torch.tensor([True, False]))
    expected_metrics = metrics.clone()
    expected = reference_attention(query, replace(pool, slot_metrics=expected_metrics), batch, scale, metrics=sink)
    out = torch.full_like(query, float("nan"))
    pool = replace(pool, slot_metrics=metrics)
    dispatch.paged_attention(query, pool, batch, scale, out=out, metrics=sink, partition_size=64)
    assert _fake_calls == [("paged_decode_attention", 64)]
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(metrics, expected_metrics)

    # A prefill row: the decode-only op is skipped, Triton runs the batch.
    mixed = torch.randn(4, 4, 64)
    mixed_batch = PagedBatch(batch.block_tables, batch.head_lens, [0, 3, 4], torch.tensor([5, 6, 7, 40]))
    expected = reference_attention(mixed, pool, mixed_batch, scale)
    got = dispatch.paged_attention(mixed, pool, mixed_batch, scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Head size 80 has no CUDA kernel: Triton again.
    odd = torch.randn(2, 4, 80)
    odd_cache = torch.randn(pool.key_cache.shape[0], 16, 80)
    odd_pool = replace(pool, key_cache=odd_cache, value_cache=odd_cache)
    expected = reference_attention(odd, odd_pool, batch, scale)
    torch.testing.assert_close(dispatch.paged_attention(odd, odd_pool, batch, scale), expected,
                               atol=1e-5, rtol=1e-5)
    assert _fake_calls == [("paged_decode_attention", 64)]

    one = torch.tensor([0])
    dispatch.move_cache(pool, one + 1, one + 3, one, one)
    assert _fake_calls[-1] == ("move_cache",)
    key_cache = pool.key_cache
    assert torch.equal(key_cache[0, 0], key_cache[1, 3]) and torch.equal(metrics[0, 0], metrics[1, 3])


# Compiles the kernels for an H100 (sm_90) through the real launch paths, without a GPU:
# the launches are recorded instead of run, then each is compiled with triton.compile
# (Triton -> PTX -> cubin with the bundled ptxas), specialised like the JIT does.
_AOT_SCRIPT = r'''
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kvcompress.ops.triton_attention as ta
import kvcompress.ops.triton_move_cache as tm
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch

TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
      torch.int32: "i32", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
launches = []

class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

for module, names in ((ta, ["_decode_kernel", "_decode_reduce_kernel", "_decode_metric_kernel",
                            "_varlen_kernel"]), (tm, ["_move_cache_kernel"])):
    for name in names:
        setattr(module, name, Recorder(getattr(module, name)))

def attention(dtype, head_dim, group, block_size, partition_size, metrics, length_scale=1, window=None,
              page_dtype=None):
    lens = torch.tensor([[40, 5], [70, 3], [16, 16]]) * length_scale
    pool = torch.zeros(64, 2, block_size, head_dim, dtype=page_dtype or dtype)
    query = torch.zeros(7, 2 * group, head_dim, dtype=dtype)
    kv = KVPool(pool[:, 0], pool[:, 1], torch.zeros(64, block_size, dtype=torch.int32),
                torch.zeros(64, block_size))
    tables = torch.zeros(3, 2, 8 * length_scale, dtype=torch.int64)
    batch = PagedBatch(tables, lens, [0, 1, 2, 7], torch.arange(7), sliding_window=window)
    ta.paged_attention_triton(
        query, kv, batch, 0.1, metrics=MetricSink(torch.ones(3, dtype=torch.bool)) if metrics else None,
        partition_size=partition_size)

attention(torch.bfloat16, 128, 4, 16, 32, True)    # v2 decode + reduce + metrics + varlen
attention(torch.bfloat16, 128, 4, 16, 512, True, length_scale=512)  # 35K-token heads: 64-part blocks
attention(torch.float16, 64, 1, 32, 512, False)    # v1 decode
attention(torch.float32, 256, 8, 16, 512, False)   # float32 operands, widest head
attention(torch.bfloat16, 256, 4, 16, 32, False, window=7)  # a sliding-window layer (Gemma 3's head shape)
attention(torch.bfloat16, 128, 4, 16, 32, True, page_dtype=torch.float8_e4m3fn)  # --kv-cache-dtype fp8
attention(torch.float16, 64, 2, 16, 512, True, page_dtype=torch.float8_e5m2)     # fp8_e5m2
for partition_size in (32, 512):  # the metric pass alone (no output, no V read): several / one partition
    lens = torch.tensor([[40, 5], [70, 3], [16, 16]])
    pool = torch.zeros(64, 2, 16, 128, dtype=torch.bfloat16)
    kv = KVPool(pool[:, 0], pool[:, 1], torch.zeros(64, 16, dtype=torch.int32), torch.zeros(64, 16))
    batch = PagedBatch(torch.zeros(3, 2, 8, dtype=torch.int64), lens, [0, 1, 2, 7], torch.arange(7))
    sink = MetricSink.of_decode_rows([0, 1], [0, 1, 2, 7], 2, torch.device("cpu"))
    ta.decode_metrics_triton(torch.zeros(7, 8, 128, dtype=torch.bfloat16), kv, batch, 0.1, sink,
                             partition_size=partition_size)
pool = torch.zeros(8, 2, 16, 128, dtype=torch.bfloat16)
index = torch.zeros(3, dtype=torch.int64)
kv = KVPool(pool[:, 0], pool[:, 1], torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 16))
tm.move_cache_triton(kv, index, index, index + 1, index)
pool = torch.zeros(8, 2, 16, 128, dtype=torch.float8_e4m3fn)
kv = KVPool(pool[:, 0], pool[:, 1], torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 16))
tm.move_cache_triton(kv, index, index, index + 1, index)

def scalar_type(value, path, constants, attrs):
    """The signature type of a scalar argument at ``path``, or of each element of a tuple
    (a tensor's strides), as the JIT specialises them: 1 into a constant, multiples of 16
    marked divisible."""
    if isinstance(value, tuple):
        return tuple(scalar_type(v, path + (j,), constants, attrs) for j, v in enumerate(value))
    if isinstance(value, float):
        return "fp32"
    if value == 1:
        constants[path] = 1
        return "constexpr"
    if value % 16 == 0:
        attrs[path] = [["tt.divisibility", 16]]
    return "i32" if abs(value) < 2**31 else "i64"

target = GPUTarget("cuda", int(sys.argv[1]), 32)
for kernel, args, kwargs in launches:
    names = kernel.arg_names
    positional = [n for n in names if n not in kwargs]
    signature, constants, attrs, options = {}, {}, {}, {}
    for name, value in zip(positional, args, strict=True):
        index = (names.index(name),)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TY[value.dtype]
            attrs[index] = [["tt.divisibility", 16]]
        else:
            signature[name] = scalar_type(value, index, constants, attrs)
    for name, value in kwargs.items():
        if name in names:
            signature[name], constants[name] = "constexpr", value
        else:
            options[name] = value
    signature = {name: signature[name] for name in names}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options)
    assert compiled.asm.get("cubin"), kernel.__name__
print("compiled", len(launches), *sorted({kernel.__name__ for kernel, _, _ in launches}))
'''


@pytest.mark.skipif(_WANT_CUDA, reason="the CUDA run compiles the kernels anyway")
def test_kernels_compile_for_sm90_without_a_gpu():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a Triton 3.9 warning
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT, "90"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # "compiled <launches> <kernel names>": every kernel, each launch (one per
    # specialisation the calls above make) compiled to a cubin (asserted in the script).
    word, count, *names = result.stdout.split()
    assert word == "compiled" and int(count) >= len(names)
    assert names == ["_decode_kernel", "_decode_metric_kernel", "_decode_reduce_kernel",
                     "_move_cache_kernel", "_varlen_kernel"]


def test_long_decode_partitions_come_in_few_lengths():
    """PART_TOKENS is a kernel constexpr: every partition length a long context gives
    compiles a kernel variant, after vLLM's JIT monitor is armed. Partitions longer than
    the base come in powers of two of it: a handful of lengths from 1 to 128K keys (the
    lengths before: one per 64 x block_size keys past 32K), still at most
    MAX_GRAPH_PARTITIONS partitions and within the workspace bound."""
    triton_attention, _ = _kernels()
    block_size, tile_pages, num_q_heads, head_pad = 16, 4, 32, 128
    for rows in (1, 64, 1024):
        lengths = set()
        for max_head_len in range(1, 131073, 61):
            pages, parts = triton_attention._decode_partitions(
                rows, num_q_heads, head_pad, max_head_len, 512, block_size, tile_pages)
            lengths.add(pages)
            assert parts <= triton_attention.MAX_GRAPH_PARTITIONS and pages * block_size * parts >= max_head_len
            if parts > 1:
                assert rows * num_q_heads * parts * (head_pad + 2) * 4 <= triton_attention.DECODE_WORKSPACE_BYTES
        # 512 keys times 1, 2, 4, ... up to one partition of 128K keys: at most 9.
        assert len(lengths) <= 9 and all(n & (n - 1) == 0 for n in lengths), (rows, sorted(lengths))
