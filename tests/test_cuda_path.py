"""The CUDA engine path's contracts with vLLM 0.32, checked on CPU (issue 15: what a
reading against vLLM's GPU model runner showed would break on a GPU). Real vLLM objects
where the code path allows; the builder / runner / cache methods called directly where
it does not. vLLM is imported inside the tests (the Triton interpreter tests must import
triton first)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcompress.ops import PerHeadPagedCache
from kvcompress.ops.page_tables import ChunkedPageTables


def _common_metadata(num_reqs: int, num_tokens: int):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.arange(num_reqs + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts,
        seq_lens=torch.full((num_reqs,), 40, dtype=torch.int32), num_reqs=num_reqs,
        num_actual_tokens=num_tokens, max_query_len=1, max_seq_len=40,
        block_table_tensor=torch.zeros((num_reqs, 4), dtype=torch.int32),
        slot_mapping=torch.zeros(num_reqs, dtype=torch.int64),
    )


def _decode_step(num_reqs: int, decode_only: bool, kernel_decode=None):
    from kvcompress.vllm_glue.step import PerHeadStep

    cache = PerHeadPagedCache(64, 2, 2, 16, max_seqs=8, max_pages_per_head=8)
    slots = torch.tensor([cache.new_sequence() for _ in range(num_reqs)])
    cache.append(slots, torch.full((num_reqs,), 39), torch.cat([torch.arange(39)] * num_reqs))
    plan = cache.append(slots, torch.ones(num_reqs, dtype=torch.int64), torch.full((num_reqs,), 39))
    return PerHeadStep(
        num_reqs=num_reqs, num_tokens=num_reqs, query_start_loc=list(range(num_reqs + 1)),
        query_positions=torch.full((num_reqs,), 39), tables=None, head_lens=None,
        max_head_len=40, plan=plan, decode_only=decode_only, kernel_decode=kernel_decode,
    )


@pytest.fixture
def builder():
    from kvcompress.vllm_glue.attention_backend import KVCompressAttentionMetadataBuilder

    return KVCompressAttentionMetadataBuilder(None, ["layers.0.attn"], None, torch.device("cpu"))


def test_padded_decode_batch_of_a_full_cuda_graph_is_accepted(builder):
    """Item 1: vLLM pads a decode-only batch to a captured graph size (3 rows -> 4) and
    builds the metadata with the padded row count; the DecodeBuffers path takes it."""
    from kvcompress.vllm_glue import step as step_state

    step_state.set_current_step(_decode_step(3, decode_only=True))
    try:
        metadata = builder.build(0, _common_metadata(num_reqs=4, num_tokens=4))
        assert metadata.decode_only and metadata.step.num_reqs == 3
    finally:
        step_state.set_current_step(None)


@pytest.mark.parametrize("case", ["mixed-step", "cpu-kernel-decode", "fewer-rows"])
def test_other_batch_mismatches_are_still_refused(builder, case):
    """Only a decode step over the DecodeBuffers may be padded; a mixed step, a CPU
    kernel decode (tables built for exactly its rows) or a batch SMALLER than the plan
    is a bug and stops the step."""
    from kvcompress.vllm_glue import step as step_state

    step = {
        "mixed-step": lambda: _decode_step(3, decode_only=False),
        "cpu-kernel-decode": lambda: _decode_step(3, decode_only=True, kernel_decode=[]),
        "fewer-rows": lambda: _decode_step(3, decode_only=True),
    }[case]()
    rows = 2 if case == "fewer-rows" else 4
    step_state.set_current_step(step)
    try:
        with pytest.raises(RuntimeError, match="covers 3 requests but vLLM built a batch of"):
            builder.build(0, _common_metadata(num_reqs=rows, num_tokens=rows))
    finally:
        step_state.set_current_step(None)


def _largest_allocation(run) -> int:
    """Bytes of the largest single CPU allocation made by ``run()`` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max((event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0), default=0)


def test_mixed_step_tables_are_gathered_one_layer_at_a_time():
    """Item 2: a mixed step read the rows' page tables for every layer at once
    (``page_tables[seq_slots, :, :, :P]``, [S, L, H, P] int64: 4.3 GB for 256 rows of an
    8B model at 128K) after a host read of the longest head. Now each layer gathers its
    own [S, H, P] when it runs, equal to the slice of the old gather."""
    from kvcompress.vllm_glue.step import StepTables

    layers, heads, pages, block = 16, 4, 32, 16
    cache = PerHeadPagedCache(50_000, layers, heads, block, max_seqs=32, max_pages_per_head=pages)
    slots = [cache.new_sequence() for _ in range(24)]
    lens = torch.randint(1, pages * block, (24,))
    for slot, length in zip(slots, lens.tolist()):
        cache.append(torch.tensor([slot]), torch.tensor([length]), torch.arange(length))
    token_counts = lens.numpy()
    tables, max_head_len = StepTables.for_rows(cache, torch.tensor(slots), token_counts)
    assert max_head_len == int(lens.max())
    all_layers = cache.flat_page_tables()[torch.tensor(slots), :, :, : tables.num_pages]
    for layer in range(layers):
        assert torch.equal(tables.layer(layer), all_layers[:, layer])

    one_layer_bytes = 24 * heads * tables.num_pages * 4  # int32
    peak = _largest_allocation(lambda: [tables.layer(layer) for layer in range(layers)])
    assert one_layer_bytes <= peak < 2 * one_layer_bytes < all_layers.numel() * 8 / 4


def test_mixed_step_head_bound_needs_no_device_read():
    """Item 2: off the CPU the longest head is bounded by the requests' token counts on
    the host (eviction only shortens heads) instead of ``head_lens.max().item()``."""
    from kvcompress.vllm_glue.step import StepTables

    cache = PerHeadPagedCache(256, 2, 2, 16, max_seqs=4, max_pages_per_head=16)
    slots = [cache.new_sequence(), cache.new_sequence()]
    cache.append(torch.tensor(slots), torch.tensor([40, 70]), torch.cat([torch.arange(40), torch.arange(70)]))
    cache.head_lens[slots[1]] = 33  # evicted down from 70
    exact, exact_len = StepTables.for_rows(cache, torch.tensor(slots), torch.tensor([40, 70]).numpy())
    assert exact_len == 40 and exact.num_pages == 3
    cache.host = None  # as on a GPU: no host view of the tables
    bound, bound_len = StepTables.for_rows(cache, torch.tensor(slots), torch.tensor([40, 70]).numpy())
    assert bound_len == 70 and bound.num_pages == 5
    assert torch.equal(bound.layer(1)[:, :, :3], exact.layer(1))


def test_cuda_ops_see_as_many_kv_pages_as_slot_positions():
    """Item 4: the engine's K / V views have one more page than ``slot_positions`` /
    ``slot_metrics`` (the scratch page that padding rows write), and the CUDA bindings
    require equal page counts. The ops' tensors are narrowed to the real pages: same
    memory, equal rows."""
    cache = PerHeadPagedCache(12, 2, 2, 16, max_seqs=3, max_pages_per_head=4)
    buffer = torch.randn(cache.num_pages + 1, 2, 16, 64)  # + the scratch page
    pool = cache.kv_pool(buffer[:, 0], buffer[:, 1])
    assert pool.key_cache.shape[0] == cache.slot_positions.shape[0] + 1
    tensors = pool.tensors()
    assert {name: t.shape[0] for name, t in tensors.items()} == dict.fromkeys(tensors, cache.num_pages)
    assert tensors["key_cache"].data_ptr() == buffer[:, 0].data_ptr()
    assert tensors["value_cache"].stride() == buffer[:, 1].stride()


def test_prompt_metric_workspace_is_bounded():
    """Item 6: prompt metrics scored 1024 queries at a time against every key, float32
    ``[Hq, 1024, K]`` temporaries (4.3 GB each at 32 heads x 32K keys). The query chunk
    now shrinks so that they fit a workspace bound; the metrics are the same."""
    from kvcompress.ops.metrics import SCORE_COPIES, attention_metrics

    torch.manual_seed(0)
    heads, group, dim, block, length = 2, 4, 16, 16, 2048
    cache = PerHeadPagedCache(600, 1, heads, block, max_seqs=1, max_pages_per_head=128)
    slot = cache.new_sequence()
    cache.append(torch.tensor([slot]), torch.tensor([length]), torch.arange(length))
    key_cache = torch.randn(600, block, dim)
    query = torch.randn(512, heads * group, dim)
    args = (query, torch.arange(length - 512, length), key_cache, cache.slot_positions,
            cache.flat_page_tables()[slot, 0], cache.head_lens[slot, 0], 0.25)
    one_chunk_bytes = heads * group * 512 * length * 4  # [Hq, 512, K] float32: 32 MiB
    unbounded = _largest_allocation(lambda: attention_metrics(*args, workspace_bytes=1 << 40))
    workspace = 2 << 20
    bounded = _largest_allocation(lambda: attention_metrics(*args, workspace_bytes=workspace))
    assert unbounded >= one_chunk_bytes
    assert bounded <= workspace / SCORE_COPIES * 2
    torch.testing.assert_close(
        attention_metrics(*args, workspace_bytes=workspace), attention_metrics(*args, workspace_bytes=1 << 40),
        rtol=1e-5, atol=1e-7,
    )


def _impl():
    from kvcompress.vllm_glue.attention_backend import KVCompressAttentionImpl

    return KVCompressAttentionImpl(4, 64, 0.125, 2, None, None, "auto")


@pytest.mark.parametrize("metadata", ["profile-run", "warm-up-without-plan"])
def test_runs_without_a_plan_leave_a_defined_output(metadata):
    """Item 9: vLLM's profile run passes no metadata and reads the output; it was left
    uninitialised. Now it is zeros, as vLLM's own backends give."""
    from kvcompress.vllm_glue.attention_backend import KVCompressAttentionMetadata

    attn_metadata = None if metadata == "profile-run" else KVCompressAttentionMetadata(5, None, False)
    output = torch.full((5, 4 * 64), float("nan"))
    query, kv = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    result = _impl().forward(None, query, kv, kv, None, attn_metadata, output)
    assert result is output and torch.equal(output, torch.zeros_like(output))


def test_warm_up_runs_the_capturable_decode_before_graph_capture(builder):
    """Item 9: warm-up batches (no step plan) ran no attention, so the graph-captured
    decode kernels compiled inside the capture. A uniform single-token warm-up batch now
    takes the decode path over the buffers' padding rows where that decode is a
    capturable kernel (CUDA); prefill-shaped batches and CPU engines stay no-ops."""
    from kvcompress.ops.dispatch import KernelOps
    from kvcompress.vllm_glue import step as step_state
    from kvcompress.vllm_glue.step import DecodeBuffers, WorkerCacheState

    cache = PerHeadPagedCache(32, 2, 2, 16, max_seqs=5, max_pages_per_head=4)
    buffers = DecodeBuffers.allocate(
        num_layers=2, num_kv_heads=2, max_rows=4, num_slots=5, pad_slot=cache.new_sequence(),
        scratch_page=32, max_head_len=64, block_size=16, metric_power=2, device=torch.device("cpu"),
    )
    buffer = torch.zeros(33, 2, 16, 64)

    def state(device: str, backend: str) -> WorkerCacheState:
        ops = KernelOps(torch.device(device), {"paged_attention": backend, "paged_decode_by_slot": backend})
        return WorkerCacheState(cache=cache, layer_index={}, decode_buffers=buffers,
                                key_cache=buffer[:, 0], value_cache=buffer[:, 1], ops=ops)

    def decode_only(num_reqs: int, num_tokens: int) -> bool:
        common = _common_metadata(num_reqs, num_tokens)
        common.max_query_len = num_tokens // num_reqs
        return builder.build(0, common).decode_only

    step_state.set_current_step(None)
    try:
        step_state.set_worker_state(state("cuda", "triton"))
        assert decode_only(4, 4)
        assert not decode_only(2, 64)  # a prefill-shaped warm-up batch
        assert not decode_only(8, 8)  # more rows than the buffers hold
        step_state.set_worker_state(state("cpu", "vllm_cpu"))
        assert not decode_only(4, 4)
    finally:
        step_state.set_worker_state(None)


def test_a_second_kv_cache_initialisation_drops_the_first_pool_first():
    """Item 3 (part): vLLM's CUDA-graph memory profiling initialises a minimal KV cache,
    then the real one. The first pool's tables and worker state must be gone when vLLM
    allocates the second buffer (inside ``super().initialize_kv_cache``)."""
    from kvcompress.vllm_glue import step as step_state
    from kvcompress.vllm_glue.runner import KVCompressRunnerMixin

    seen = []

    class VllmRunner:  # stands in for vLLM's runner: records what is alive when it allocates
        def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
            seen.append((step_state.get_worker_state(), step_state.current_step(), self.kvc_cache))
            self.kv_cache_config = kv_cache_config

    class Runner(KVCompressRunnerMixin, VllmRunner):
        def _kvc_buffer_config(self, kv_cache_config):
            return kv_cache_config

        def _kvc_build_pool(self, kv_cache_config):  # the pool a real build leaves behind
            self.kvc_cache = PerHeadPagedCache(8, 1, 1, 16, max_seqs=2, max_pages_per_head=2)
            step_state.set_worker_state(object())
            step_state.set_current_step(object())

    runner = Runner()
    try:
        runner.initialize_kv_cache("profiling config", is_profiling=True)
        runner.initialize_kv_cache("real config")
        assert seen == [(None, None, None), (None, None, None)]
        assert runner.kvc_cache is not None and runner.kv_cache_config == "real config"
    finally:
        step_state.set_worker_state(None)
        step_state.set_current_step(None)


def test_metadata_formulas_count_every_byte_the_cache_allocates():
    """Item 3: the per-head metadata taken out of the KV budget is computed by formulas
    that must match the tensors actually allocated (page tables, head lengths, slot
    positions and metrics, free stack, decode buffers)."""
    from kvcompress.vllm_glue.step import DecodeBuffers

    cache = PerHeadPagedCache(123, 3, 2, 32, max_seqs=7, max_pages_per_head=9)
    tables = cache.tables
    tensors = [tables.chunk_tables, tables.chunks, tables.chunk_allocator.free_stack, tables.chunk_shares,
               cache.head_lens, cache.slot_positions, cache.slot_metrics, cache.allocator.free_stack,
               cache.page_shares]
    assert PerHeadPagedCache.metadata_bytes(123, 3, 2, 32, 7, 9) == sum(t.nbytes for t in tensors)
    buffers = DecodeBuffers.allocate(
        num_layers=3, num_kv_heads=2, max_rows=5, num_slots=7, pad_slot=0, scratch_page=123,
        max_head_len=288, block_size=32, metric_power=2, device=torch.device("cpu"),
    )
    owned = [buffers.seq_slots, buffers.query_positions, buffers.write_pages, buffers.write_offsets,
             buffers.metric_slots, buffers.row_index]
    assert DecodeBuffers.nbytes_for(3, 2, 5, 7) == sum(t.nbytes for t in owned)


def test_pages_and_metadata_fit_the_kv_memory_or_the_flags_are_named():
    from kvcompress.vllm_glue.memory import PerHeadLayout

    layout = PerHeadLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16,
                           max_num_seqs=1024, max_model_len=131072, max_rows=1024)
    available = 50 << 30
    for_pages = layout.page_bytes_for(available)
    num_pages = for_pages // layout.page_bytes
    assert for_pages + layout.metadata_bytes(num_pages) <= available
    # Llama-3.1-8B at 128K x 1024 sequences: flat int64 tables took 16 GiB of the 50. Two
    # levels of int32 ids sized by the pool: < 0.25 GiB; with slot positions and metrics
    # (8 bytes per KV slot, as in the paper) and the shares of pages and chunks (prefix
    # caching) about 1.06 GiB, 2% of the KV memory.
    assert ChunkedPageTables.nbytes_for(num_pages, 1025, 32, 8, 8192) < 1 << 28
    assert available - for_pages < (22 << 30) // 20
    # The part fixed by the flags (first-level tables, head lengths, decode buffers) is
    # what can refuse a configuration.
    fixed = layout.metadata_bytes(0)
    assert fixed < 1 << 28
    with pytest.raises(ValueError, match="--max-num-seqs 1024 x --max-model-len 131072"):
        layout.page_bytes_for(fixed)


PROBE = """
import json, os, sys
sys.path.insert(0, {benchmarks!r})
import benchmark_throughput as bench
bench._setup_env()
os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
with bench.engine_core_in_process():
    from vllm import LLM
    import kvcompress
    args = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                max_model_len={max_len}, max_num_seqs={seqs}, kv_cache_memory_bytes={budget},
                max_num_batched_tokens=8192)
    llm = kvcompress.LLM({model!r}, **args) if {kvc} else LLM(model={model!r}, **args)
    rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
    print("PROBE " + json.dumps({{"rss_kib": rss}}))
"""


@pytest.mark.engine
def test_process_memory_stays_within_the_kv_budget_at_long_context(tiny_model):
    """Item 3: with ``kv_cache_memory_bytes=B`` a kvcompress engine's process may hold
    only a few % of B more than stock vLLM's, at a long max_model_len and many sequences
    (before: +87 MiB of B = 1 GiB at 128K x 512, the page tables outside the budget)."""
    import subprocess
    import sys
    from pathlib import Path

    budget = 1 << 30
    rss = {}
    for kvc in (False, True):
        code = PROBE.format(benchmarks=str(Path(__file__).resolve().parents[1] / "benchmarks" / "throughput"),
                            max_len=131072, seqs=512, budget=budget, model=tiny_model, kvc=kvc)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        line = [l for l in done.stdout.splitlines() if l.startswith("PROBE ")]
        assert done.returncode == 0 and line, done.stderr[-3000:]
        rss[kvc] = json.loads(line[0][6:])["rss_kib"] * 1024
    assert rss[True] - rss[False] < 0.03 * budget, (rss, budget)
