"""GPU kernels of kvcompress: build, check against the PyTorch reference, benchmark.

The one script to run on a GPU machine (H100 / H200; torch + triton + nvcc, no vLLM):

    python benchmarks/kernels/bench_kernels.py                 # build, check, full benchmark
    python benchmarks/kernels/bench_kernels.py --quick         # fewer shapes
    python benchmarks/kernels/bench_kernels.py --checks-only   # build + correctness only
    python benchmarks/kernels/bench_kernels.py --dry-run-cpu   # CPU smoke test of this script
                                                       # (reference path, tiny shapes)
    # vLLM's own Triton attention too (the machine has no vLLM): stage its Python
    # sources here (bash scripts/stage_vllm_sources.sh .venv .gpu_vllm), carry them, then
    python benchmarks/kernels/bench_kernels.py --vllm-path .gpu_vllm --skip move alloc evict

Steps (each section records its errors and the run goes on):

1. Build ``kvcompress._C`` (``--build``: import an installed one, else JIT-compile
   csrc/ with torch.utils.cpp_extension.load when ninja exists, else
   ``pip install -e . --no-build-isolation --no-deps``).
2. Check every CUDA op (and the Triton slot-indexed decode that CUDA graphs replay)
   against the PyTorch reference on fresh random inputs (outputs
   poisoned with NaN first): paged decode attention for float32 / float16 / bfloat16,
   head sizes 64 / 128 / 256, block sizes 16 / 32, several GQA groups and partition
   sizes, masked positions, empty heads, strided K / V views of a [N, 2, b, D] pool,
   with and without the sparse metric update; MoveCache; the allocator page-table fill.
   Tolerances (relative to max |reference|): float32 1e-4, float16 4e-3, bfloat16 1.6e-2.
3. Device copy bandwidth (read + write of a large tensor, torch ``copy_``).
4. Decode attention for Llama-3.1-8B shapes (32 q / 8 KV heads, head 128, block 16;
   one layer per call, as in the model) at batch 1..256 x context 1K..32K with random
   per-head lengths in [context / 2, context] on randomly scattered pages: time and
   achieved bandwidth (K/V bytes of the held slots / time, cold L2) of the CUDA op, the
   Triton backend (when ``kvcompress.ops.dispatch`` exists) and torch SDPA over a
   contiguous [B, H, L_max, D] cache of the same sequences (the GQA group folded into
   the query length, so no K/V repeat). Configs that do not fit in memory are skipped.
5. MoveCache GB/s (CUDA op, Triton, reference indexing).
With ``--vllm-path``: vLLM's Triton ``unified_attention`` over flattened per-head tables
checked on the GPU (``tests/unified_attention_cases.py --device cuda``), decode timed
against stock vLLM's kernel over its own cache at several rates (both from CUDA graphs),
and steps with prompt rows timed against stock (eager).

6. Allocator page-table fill and eviction-schedule latency for 64 sequences x 32
   layers x 8 KV heads x 4K tokens (``schedule_evictions``, ``compress_sequences``).

Results go to ``benchmarks/results/kernels-<device>-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository: csrc/, kvcompress/, benchmarks/results/
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcompress.ops import dispatch as ops_dispatch  # noqa: E402
from kvcompress.ops.compress import compress_sequences, gather_logical  # noqa: E402
from kvcompress.ops.eviction import schedule_evictions  # noqa: E402
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch  # noqa: E402
from kvcompress.ops.move_cache import move_cache as reference_move_cache  # noqa: E402
from kvcompress.ops.reference_attention import reference_paged_attention  # noqa: E402
from kvcompress.ops.paged_cache import PerHeadPagedCache, pages_for  # noqa: E402

# Llama-3.1-8B
LLAMA = dict(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}
# vLLM's Triton kernel takes its float32 dot products in TF32 on the GPU (Triton's
# default, as in stock vLLM): about 1e-3 of max |out| measured on the H200, not 1e-6.
VLLM_TRITON_TOLERANCE = {torch.float32: 5e-3}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------------
# Inputs (CPU or GPU)
# ----------------------------------------------------------------------------------


@dataclass
class DecodeCase:
    """One layer of paged decode inputs; K / V are strided views of a [N, 2, b, D] pool."""

    query: torch.Tensor  # [B, Hq, D]
    key_cache: torch.Tensor  # [N, b, D] view
    value_cache: torch.Tensor  # [N, b, D] view
    slot_positions: torch.Tensor  # [N, b] int32
    block_tables: torch.Tensor  # [B, H, P] int64
    head_lens: torch.Tensor  # [B, H] int64
    query_positions: torch.Tensor  # [B] int64
    scale: float
    pool: torch.Tensor  # [N, 2, b, D]

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def max_head_len(self) -> int:
        return int(self.head_lens.max().item()) if self.head_lens.numel() else 0

    def kv_pool(self, slot_metrics: torch.Tensor | None = None) -> KVPool:
        """The ops' pool over this case's K / V (slot metrics: zeros unless given)."""
        if slot_metrics is None:
            slot_metrics = torch.zeros(self.slot_positions.shape, device=self.slot_positions.device)
        return KVPool(self.key_cache, self.value_cache, self.slot_positions, slot_metrics)

    def paged_batch(self, max_head_len: int | None = None) -> PagedBatch:
        """The decode batch: one query row per sequence."""
        return PagedBatch(self.block_tables, self.head_lens, list(range(self.batch + 1)),
                          self.query_positions, max_head_len=max_head_len)

    def kv_bytes(self) -> int:
        """K + V bytes of the held slots (whole pages: a kernel reads whole rows)."""
        block_size, head_dim = self.key_cache.shape[1], self.key_cache.shape[2]
        slots = int(pages_for(self.head_lens, block_size).sum().item()) * block_size
        return 2 * slots * head_dim * self.key_cache.element_size()


def random_head_lens(batch: int, num_kv_heads: int, low: int, high: int, generator) -> torch.Tensor:
    """``[B, H]`` int64 uniform in ``[low, high]``."""
    return torch.randint(low, high + 1, (batch, num_kv_heads), generator=generator, dtype=torch.int64)


def make_decode_case(
    head_lens: torch.Tensor,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    positions: str = "random",
    extra_pages: int = 7,
) -> DecodeCase:
    """Random paged decode inputs for the given per-head lengths.

    Pages are a random permutation of the pool (scattered, as after churn); table
    entries past a head's pages point at random valid pages (ignored by the kernels).
    ``positions="random"``: slot positions uniform in [0, 2 * max_len) and query
    positions uniform in [max_len / 2, 2 * max_len], so some held slots are masked;
    ``positions="visible"``: position = logical slot, query position = max_len.
    """
    device = torch.device(device)
    cpu_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    head_lens = head_lens.to(torch.int64)
    batch, num_kv_heads = head_lens.shape
    pages = pages_for(head_lens, block_size).reshape(-1)  # [R]
    total = int(pages.sum().item())
    num_pool_pages = total + extra_pages
    max_pages = max(1, int(pages.max().item()) if pages.numel() else 1)
    max_len = max(1, int(head_lens.max().item()) if head_lens.numel() else 1)

    page_ids = torch.randperm(num_pool_pages, generator=cpu_gen)[:total].to(device)
    starts = (torch.cumsum(pages, 0) - pages).to(device)  # exclusive prefix sum
    column = torch.arange(max_pages, device=device)
    held = column < pages.to(device).unsqueeze(-1)  # [R, P]
    index = (starts.unsqueeze(-1) + column).clamp(max=max(total - 1, 0))
    filler = torch.randint(0, num_pool_pages, (pages.numel(), max_pages), generator=cpu_gen).to(device)
    if total:
        tables = torch.where(held, page_ids[index], filler)
    else:
        tables = filler
    block_tables = tables.reshape(batch, num_kv_heads, max_pages).contiguous()

    # Generated in the cache dtype directly: a float32 temporary would double the peak.
    pool = torch.randn(
        (num_pool_pages, 2, block_size, head_dim), generator=dev_gen, device=device, dtype=dtype
    )
    if positions == "random":
        slot_positions = torch.randint(
            0, 2 * max_len, (num_pool_pages, block_size), generator=cpu_gen, dtype=torch.int32
        ).to(device)
        query_positions = torch.randint(
            max_len // 2, 2 * max_len + 1, (batch,), generator=cpu_gen, dtype=torch.int64
        ).to(device)
    else:
        slot_positions = torch.zeros((num_pool_pages, block_size), dtype=torch.int32, device=device)
        if total:
            held_pages = tables[held]  # [total] in (row, page) order
            page_index = column.expand_as(tables)[held]
            slot_positions[held_pages] = (
                page_index.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)
            ).to(torch.int32)
        query_positions = torch.full((batch,), max_len, dtype=torch.int64, device=device)
    query = torch.randn(
        (batch, num_kv_heads * group, head_dim), generator=dev_gen, device=device, dtype=dtype
    )
    return DecodeCase(
        query=query,
        key_cache=pool[:, 0],
        value_cache=pool[:, 1],
        slot_positions=slot_positions,
        block_tables=block_tables,
        head_lens=head_lens.to(device),
        query_positions=query_positions,
        scale=1.0 / math.sqrt(head_dim),
        pool=pool,
    )


def decode_case_bytes(batch: int, num_kv_heads: int, group: int, head_dim: int, block_size: int,
                      max_len: int, element_size: int) -> int:
    """Upper bound of the device bytes of make_decode_case (all heads at max_len)."""
    pages = batch * num_kv_heads * (-(-max_len // block_size)) + 7
    pool = pages * 2 * block_size * head_dim * element_size
    return pool + pages * block_size * 4 + batch * num_kv_heads * (-(-max_len // block_size)) * 8 * 3


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN anywhere in out -> inf)."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isinf(out).any():
        return float("inf")
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (out - ref).abs().max().item() if ref.numel() else 0.0
    return diff / max(scale, 1e-30) if diff else 0.0


def metric_error(start: torch.Tensor, ref: torch.Tensor, got: torch.Tensor) -> float:
    """Largest metric difference over the largest reference gain, after allowing each
    slot the float32 rounding of adding its gain to its start value (2 ulp of ``start``:
    on 36K-token heads a gain is ~1e-9, far below the ulp of a start value near 1)."""
    delta = (ref - start).abs().max().item()
    allowance = 2 * torch.finfo(torch.float32).eps * start.abs()
    excess = ((got - ref).abs() - allowance).clamp(min=0).max().item()
    return excess / max(delta, 1e-12)


def dense_decode_oracle(case: DecodeCase) -> torch.Tensor:
    """Float64 per-head loop over the logical slots: an independent check of the
    reference and of make_decode_case (CPU dry run)."""
    query = case.query.double()
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = case.block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    block_size = case.key_cache.shape[1]
    out = torch.zeros_like(query)
    for s in range(batch):
        for h in range(num_kv_heads):
            n = int(case.head_lens[s, h])
            if n == 0:
                continue
            k_index = torch.arange(n)
            pages = case.block_tables[s, h, k_index // block_size].cpu()
            offsets = k_index % block_size
            keys = case.key_cache.cpu()[pages, offsets].double()
            values = case.value_cache.cpu()[pages, offsets].double()
            visible = case.slot_positions.cpu()[pages, offsets] <= int(case.query_positions[s])
            if not bool(visible.any()):
                continue
            for g in range(group):
                scores = keys @ query[s, h * group + g].cpu() * case.scale
                scores[~visible] = float("-inf")
                out[s, h * group + g] = torch.softmax(scores, 0) @ values
    return out


# ----------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------


class Timer:
    """Median wall time of a callable: CUDA events on GPU (optionally flushing L2 before
    every run, outside the timed region), perf_counter on CPU."""

    def __init__(self, device: torch.device, iters: int, warmup: int, flush_l2: bool = True):
        self.device = device
        self.iters = iters
        self.warmup = warmup
        self.flush = None
        if device.type == "cuda" and flush_l2:
            self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)

    def __call__(self, fn, iters: int | None = None, setup=None) -> float:
        """Milliseconds (median). ``setup`` runs untimed before each call."""
        iters = iters or self.iters
        for _ in range(self.warmup):
            if setup is not None:
                setup()
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(iters):
                if setup is not None:
                    setup()
                if self.flush is not None:
                    self.flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(iters):
                if setup is not None:
                    setup()
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
        times.sort()
        return times[len(times) // 2]


def copy_bandwidth(device: torch.device, timer: Timer, size_bytes: int) -> dict:
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return {"bytes": size_bytes, "ms": ms, "GBps": 2 * size_bytes / ms / 1e6}


# ----------------------------------------------------------------------------------
# Ops: CUDA extension, Triton (via dispatch), reference
# ----------------------------------------------------------------------------------


def build_extension(mode: str, verbose: bool = True) -> str:
    """Makes torch.ops.kvcompress.* available; returns how."""
    if mode in ("auto", "import"):
        try:
            import kvcompress._C  # noqa: F401

            return "import kvcompress._C"
        except Exception as exc:
            if mode == "import":
                raise RuntimeError(f"kvcompress._C is not importable: {exc}") from exc
    ninja = shutil.which("ninja") is not None
    if mode == "jit" or (mode == "auto" and ninja):
        from torch.utils.cpp_extension import load

        sources = [str(ROOT / "csrc" / "torch_bindings.cpp")] + sorted(
            str(path) for path in (ROOT / "csrc" / "kernels").glob("*.cu")
        )
        load(
            name="kvcompress_C",
            sources=sources,
            extra_include_paths=[str(ROOT / "csrc")],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
            is_python_module=False,
            verbose=verbose,
        )
        # kvcompress.ops.dispatch detects the extension by importing kvcompress._C: make
        # that import succeed in this process (the ops are registered already).
        stub = types.ModuleType("kvcompress._C")
        stub.__doc__ = "JIT-built by benchmarks/kernels/bench_kernels.py (torch.ops.kvcompress registered)"
        sys.modules["kvcompress._C"] = stub
        return "torch.utils.cpp_extension.load (JIT)"
    env = dict(os.environ)
    if "TORCH_CUDA_ARCH_LIST" not in env and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    cmd = [sys.executable, "-m", "pip", "install", "-e", str(ROOT), "--no-build-isolation", "--no-deps"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=str(ROOT))
    importlib.invalidate_caches()
    import kvcompress._C  # noqa: F401

    return "pip install -e . --no-build-isolation"


def cuda_ops():
    return torch.ops.kvcompress


def free_cached(device) -> None:
    """Hand the CUDA caching allocator's free blocks back (between configs)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class ReferenceOps:
    """The CUDA ops' signatures on the PyTorch reference: lets --dry-run-cpu exercise
    the check harness (argument order, poisoning, comparisons) without a GPU."""

    @staticmethod
    def paged_decode_attention(out, query, key_cache, value_cache, slot_positions, block_tables, head_lens,
                               query_positions, scale, partition_size=0, slot_metrics=None,
                               metric_seqs=None, metric_power=2, max_head_len=None):
        pool = KVPool(key_cache, value_cache, slot_positions, slot_metrics)
        batch = PagedBatch(block_tables, head_lens, list(range(query.shape[0] + 1)), query_positions)
        metrics = None if slot_metrics is None else MetricSink(metric_seqs, metric_power)
        reference_paged_attention(query, pool, batch, scale, out=out, metrics=metrics)

    @staticmethod
    def move_cache(key_cache, value_cache, slot_metrics, slot_positions, *moves):
        reference_move_cache(KVPool(key_cache, value_cache, slot_positions, slot_metrics), *moves)

    @staticmethod
    def allocate_pages(page_tables, free_stack, stack_start, offsets, first_column, rows):
        demand = offsets[1:] - offsets[:-1]
        reference_page_fill(page_tables, free_stack, stack_start, offsets, first_column, rows, demand,
                            int(offsets[-1]))


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        return "triton" in ops_dispatch.available_backends(device, "paged_attention")
    except Exception:
        return False


def resolved_ops(device: torch.device, name: str, *ops: str) -> "ops_dispatch.KernelOps":
    """The kernels of ``ops`` with backend ``name`` forced, resolved once."""
    with ops_dispatch.use_backend(name):
        return ops_dispatch.resolve_ops(device, ops)


# ----------------------------------------------------------------------------------
# Correctness checks (GPU)
# ----------------------------------------------------------------------------------


def check_decode_attention(device: torch.device, ops, dtype, head_dim, block_size, group,
                           partition_size, metrics: bool, seed: int, max_head_len_hint: bool) -> dict:
    gen = torch.Generator().manual_seed(seed)
    batch, num_kv_heads = 5, 2
    high = 3 * 512 // 2 + 7  # several partitions of 512 too
    head_lens = random_head_lens(batch, num_kv_heads, 0, high, gen)
    head_lens[0, 0] = 0  # empty head
    head_lens[1] = 0  # sequence with no KVs at all
    head_lens[2, 0] = block_size * 4  # exact pages
    head_lens[-1, -1] = high
    case = make_decode_case(head_lens, group, head_dim, block_size, dtype, device, seed=seed)
    out = torch.full_like(case.query, float("nan"))
    metric_seqs = slot_metrics = ref_metrics = None
    if metrics:
        metric_seqs = torch.rand(batch, generator=gen) < 0.7
        metric_seqs[-1] = True
        metric_seqs = metric_seqs.to(device)
        # Half the slots start at 0 so the adds are seen at full precision.
        slot_metrics = torch.rand(case.slot_positions.shape, generator=gen)
        slot_metrics = (slot_metrics * (torch.rand(slot_metrics.shape, generator=gen) < 0.5)).to(device)
        ref_metrics = slot_metrics.clone()
        start_metrics = slot_metrics.clone()
    args = [out, case.query, case.key_cache, case.value_cache, case.slot_positions, case.block_tables,
            case.head_lens, case.query_positions, case.scale, partition_size, slot_metrics, metric_seqs, 2,
            case.max_head_len if max_head_len_hint else None]
    ops.paged_decode_attention(*args)
    ref = reference_paged_attention(
        case.query, case.kv_pool(ref_metrics), case.paged_batch(), case.scale,
        metrics=MetricSink(metric_seqs) if metrics else None,
    )
    synchronize(device)
    error = rel_error(out.float(), ref.float())
    result = {
        "op": "paged_decode_attention", "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim,
        "block_size": block_size, "group": group, "partition_size": partition_size, "metrics": metrics,
        "max_head_len_hint": max_head_len_hint, "rel_error": error, "tolerance": TOLERANCE[dtype],
    }
    ok = error <= TOLERANCE[dtype]
    if metrics:
        metric_err = metric_error(start_metrics, ref_metrics, slot_metrics)
        # Informational: which slots changed (can differ where a gain underflows, the
        # kernels flush denormals).
        untouched = bool(torch.equal(slot_metrics == start_metrics, ref_metrics == start_metrics))
        result.update(metric_rel_error=metric_err, metric_untouched_match=untouched)
        ok = ok and metric_err <= 1e-3
    result["ok"] = bool(ok)
    return result


def check_decode_by_slot(device: torch.device, dtype, head_dim, block_size, group, seed: int,
                         max_tokens: int = 3 * 512 // 2 + 7, partition_size: int = 256) -> dict:
    """The graph path's kernel (Triton slot-indexed decode, fixed grid) against its
    reference: rows in shuffled slot order, two padding rows on an empty slot, metrics
    flagged per slot, outputs poisoned first. Head lengths are drawn in [1, max_tokens]."""
    from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference
    from kvcompress.ops.triton_attention import paged_decode_by_slot_triton

    gen = torch.Generator().manual_seed(seed)
    num_slots, num_kv_heads = 6, 2
    head_lens = random_head_lens(num_slots, num_kv_heads, 1, max_tokens, gen)
    head_lens[0] = 0  # the padding slot
    case = make_decode_case(head_lens, group, head_dim, block_size, dtype, device, seed=seed)
    order = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    seq_slots = torch.tensor(order + [0, 0], dtype=torch.int32, device=device)
    rows = seq_slots.numel()
    query = torch.randn((rows, case.query.shape[1], head_dim), generator=gen).to(dtype).to(device)
    query_positions = case.query_positions[seq_slots.long()]
    metric_slots = (torch.rand(num_slots, generator=gen) < 0.6).to(torch.int8).to(device)
    start = torch.rand(case.slot_positions.shape, generator=gen).to(device)
    ref_metrics, tri_metrics = start.clone(), start.clone()
    max_len = case.block_tables.shape[2] * block_size * 2  # a bound well above every head
    slot_batch = SlotBatch(case.block_tables, case.head_lens, seq_slots, query_positions, max_head_len=max_len)
    sink = MetricSink(metric_slots)
    ref = paged_decode_by_slot_reference(query, case.kv_pool(ref_metrics), slot_batch, case.scale, metrics=sink)
    out = torch.full_like(query, float("nan"))
    paged_decode_by_slot_triton(query, case.kv_pool(tri_metrics), slot_batch, case.scale, out=out, metrics=sink,
                                partition_size=partition_size)
    synchronize(device)
    error = rel_error(out.float(), ref.float())
    metric_err = metric_error(start, ref_metrics, tri_metrics)
    return {
        "op": "paged_decode_by_slot (triton)", "dtype": str(dtype).replace("torch.", ""),
        "head_dim": head_dim, "block_size": block_size, "group": group, "partition_size": partition_size,
        "metrics": True, "rel_error": error, "metric_rel_error": metric_err,
        "ok": bool(error <= TOLERANCE[dtype] and metric_err <= 1e-3),
    }


def random_moves(num_pages: int, block_size: int, count: int, device, generator):
    """``count`` moves between distinct random slots (sources and destinations disjoint)."""
    slots = torch.randperm(num_pages * block_size, generator=generator)[: 2 * count].to(device)
    src, dst = slots[:count], slots[count:]
    return src // block_size, src % block_size, dst // block_size, dst % block_size


def check_move_cache(device, ops, dtype, head_dim, block_size, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_pages, count = 300, 1000
    pool = torch.randn((num_pages, 2, block_size, head_dim), generator=gen).to(device, dtype)
    metrics = torch.rand((num_pages, block_size), generator=gen).to(device)
    positions = torch.randint(0, 10**6, (num_pages, block_size), generator=gen, dtype=torch.int32).to(device)
    moves = random_moves(num_pages, block_size, count, device, gen)
    mine = [pool.clone(), metrics.clone(), positions.clone()]
    ref = [pool.clone(), metrics.clone(), positions.clone()]
    ops.move_cache(mine[0][:, 0], mine[0][:, 1], mine[1], mine[2], *moves)
    reference_move_cache(KVPool(ref[0][:, 0], ref[0][:, 1], ref[2], ref[1]), *moves)
    synchronize(device)
    ok = all(torch.equal(a, b) for a, b in zip(mine, ref))
    return {"op": "move_cache", "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim,
            "block_size": block_size, "moves": count, "ok": bool(ok)}


def page_fill_inputs(num_seqs, num_layers, num_kv_heads, max_pages, demand_high, device, generator):
    """Random allocator demand over a subset of sequence slots, as PerHeadPagedCache.append."""
    max_seqs = num_seqs + 3
    seq_slots = torch.randperm(max_seqs, generator=generator)[:num_seqs]
    heads = num_layers * num_kv_heads
    rows = (seq_slots.repeat_interleave(heads) * heads + torch.arange(heads).repeat(num_seqs))
    demand = torch.randint(0, demand_high + 1, (rows.numel(),), generator=generator)
    first_column = (torch.rand(rows.numel(), generator=generator) * (max_pages - demand + 1)).long()
    first_column = torch.minimum(first_column, max_pages - demand)
    offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
    torch.cumsum(demand, 0, out=offsets[1:])
    total = int(offsets[-1])
    num_pages = total + 100
    free_stack = torch.randperm(num_pages, generator=generator)
    stack_start = num_pages - total
    to = dict(device=device)
    return dict(
        page_tables=torch.full((max_seqs, num_layers, num_kv_heads, max_pages), -1, dtype=torch.int32, **to),
        free_stack=free_stack.to(**to), stack_start=stack_start, offsets=offsets.to(**to),
        first_column=first_column.to(**to), rows=rows.to(**to), demand=demand.to(**to), total=total,
    )


def reference_page_fill(page_tables, free_stack, stack_start, offsets, first_column, rows, demand, total):
    """The page-table scatter of PerHeadPagedCache.append (torch ops)."""
    if total == 0:
        return
    device = page_tables.device
    requester = torch.repeat_interleave(torch.arange(demand.numel(), device=device), demand)
    within = torch.arange(total, device=device) - offsets[requester]
    pages = free_stack[stack_start : stack_start + total]
    page_tables.view(-1, page_tables.shape[-1])[rows[requester], first_column[requester] + within] = (
        pages.to(page_tables.dtype))


def check_allocate_pages(device, ops, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    inputs = page_fill_inputs(7, 4, 3, 40, 5, device, gen)
    mine = inputs["page_tables"].clone()
    ref = inputs["page_tables"].clone()
    ops.allocate_pages(mine, inputs["free_stack"], inputs["stack_start"], inputs["offsets"],
                       inputs["first_column"], inputs["rows"])
    reference_page_fill(ref, inputs["free_stack"], inputs["stack_start"], inputs["offsets"],
                        inputs["first_column"], inputs["rows"], inputs["demand"], inputs["total"])
    synchronize(device)
    return {"op": "allocate_pages", "pages": inputs["total"], "ok": bool(torch.equal(mine, ref))}


def run_cache_lifecycle(device: torch.device, ops, seed: int) -> dict:
    """Drive a :class:`PerHeadPagedCache` through what the engine does to it: a chunked
    prefill of ragged prompts (two chunks, all sequences in one batch), the prompt
    metrics of the last 8 queries, decode steps whose queries add to the metrics (the
    attention op's metric path), one compression (eviction schedule, MoveCache, tail
    pages freed), then decode steps over the compacted heads and the pages the
    allocator hands out again. Everything but the inputs runs on ``device`` through
    ``ops``. Returns the attention outputs of every step and layer, the head lengths
    after the compression and each head's kept positions (all on the CPU)."""
    from kvcompress.ops.metrics import accumulate_metrics, attention_metrics

    layers, heads, group, head_dim, block_size = 2, 2, 2, 64, 16
    prompts, decode_before, decode_after = [50, 37, 70], 5, 6
    gen = torch.Generator().manual_seed(seed)
    total = max(prompts) + decode_before + decode_after
    num_seqs = len(prompts)
    queries = torch.randn(num_seqs, total, layers, heads * group, head_dim, generator=gen)
    keys = torch.randn(num_seqs, total, layers, heads, head_dim, generator=gen)
    values = torch.randn(num_seqs, total, layers, heads, head_dim, generator=gen)
    num_pages = 96
    cache = PerHeadPagedCache(num_pages, layers, heads, block_size, max_seqs=4, max_pages_per_head=8,
                              device=device, ops=ops)
    buffer = torch.zeros(2, num_pages, block_size, head_dim, device=device)
    pool = cache.kv_pool(buffer[0], buffer[1])
    slots = torch.tensor([cache.new_sequence() for _ in range(num_seqs)], device=device)
    scale = head_dim ** -0.5
    outputs = []

    def step(spans, metric_rows=None):
        """One engine step: sequence i gets tokens [spans[i][0], spans[i][1])."""
        counts = torch.tensor([end - start for start, end in spans])
        positions = torch.cat([torch.arange(start, end) for start, end in spans]).to(device)
        plan = cache.append(slots, counts, positions)
        starts = [0] + torch.cumsum(counts, 0).tolist()
        sink = None if metric_rows is None else MetricSink(metric_rows.to(device))
        prompts_end = metric_rows is None and all(end == length for (_, end), length in zip(spans, prompts))
        for layer in range(layers):
            key = torch.cat([keys[i, a:b, layer] for i, (a, b) in enumerate(spans)]).to(device)
            value = torch.cat([values[i, a:b, layer] for i, (a, b) in enumerate(spans)]).to(device)
            query = torch.cat([queries[i, a:b, layer] for i, (a, b) in enumerate(spans)]).to(device)
            ops.write_kv(pool, key, value, plan.write_pages[layer], plan.write_offsets[layer])
            batch = PagedBatch(cache.flat_page_tables()[slots, layer], cache.head_lens[slots, layer], starts,
                               positions)
            out = ops.paged_attention(query, pool, batch, scale, metrics=sink, partition_size=32)
            outputs.append(out.float().cpu())
            if prompts_end:
                for i, (_, end) in enumerate(spans):  # prompt metrics: the last 8 queries
                    tables, lens = batch.block_tables[i], batch.head_lens[i]
                    metric = attention_metrics(
                        queries[i, end - 8:end, layer].to(device), torch.arange(end - 8, end, device=device),
                        pool.key_cache, pool.slot_positions, tables, lens, scale)
                    accumulate_metrics(pool.slot_metrics, tables, lens, metric)

    step([(0, length // 2) for length in prompts])
    step([(length // 2, length) for length in prompts])
    flagged = torch.tensor([True, False, True])
    for t in range(decode_before):
        step([(length + t, length + t + 1) for length in prompts], metric_rows=flagged)
    context = torch.tensor([length + decode_before for length in prompts], device=device)
    evict = torch.tensor([6, 3, 8], device=device)
    result = compress_sequences(cache, pool, slots, evict, context, 4, 1, ops=ops)
    _, positions, _ = gather_logical(cache, slots)
    lens = result.new_head_lens
    kept = [sorted(positions[s, l, h, : int(lens[s, l, h])].tolist())
            for s in range(num_seqs) for l in range(layers) for h in range(heads)]
    for t in range(decode_before, decode_before + decode_after):
        step([(length + t, length + t + 1) for length in prompts], metric_rows=flagged)
    return {"outputs": outputs, "new_head_lens": lens.cpu(), "kept_positions": kept,
            "pages_freed": int(result.pages_freed), "layers": layers}


def check_cache_lifecycle(device: torch.device, ops, seed: int) -> dict:
    """:func:`run_cache_lifecycle` with the engine's ops on ``device`` against the same
    calls on the CPU with the reference ops: every step's attention equal (float32
    tolerance), the same KVs kept by the compression, the same pages freed."""
    got = run_cache_lifecycle(device, ops, seed)
    want = run_cache_lifecycle(torch.device("cpu"), resolved_ops(torch.device("cpu"), "reference", *ops_dispatch.OPS),
                               seed)
    errors = [rel_error(a, b) for a, b in zip(got["outputs"], want["outputs"])]
    same_kept = got["kept_positions"] == want["kept_positions"]
    same_lens = bool(torch.equal(got["new_head_lens"], want["new_head_lens"]))
    tolerance = (VLLM_TRITON_TOLERANCE if ops.backends.get("paged_attention") == "vllm_triton"
                 else TOLERANCE)[torch.float32]
    ok = (len(errors) == len(want["outputs"]) and max(errors) <= tolerance
          and same_kept and same_lens and got["pages_freed"] == want["pages_freed"])
    return {"op": "cache lifecycle (" + str(ops) + ")", "dtype": "float32", "head_dim": 64, "block_size": 16,
            "group": 2, "steps": len(errors) // want["layers"], "rel_error": max(errors), "same_kept_kvs": same_kept,
            "same_head_lens": same_lens, "pages_freed": got["pages_freed"], "ok": bool(ok)}


def run_vllm_unified_cases(vllm_path: Path | None) -> list[dict]:
    """``tests/unified_attention_cases.py`` compiled for the GPU (ragged per-head caches,
    GQA 1..8, head sizes 64..128, block sizes 16 / 32, decode / prefill / mixed / chunked
    batches, the slot-indexed decode with a padding row, the decode metric pass) in float32,
    bfloat16 and float16, each judged by its dtype's tolerance (relative to max |reference|)."""
    paths = [str(vllm_path.resolve())] if vllm_path is not None else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [str(ROOT), str(ROOT / "tests")]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unified_attention_cases.py"), "--device", "cuda",
         "--dtypes", "float32", "bfloat16", "float16"],
        capture_output=True, text=True, env=env, timeout=900)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not results or "unavailable" in results[0]:
        return [{"case": "unified_attention_cases.py", "ok": False,
                 "error": (done.stdout[-500:] + done.stderr[-1500:])}]
    for result in results:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(result["case"].split()[-1],
                                                                         torch.float32)
        metric_ok = result["metric_error"] <= 1e-4 * max(1.0, result.get("metric_total", 0.0))
        # The metric pass runs on the project's Triton kernels (none for a batch without
        # decode rows) and reads nothing on the host: here such a read waits for the GPU.
        launches_ok = result.get("metric_launches") == (0 if "prefill" in result["case"] else 1)
        result["ok"] = bool(result["rel_error"] <= VLLM_TRITON_TOLERANCE.get(dtype, TOLERANCE[dtype]) and metric_ok
                            and result.get("padding_row_max", 0.0) == 0.0
                            and launches_ok and result.get("metric_host_reads") == [])
    return results


def run_checks(device, ops, quick: bool) -> list[dict]:
    results = []
    seed = 100
    combos = [(64, 16), (128, 16), (256, 16), (64, 32), (128, 32), (256, 32)]
    groups = [1, 3, 4, 8, 10, 2]
    partitions = [0, 512, 64, 16, 4096, 128]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for index, (head_dim, block_size) in enumerate(combos):
            if quick and index % 2:
                continue
            group = groups[(index + len(results)) % len(groups)]
            partition = partitions[index % len(partitions)]
            if partition and partition % block_size:
                partition = 2 * block_size
            for metrics in (False, True):
                seed += 1
                try:
                    results.append(check_decode_attention(
                        device, ops, dtype, head_dim, block_size, group, partition, metrics, seed,
                        max_head_len_hint=bool(seed % 2)))
                except Exception as exc:
                    results.append({"op": "paged_decode_attention", "dtype": str(dtype), "head_dim": head_dim,
                                    "block_size": block_size, "ok": False, "error": repr(exc)})
    # Llama shape with every partition mode.
    for partition in (0, 16, 256, 512):
        seed += 1
        try:
            results.append(check_decode_attention(device, ops, torch.bfloat16, 128, 16, 4, partition, True,
                                                  seed, max_head_len_hint=False))
        except Exception as exc:
            results.append({"op": "paged_decode_attention", "ok": False, "error": repr(exc)})
    for dtype, head_dim, block_size in ((torch.bfloat16, 128, 16), (torch.float32, 64, 32),
                                        (torch.float16, 256, 16)):
        seed += 1
        try:
            results.append(check_move_cache(device, ops, dtype, head_dim, block_size, seed))
        except Exception as exc:
            results.append({"op": "move_cache", "ok": False, "error": repr(exc)})
    for _ in range(2):
        seed += 1
        try:
            results.append(check_allocate_pages(device, ops, seed))
        except Exception as exc:
            results.append({"op": "allocate_pages", "ok": False, "error": repr(exc)})
    seed += 1
    try:
        results.append(check_cache_lifecycle(device, ops_dispatch.resolve_ops(device), seed))
    except Exception as exc:
        results.append({"op": "cache lifecycle", "ok": False, "error": repr(exc)})
    if triton_available(device):
        for dtype, head_dim, block_size, group in ((torch.bfloat16, 128, 16, 4), (torch.float16, 64, 32, 2),
                                                   (torch.float32, 256, 16, 1)):
            seed += 1
            try:
                results.append(check_decode_by_slot(device, dtype, head_dim, block_size, group, seed))
            except Exception as exc:
                results.append({"op": "paged_decode_by_slot (triton)", "ok": False, "error": repr(exc)})
        # Heads up to 36K tokens: more than 32 partitions of the metric pass (64-part
        # blocks, the shape whose compile failed under Triton 3.6).
        seed += 1
        try:
            results.append(check_decode_by_slot(device, torch.bfloat16, 128, 16, 4, seed,
                                                max_tokens=36_000, partition_size=512))
        except Exception as exc:
            results.append({"op": "paged_decode_by_slot (triton)", "ok": False, "error": repr(exc)})
    return results


# ----------------------------------------------------------------------------------
# Benchmarks
# ----------------------------------------------------------------------------------


def sdpa_decode(query, keys, values, scale):
    """Decode GQA over a contiguous cache: the group is folded into the query length."""
    batch, num_kv_heads = keys.shape[0], keys.shape[1]
    q = query.view(batch, num_kv_heads, -1, query.shape[-1])  # [B, H, G, D]
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=scale)


def bench_decode(device, timer, dtype, batches, contexts, copy_gbps, mem_fraction, cuda_ok, triton_ok,
                 shapes=LLAMA, seed=0) -> list[dict]:
    rows = []
    group = shapes["num_q_heads"] // shapes["num_kv_heads"]
    head_dim, block_size, num_kv_heads = shapes["head_dim"], shapes["block_size"], shapes["num_kv_heads"]
    element = torch.tensor([], dtype=dtype).element_size()
    for context in contexts:
        for batch in batches:
            row = {"batch": batch, "context": context}
            rows.append(row)
            need = decode_case_bytes(batch, num_kv_heads, group, head_dim, block_size, context, element)
            sdpa_need = 2 * batch * num_kv_heads * (context + block_size) * head_dim * element
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**63
            if need > mem_fraction * free:
                row["skipped"] = f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
                print(f"  B={batch:4d} ctx={context:6d}: skipped ({row['skipped']})", flush=True)
                continue
            case = None
            try:
                gen = torch.Generator().manual_seed(seed + batch * 7919 + context)
                lens = random_head_lens(batch, num_kv_heads, max(1, context // 2), context, gen)
                case = make_decode_case(lens, group, head_dim, block_size, dtype, device, seed=seed,
                                        positions="visible")
                kv_bytes = case.kv_bytes()
                max_len = case.max_head_len
                row.update(mean_head_len=float(lens.float().mean()), max_head_len=max_len,
                           kv_GB=kv_bytes / 1e9)
                out = torch.empty_like(case.query)
                kv_pool, paged_batch = case.kv_pool(), case.paged_batch()
                if cuda_ok:
                    ops = cuda_ops()
                    run = lambda: ops.paged_decode_attention(  # noqa: E731
                        out, case.query, case.key_cache, case.value_cache, case.slot_positions,
                        case.block_tables, case.head_lens, case.query_positions, case.scale, 0,
                        None, None, 2, max_len)
                    ms = timer(run)
                    row.update(cuda_ms=ms, cuda_GBps=kv_bytes / ms / 1e6)
                    row["cuda_pct_copy"] = 100 * row["cuda_GBps"] / copy_gbps if copy_gbps else None
                    check = torch.full_like(out, float("nan"))
                    ops.paged_decode_attention(check, case.query, case.key_cache, case.value_cache,
                                               case.slot_positions, case.block_tables, case.head_lens,
                                               case.query_positions, case.scale, 0, None, None, 2, max_len)
                    if batch * context <= 64 * 4096:  # spot check against the reference
                        ref = reference_paged_attention(case.query, kv_pool, paged_batch, case.scale)
                        row["cuda_rel_error"] = rel_error(check.float(), ref.float())
                        del ref
                if triton_ok:
                    try:
                        triton_ops = resolved_ops(device, "triton", "paged_attention")
                        hinted = case.paged_batch(max_head_len=max_len)
                        ms = timer(lambda: triton_ops.paged_attention(case.query, kv_pool, hinted, case.scale,
                                                                      out=out))
                        row.update(triton_ms=ms, triton_GBps=kv_bytes / ms / 1e6)
                    except Exception as exc:
                        row["triton_error"] = repr(exc)[:300]
                if triton_ok:
                    # What vLLM replays for decode-only steps: the slot-indexed Triton decode
                    # (grid sized by the context bound, metric pass on) inside a CUDA graph.
                    try:
                        graph_ms, graph_error = bench_graph_decode(timer, case, context, out)
                        row.update(graph_ms=graph_ms, graph_GBps=kv_bytes / graph_ms / 1e6)
                        if graph_error is not None:
                            row["graph_rel_error"] = graph_error
                    except Exception as exc:
                        row["graph_error"] = repr(exc)[:300]
                if not cuda_ok and not triton_ok:  # CPU dry run: reference only
                    run_ref = lambda: reference_paged_attention(  # noqa: E731
                        case.query, kv_pool, paged_batch, case.scale, out=out)
                    ms = timer(run_ref, iters=3)
                    row.update(reference_ms=ms, reference_GBps=kv_bytes / ms / 1e6)
                free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**63
                if sdpa_need * 1.05 > mem_fraction * free:
                    row["sdpa_skipped"] = "contiguous copy does not fit"
                else:
                    keys, values = contiguous_cache(case, max_len)
                    ms = timer(lambda: sdpa_decode(case.query, keys, values, case.scale),
                               iters=3 if device.type == "cpu" else None)
                    sdpa_bytes = 2 * keys.numel() * keys.element_size()
                    row.update(sdpa_ms=ms, sdpa_GBps=sdpa_bytes / ms / 1e6, sdpa_len=keys.shape[2])
                    del keys, values
                summary = ", ".join(
                    f"{name} {row[name + '_ms']:.3f} ms {row[name + '_GBps']:.0f} GB/s"
                    for name in ("cuda", "triton", "reference", "sdpa") if name + "_ms" in row)
                print(f"  B={batch:4d} ctx={context:6d}: {summary}", flush=True)
            except torch.cuda.OutOfMemoryError as exc:
                row["skipped"] = f"out of memory: {str(exc)[:120]}"
                print(f"  B={batch:4d} ctx={context:6d}: skipped (OOM)", flush=True)
            except Exception as exc:
                row["error"] = repr(exc)[:500]
                print(f"  B={batch:4d} ctx={context:6d}: ERROR {exc!r}", flush=True)
                traceback.print_exc()
            finally:
                del case
                free_cached(device)
    return rows


def load_vllm_unified(vllm_path: Path | None) -> str | None:
    """Make vLLM's Triton ``unified_attention`` callable here: None, or why not.

    ``vllm_path``: a tree of vLLM's Python sources without its compiled parts
    (``scripts/stage_vllm_sources.sh``), for a GPU machine with no vLLM installed. Its
    version metadata says "+cpu", so vLLM's platform stays CPU (its CUDA platform would
    import the compiled ``vllm._C``) and vLLM switches its Triton off: the real triton is
    handed to ``vllm.triton_utils`` before the kernel module is imported."""
    if vllm_path is not None:
        sys.path.insert(0, str(vllm_path.resolve()))
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import triton
        import triton.language as tl
        from vllm import triton_utils

        if not triton_utils.HAS_TRITON:
            triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
        from kvcompress.ops import unified_attention

        unified_attention._state.clear()  # a failed load before the path was added is cached
        return unified_attention.unavailable_reason()
    except Exception as exc:
        return f"vLLM is not importable: {exc!r}"[:300]


def bench_vllm_prompt_steps(device, timer, dtype, mem_fraction, shapes=LLAMA, seed=0,
                            steps=((512, 4096, 0), (2048, 8192, 0), (512, 4096, 32), (256, 16384, 64))) -> list[dict]:
    """Steps with prompt rows (one Llama-3.1-8B layer, all eager as vLLM runs them between
    piecewise graphs): a ``chunk``-token prompt chunk after ``context`` tokens plus
    ``decodes`` decode rows at ``context``. Stock vLLM's ``unified_attention`` over its
    own cache against kvcompress's ``vllm_triton`` (one flattened call over H x S
    sequences) at rates 1 and 8, and at rate 1 the former one call per KV head."""
    from kvcompress.ops.flattened import flat_prompt, flat_query_starts
    from kvcompress.ops.unified_attention import _attend, _load

    unified_attention = _load()
    group = shapes["num_q_heads"] // shapes["num_kv_heads"]
    head_dim, block_size, num_kv_heads = shapes["head_dim"], shapes["block_size"], shapes["num_kv_heads"]
    scale = 1.0 / math.sqrt(head_dim)
    rows = []
    for chunk, context, decodes in steps:
        row = {"chunk": chunk, "context": context, "decodes": decodes}
        rows.append(row)
        num_seqs, num_rows = 1 + decodes, chunk + decodes
        starts = [0] + [chunk + i for i in range(decodes + 1)]
        try:
            kv, tables, _ = stock_decode_inputs(num_seqs, context + chunk, shapes, dtype, device, seed)
            query = torch.randn((num_rows, shapes["num_q_heads"], head_dim), device=device, dtype=dtype)
            out = torch.empty_like(query)
            query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
            seq_lens = torch.tensor([context + chunk] + [context + 1] * decodes, dtype=torch.int32, device=device)
            def stock_step():
                unified_attention(query, kv[0], kv[1], out, query_start_loc, chunk, seq_lens, context + chunk,
                                  scale, True, (-1, -1), tables, 0, None, None, None)

            row["stock_ms"] = timer(stock_step)
            row["stock_pipe_ms"], row["stock_host_ms"] = pipelined(stock_step, device, timer.iters)
            del kv, tables
            for rate in (1, 8):
                gen = torch.Generator().manual_seed(seed + rate)
                kept = (torch.full((num_seqs, num_kv_heads), context, dtype=torch.int64) if rate == 1 else
                        random_head_lens(num_seqs, num_kv_heads, context // (2 * rate), 3 * context // (2 * rate), gen))
                new_tokens = torch.tensor([chunk] + [1] * decodes).unsqueeze(1)
                case = make_decode_case(kept + new_tokens, group, head_dim, block_size, dtype, device, seed=seed,
                                        positions="visible")
                kv_pool = case.kv_pool()
                max_len = case.max_head_len
                copy_starts = PagedBatch(case.block_tables, case.head_lens, starts,
                                         torch.zeros(num_rows, dtype=torch.int64, device=device),
                                         max_head_len=max_len)
                # as the engine runs it: the flattened starts copied to the device once per step
                batch = replace(copy_starts, flat_query_start_loc=torch.from_numpy(
                    flat_query_starts(starts, num_kv_heads)).to(device))
                ops = resolved_ops(device, "vllm_triton", "paged_attention")
                row[f"rate{rate}_ms"] = timer(lambda: ops.paged_attention(query, kv_pool, batch, scale, out=out))
                row[f"rate{rate}_pipe_ms"], row[f"rate{rate}_host_ms"] = pipelined(
                    lambda: ops.paged_attention(query, kv_pool, batch, scale, out=out), device, timer.iters)
                if rate == 1:
                    row["rate1_copy_pipe_ms"], row["rate1_copy_host_ms"] = pipelined(
                        lambda: ops.paged_attention(query, kv_pool, copy_starts, scale, out=out), device, timer.iters)
                    per_call = ops.paged_attention(query, kv_pool, copy_starts, scale).float()
                    per_step = ops.paged_attention(query, kv_pool, batch, scale).float()
                    row["per_step_vs_per_call_starts_max_diff"] = (per_step - per_call).abs().max().item()
                    def per_kv_head():
                        query_starts = torch.tensor(starts, dtype=torch.int32, device=device)
                        column = torch.empty((num_rows, group, head_dim), dtype=dtype, device=device)
                        tables_used = case.block_tables[:, :, : -(-max_len // block_size)]
                        for head in range(num_kv_heads):
                            heads = slice(head * group, (head + 1) * group)
                            _attend(query[:, heads], kv_pool, column, query_starts, chunk,
                                    case.head_lens[:, head].to(torch.int32), max_len,
                                    tables_used[:, head].to(torch.int32), scale)
                            out[:, heads] = column

                    row["rate1_per_head_ms"] = timer(per_kv_head)
                    check = torch.empty_like(out)
                    per_kv_head()
                    flat_prompt(_attend, query, kv_pool, case.block_tables[:, :, : -(-max_len // block_size)],
                                case.head_lens, starts, max_len, scale, check)
                    row["one_call_vs_per_head_max_diff"] = (check.float() - out.float()).abs().max().item()
                del case, kv_pool
            for key in ("rate1_ms", "rate1_per_head_ms", "rate8_ms"):
                if row.get(key):
                    row[key.replace("_ms", "_x_stock")] = row["stock_ms"] / row[key]
            for key in ("rate1_pipe_ms", "rate1_copy_pipe_ms", "rate8_pipe_ms"):
                if row.get(key):
                    row[key.replace("_ms", "_x_stock")] = row["stock_pipe_ms"] / row[key]
            print(f"  chunk={chunk} ctx={context} decodes={decodes}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
        except Exception as exc:
            row["error"] = repr(exc)[:300]
            traceback.print_exc()
        finally:
            free_cached(device)
    return rows


def pipelined(fn, device, calls: int) -> tuple[float, float]:
    """``calls`` back-to-back calls of ``fn`` with no synchronisation between them, as the
    layers of a model's forward run: (device ms per call, from one pair of events around
    them all; host ms per call to issue them). A call that waits for the device (a copy
    from pageable host memory, a read of a device value) stops the host from running
    ahead, so its device time grows by its host time."""
    fn()
    synchronize(device)
    if device.type != "cuda":
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = (time.perf_counter() - begin) * 1e3 / calls
        return elapsed, elapsed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - begin) * 1e3 / calls
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, host


def graph_of(launch, device):
    """``launch`` (GPU work only, fixed addresses) captured in a CUDA graph: its replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile + warm up outside the capture
            launch()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    return graph.replay


def stock_decode_inputs(batch: int, context: int, shapes: dict, dtype, device, seed: int):
    """What stock vLLM's TRITON_ATTN decode reads for ``batch`` sequences of ``context``
    tokens: a ``[2, N, b, H, D]`` cache (all KV heads of a token in one page) on randomly
    scattered pages, ``[B, P]`` int32 block tables, one query row per sequence."""
    block_size, num_kv_heads, head_dim = shapes["block_size"], shapes["num_kv_heads"], shapes["head_dim"]
    pages = -(-context // block_size)
    num_pages = batch * pages + 7
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn((2, num_pages, block_size, num_kv_heads, head_dim), generator=gen, device=device,
                     dtype=dtype)
    tables = torch.randperm(num_pages, device=device)[: batch * pages].view(batch, pages).to(torch.int32)
    query = torch.randn((batch, shapes["num_q_heads"], head_dim), generator=gen, device=device, dtype=dtype)
    return kv, tables, query


def bench_vllm_parity(device, timer, dtype, batches, contexts, rates, mem_fraction, cuda_ok, triton_ok,
                      shapes=LLAMA, seed=0) -> list[dict]:
    """Decode attention of one Llama-3.1-8B layer: stock vLLM's Triton unified attention
    over its own cache (every head at ``context``) against kvcompress's backends over the
    per-head pool at each rate (rate 1: every head at ``context``, the kernel-parity case;
    rate r: per-head lengths uniform in [context / 2r, 3 context / 2r], mean context / r).
    The stock call takes vLLM's split-KV variant below 128 / H sequences, as its backend
    does; ``vllm_triton`` is the same kernel over head-as-sequence flattened tables."""
    from kvcompress.ops.unified_attention import _load

    unified_attention = _load()
    rows = []
    group = shapes["num_q_heads"] // shapes["num_kv_heads"]
    head_dim, block_size, num_kv_heads = shapes["head_dim"], shapes["block_size"], shapes["num_kv_heads"]
    element = torch.tensor([], dtype=dtype).element_size()
    scale = 1.0 / math.sqrt(head_dim)
    for context in contexts:
        for batch in batches:
            need = 2 * decode_case_bytes(batch, num_kv_heads, group, head_dim, block_size, context, element)
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**63
            if need > mem_fraction * free:
                rows.append({"batch": batch, "context": context, "skipped": f"needs {need / 2**30:.1f} GiB"})
                continue
            stock_ms = None
            try:
                kv, tables, query = stock_decode_inputs(batch, context, shapes, dtype, device, seed + batch)
                out = torch.empty_like(query)
                starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
                lens = torch.full((batch,), context, dtype=torch.int32, device=device)
                split = {}
                if batch <= 128 // num_kv_heads:
                    rows_3d, padded = max(batch, 16), 1 << (head_dim - 1).bit_length()
                    split = dict(
                        seq_threshold_3D=128 // num_kv_heads, num_par_softmax_segments=16,
                        softmax_segm_output=torch.empty((rows_3d, shapes["num_q_heads"], 16, padded),
                                                        dtype=torch.float32, device=device),
                        softmax_segm_max=torch.empty((rows_3d, shapes["num_q_heads"], 16),
                                                     dtype=torch.float32, device=device),
                        softmax_segm_expsum=torch.empty((rows_3d, shapes["num_q_heads"], 16),
                                                        dtype=torch.float32, device=device))
                def stock_decode():
                    unified_attention(query, kv[0], kv[1], out, starts, 1, lens, context, scale, True,
                                      (-1, -1), tables, 0, None, None, None, **split)

                # As vLLM runs decode-only steps: replayed from a CUDA graph (no Python
                # launch cost inside the timed region); eager time kept beside it.
                stock_eager_ms = timer(stock_decode)
                stock_ms = timer(graph_of(stock_decode, device)) if device.type == "cuda" else stock_eager_ms
                del kv, tables, query, out, split
            except Exception as exc:
                rows.append({"batch": batch, "context": context, "error": f"stock: {exc!r}"[:300]})
                traceback.print_exc()
            for rate in rates:
                row = {"batch": batch, "context": context, "rate": rate, "stock_ms": stock_ms,
                       "stock_eager_ms": stock_eager_ms if stock_ms else None}
                rows.append(row)
                case = None
                try:
                    gen = torch.Generator().manual_seed(seed + batch * 7919 + context + rate)
                    if rate == 1:
                        lens = torch.full((batch, num_kv_heads), context, dtype=torch.int64)
                    else:
                        lens = random_head_lens(batch, num_kv_heads, max(1, context // (2 * rate)),
                                                max(1, 3 * context // (2 * rate)), gen)
                    case = make_decode_case(lens, group, head_dim, block_size, dtype, device, seed=seed,
                                            positions="visible")
                    max_len = case.max_head_len
                    out = torch.empty_like(case.query)
                    kv_pool, hinted = case.kv_pool(), case.paged_batch(max_head_len=max_len)
                    backends = ["vllm_triton"] + (["triton"] if triton_ok else [])
                    for name in backends:
                        ops = resolved_ops(device, name, "paged_attention")
                        ms = timer(lambda: ops.paged_attention(case.query, kv_pool, hinted, case.scale, out=out))
                        row[f"{name}_ms"] = ms
                        if batch * context <= 64 * 4096:
                            out.fill_(float("nan"))
                            ops.paged_attention(case.query, kv_pool, hinted, case.scale, out=out)
                            ref = reference_paged_attention(case.query, kv_pool, case.paged_batch(), case.scale)
                            row[f"{name}_rel_error"] = rel_error(out.float(), ref.float())
                    if cuda_ok:
                        cuda = cuda_ops()
                        row["cuda_ms"] = timer(lambda: cuda.paged_decode_attention(
                            out, case.query, case.key_cache, case.value_cache, case.slot_positions,
                            case.block_tables, case.head_lens, case.query_positions, case.scale, 0,
                            None, None, 2, max_len))
                    if triton_ok:
                        graph_ms, graph_error = bench_graph_decode(timer, case, context, out)
                        row["graph_ms"] = graph_ms
                        if graph_error is not None:
                            row["graph_rel_error"] = graph_error
                    for name in ("vllm_triton", "triton", "cuda", "graph"):
                        if stock_ms and row.get(f"{name}_ms"):
                            row[f"{name}_x_stock"] = stock_ms / row[f"{name}_ms"]
                    print(f"  B={batch:4d} ctx={context:6d} rate={rate}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms") and v), flush=True)
                except Exception as exc:
                    row["error"] = repr(exc)[:300]
                    traceback.print_exc()
                finally:
                    del case
                    free_cached(device)
    return rows


def bench_graph_decode(timer, case: DecodeCase, max_head_len: int, out: torch.Tensor):
    """Capture ``paged_decode_by_slot_triton`` (rows = sequence slots, metric pass with
    every slot unflagged, as in a decode step of requests that do not compress) in a CUDA
    graph and time its replay. Returns ``(ms, rel error vs the reference or None)``."""
    from kvcompress.ops.decode_by_slot import graph_partition_size
    from kvcompress.ops.triton_attention import paged_decode_by_slot_triton

    batch = case.batch
    device = case.query.device
    seq_slots = torch.arange(batch, dtype=torch.int32, device=device)
    row_index = torch.arange(batch, dtype=torch.int32, device=device)
    metric_slots = torch.zeros(batch, dtype=torch.int8, device=device)
    kv_pool = case.kv_pool()
    slot_batch = SlotBatch(case.block_tables, case.head_lens, seq_slots, case.query_positions,
                           max_head_len=max_head_len, row_index=row_index)
    partition_size = graph_partition_size(max_head_len, case.key_cache.shape[1], batch * case.block_tables.shape[1])

    def launch():
        paged_decode_by_slot_triton(case.query, kv_pool, slot_batch, case.scale, out=out,
                                    metrics=MetricSink(metric_slots), partition_size=partition_size)

    replay = graph_of(launch, device)
    ms = timer(replay)
    error = None
    if batch * max_head_len <= 64 * 4096:
        out.fill_(float("nan"))
        replay()
        torch.cuda.synchronize(device)
        ref = reference_paged_attention(case.query, kv_pool, case.paged_batch(), case.scale)
        error = rel_error(out.float(), ref.float())
    del replay
    return ms, error


def contiguous_cache(case: DecodeCase, length: int):
    """``[B, H, L, D]`` K and V gathered from the pages of each head, ``L`` = ``length``
    rounded up to whole pages (shorter heads padded with whatever their table holds:
    timing only, no mask)."""
    batch, num_kv_heads, _ = case.block_tables.shape
    block_size = case.key_cache.shape[1]
    pages = -(-length // block_size)
    tables = case.block_tables[:, :, :pages]
    keys = case.key_cache[tables].reshape(batch, num_kv_heads, pages * block_size, -1)
    values = case.value_cache[tables].reshape(batch, num_kv_heads, pages * block_size, -1)
    return keys, values


def bench_move_cache(device, timer, dtype, num_moves, cuda_ok, triton_ok, seed=0) -> dict:
    head_dim, block_size = LLAMA["head_dim"], LLAMA["block_size"]
    num_pages = max(64, -(-4 * num_moves // block_size))
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty((num_pages, 2, block_size, head_dim), dtype=dtype, device=device).normal_()
    metrics = torch.rand((num_pages, block_size), device=device)
    positions = torch.zeros((num_pages, block_size), dtype=torch.int32, device=device)
    moves = random_moves(num_pages, block_size, num_moves, device, gen)
    moved = num_moves * (2 * head_dim * pool.element_size() + 8)
    result = {"moves": num_moves, "bytes_per_move": 2 * head_dim * pool.element_size() + 8,
              "GB_read_plus_written": 2 * moved / 1e9}
    kv_pool = KVPool(pool[:, 0], pool[:, 1], positions, metrics)
    runners = {"reference": lambda: reference_move_cache(kv_pool, *moves)}
    if cuda_ok:
        runners["cuda"] = lambda: cuda_ops().move_cache(pool[:, 0], pool[:, 1], metrics, positions, *moves)
    if triton_ok:
        try:
            triton_move = resolved_ops(device, "triton", "move_cache").move_cache
            runners["triton"] = lambda: triton_move(kv_pool, *moves)
        except Exception as exc:
            result["triton"] = {"error": repr(exc)[:300]}
    for name, run in runners.items():
        try:
            ms = timer(run, iters=3 if device.type == "cpu" else None)
            result[name] = {"ms": ms, "GBps": 2 * moved / ms / 1e6}
            print(f"  MoveCache {name}: {ms:.3f} ms, {2 * moved / ms / 1e6:.0f} GB/s", flush=True)
        except Exception as exc:
            result[name] = {"error": repr(exc)[:300]}
    return result


def bench_allocator(device, timer, num_seqs, num_layers, num_kv_heads, tokens, block_size, cuda_ok,
                    seed=0) -> dict:
    """Page-table fill: decode step (0/1 page per head) and prefill (tokens / b per head)."""
    result = {"seqs": num_seqs, "layers": num_layers, "kv_heads": num_kv_heads, "tokens": tokens}
    max_pages = -(-tokens // block_size) + 4
    gen = torch.Generator().manual_seed(seed)
    for label, high in (("decode_step", 1), ("prefill", max_pages - 4)):
        inputs = page_fill_inputs(num_seqs, num_layers, num_kv_heads, max_pages, high, device, gen)
        if label == "prefill":  # every head needs the same pages
            demand = torch.full_like(inputs["demand"], high)
            offsets = torch.zeros_like(inputs["offsets"])
            torch.cumsum(demand, 0, out=offsets[1:])
            total = int(offsets[-1])
            inputs.update(demand=demand, offsets=offsets, total=total,
                          first_column=torch.zeros_like(inputs["first_column"]),
                          free_stack=torch.randperm(total + 100, generator=gen).to(device), stack_start=100)
        tables = inputs["page_tables"]
        entry = {"pages": inputs["total"], "requesters": inputs["rows"].numel()}

        def fill_reference():
            reference_page_fill(tables, inputs["free_stack"], inputs["stack_start"], inputs["offsets"],
                                inputs["first_column"], inputs["rows"], inputs["demand"], inputs["total"])

        entry["reference_fill_ms"] = timer(fill_reference, iters=5 if device.type == "cpu" else None)
        if cuda_ok:
            entry["cuda_fill_ms"] = timer(lambda: cuda_ops().allocate_pages(
                tables, inputs["free_stack"], inputs["stack_start"], inputs["offsets"],
                inputs["first_column"], inputs["rows"]))
        result[label] = entry
        print(f"  allocator {label}: {entry}", flush=True)

    # The whole reference append() of one decode step (allocate_for + fill + write plan),
    # on a cache whose heads hold random lengths (filled directly: a 4K-token append of
    # 64 sequences would build a [T, L, H, P] index tensor of tens of GB).
    total_pages = num_seqs * num_layers * num_kv_heads * (max_pages + 2)
    cache = PerHeadPagedCache(total_pages, num_layers, num_kv_heads, block_size, num_seqs,
                              max_pages + 2, device)
    seq_slots = torch.tensor([cache.new_sequence() for _ in range(num_seqs)], device=device)
    lens = torch.randint(1, tokens + 1, (num_seqs, num_layers, num_kv_heads), generator=gen).to(device)
    demand = pages_for(lens, block_size).reshape(-1)
    pages, offsets = cache.allocator.allocate_for(demand)
    heads = num_layers * num_kv_heads
    rows = (seq_slots.repeat_interleave(heads) * heads + torch.arange(heads, device=device).repeat(num_seqs))
    cache.tables.assign(rows, torch.zeros_like(demand), pages, offsets)
    cache.head_lens[seq_slots] = lens
    ones = torch.ones(num_seqs, dtype=torch.int64, device=device)
    lens = lens.amax(dim=(1, 2)).cpu()
    step = {"n": 0}

    def append_step():
        step["n"] += 1
        cache.append(seq_slots, ones, (lens + step["n"]).to(device))

    result["reference_append_decode_ms"] = timer(append_step, iters=5 if device.type == "cpu" else 20)
    print(f"  allocator reference append (decode step): {result['reference_append_decode_ms']:.3f} ms",
          flush=True)
    del cache
    return result


def build_compress_state(device, num_seqs, num_layers, num_kv_heads, tokens, block_size, head_dim, dtype,
                         seed=0):
    """A cache with ``tokens`` KVs in every head (tables filled directly, no write plan)."""
    pages_per_head = -(-tokens // block_size)
    num_pages = num_seqs * num_layers * num_kv_heads * pages_per_head
    cache = PerHeadPagedCache(num_pages, num_layers, num_kv_heads, block_size, num_seqs, pages_per_head,
                              device)
    seq_slots = torch.tensor([cache.new_sequence() for _ in range(num_seqs)], dtype=torch.int64,
                             device=device)
    heads = num_layers * num_kv_heads
    demand = torch.full((num_seqs * heads,), pages_per_head, dtype=torch.int64, device=device)
    pages, offsets = cache.allocator.allocate_for(demand)
    rows = seq_slots.repeat_interleave(heads) * heads + torch.arange(heads, device=device).repeat(num_seqs)
    cache.tables.assign(rows, torch.zeros_like(demand), pages, offsets)
    cache.head_lens[seq_slots] = tokens
    offsets = torch.arange(block_size, device=device, dtype=torch.int32)
    column = torch.arange(pages_per_head, device=device, dtype=torch.int32)
    cache.slot_positions[pages] = (column.repeat(num_seqs * num_layers * num_kv_heads).unsqueeze(-1)
                                   * block_size + offsets)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache.slot_metrics.copy_(torch.rand(cache.slot_metrics.shape, generator=gen, device=device))
    pool = torch.empty((num_pages, 2, block_size, head_dim), dtype=dtype, device=device)
    return cache, seq_slots, pool


def bench_eviction(device, timer, num_seqs, num_layers, num_kv_heads, tokens, block_size, head_dim, dtype,
                   mem_fraction, cuda_ok, triton_ok) -> dict:
    result = {"seqs": num_seqs, "layers": num_layers, "kv_heads": num_kv_heads, "tokens": tokens}
    pages_per_head = -(-tokens // block_size)
    num_pages = num_seqs * num_layers * num_kv_heads * pages_per_head
    pool_bytes = num_pages * 2 * block_size * head_dim * torch.tensor([], dtype=dtype).element_size()
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**63
    full = pool_bytes * 1.3 < mem_fraction * free
    if not full:  # keep the metadata real, shrink the K / V rows
        head_dim = 16
        result["note"] = f"K/V pool of {pool_bytes / 2**30:.1f} GiB does not fit: head_dim 16 pool instead"
    result["head_dim"] = head_dim
    cache, seq_slots, pool = build_compress_state(device, num_seqs, num_layers, num_kv_heads, tokens,
                                                  block_size, head_dim, dtype)
    evict = torch.full((num_seqs,), num_layers * num_kv_heads * pages_per_head // 4, dtype=torch.int64,
                       device=device)
    context = torch.full((num_seqs,), tokens, dtype=torch.int64, device=device)
    iters = 3 if device.type == "cpu" else 5

    metrics, positions, _ = gather_logical(cache, seq_slots)
    head_lens = cache.head_lens[seq_slots]
    protected = torch.zeros_like(metrics, dtype=torch.bool)
    protected[..., :4] = True
    protected[..., -32:] = True
    for cost in ("max", "sum"):
        result[f"schedule_evictions_{cost}_ms"] = timer(
            lambda: schedule_evictions(metrics, head_lens, protected, evict, block_size, cost), iters=iters)
    del metrics, positions, protected

    tables = cache.tables
    saved = dict(chunk_tables=tables.chunk_tables.clone(), chunks=tables.chunks.clone(),
                 chunk_stack=tables.chunk_allocator.free_stack.clone(),
                 chunks_free=tables.chunk_allocator.num_free, head_lens=cache.head_lens.clone(),
                 slot_metrics=cache.slot_metrics.clone(), slot_positions=cache.slot_positions.clone(),
                 free_stack=cache.allocator.free_stack.clone(), num_free=cache.allocator.num_free)

    def restore():
        tables.chunk_tables.copy_(saved["chunk_tables"])
        tables.chunks.copy_(saved["chunks"])
        tables.chunk_allocator.free_stack.copy_(saved["chunk_stack"])
        tables.chunk_allocator.num_free = saved["chunks_free"]
        cache.head_lens.copy_(saved["head_lens"])
        cache.slot_metrics.copy_(saved["slot_metrics"])
        cache.slot_positions.copy_(saved["slot_positions"])
        cache.allocator.free_stack.copy_(saved["free_stack"])
        cache.allocator.num_free = saved["num_free"]

    kv_pool = cache.kv_pool(pool[:, 0], pool[:, 1])
    variants = {"reference": "reference"}  # name -> MoveCache backend
    if cuda_ok:
        variants["cuda_move_cache"] = "cuda"
    if triton_ok:
        variants["triton_move_cache"] = "triton"
    for name, backend in variants.items():
        try:
            ops = resolved_ops(device, backend, "move_cache")

            def compress():
                return compress_sequences(cache, kv_pool, seq_slots, evict, context, 32, 4, ops=ops)

            ms = timer(compress, iters=iters, setup=restore)
            restore()
            stats = compress()
            result[f"compress_sequences_{name}_ms"] = ms
            result["pages_freed"] = stats.pages_freed
            result["kvs_evicted"] = stats.kvs_evicted
        except Exception as exc:
            result[f"compress_sequences_{name}_error"] = repr(exc)[:300]
    print(f"  eviction: {result}", flush=True)
    del cache, pool, saved
    return result


# ----------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------


def fmt(value, digits=3):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def md_table(intro: list[str], columns: list[str], rows: list[list[str]]) -> list[str]:
    """A report section: its ``intro`` lines, a markdown table (``columns`` header, one
    row a cell list) and a blank line."""
    return [*intro, md_row(columns), "|" + "---|" * len(columns), *map(md_row, rows), ""]


def _md_header(report: dict) -> list[str]:
    """Device, versions, build and copy bandwidth."""
    lines = [f"# kvcompress kernels on {report['device']} ({report['date']})", ""]
    env = report["environment"]
    lines += [f"torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, build: {report.get('build')}", ""]
    if report.get("copy_bandwidth"):
        cb = report["copy_bandwidth"]
        lines += [f"Device copy bandwidth (read + write, {cb['bytes'] / 2**30:.1f} GiB): "
                  f"**{cb['GBps']:.0f} GB/s**", ""]
    return lines


def _md_checks(report: dict) -> list[str]:
    """Correctness checks against the PyTorch reference."""
    return _md_check_table(
        report.get("checks") or [], "## Correctness: {passed}/{total} checks passed",
        ["op", "dtype", "head", "block", "group", "partition", "metrics", "rel error", "ok"],
        lambda c: [*(fmt(c.get(k)) for k in ("op", "dtype", "head_dim", "block_size", "group", "partition_size",
                                             "metrics")),
                   fmt(c.get("rel_error"), 6) if "rel_error" in c else "-",
                   "yes" if c.get("ok") else "NO " + c.get("error", "")],
    )


def _md_check_table(checks: list[dict], heading: str, columns: list[str],
                    cells: Callable[[dict], list[str]]) -> list[str]:
    """A section of pass/fail checks (rows with ``ok``): ``heading`` with ``{passed}``
    and ``{total}`` filled in, one row a check; nothing when there are none."""
    if not checks:
        return []
    passed = sum(1 for c in checks if c.get("ok"))
    return md_table([heading.format(passed=passed, total=len(checks)), ""], columns, [cells(c) for c in checks])


def _md_decode(report: dict) -> list[str]:
    """Decode attention timings per (batch, ctx)."""
    decode = report.get("decode") or []
    if not decode:
        return []

    def note(r: dict) -> str:
        return (r.get("skipped") or r.get("error") or r.get("sdpa_skipped") or r.get("triton_error")
                or r.get("graph_error") or "")[:80]

    return md_table(
        [f"## Decode attention, Llama-3.1-8B layer ({report.get('dtype')}, 32 q / 8 KV heads, "
         "head 128, block 16; per-head lengths uniform in [ctx/2, ctx]; cold L2)", "",
         "Graph = the slot-indexed Triton decode that vLLM replays for decode-only steps "
         "(grid sized for ctx, metric pass launched), timed as CUDA-graph replays.", ""],
        ["batch", "ctx", "KV GB", "CUDA ms", "CUDA GB/s", "% copy", "Triton ms", "Triton GB/s",
         "Graph ms", "Graph GB/s", "SDPA ms", "SDPA GB/s", "ref ms", "note"],
        [[str(r["batch"]), str(r["context"]), *_timed_cells(r, DECODE_COLUMNS), note(r)] for r in decode],
    )


def _md_vllm_parity(report: dict) -> list[str]:
    """Stock vLLM's Triton decode beside kvcompress's backends."""
    parity = report.get("vllm_parity") or []
    if not parity:
        return []
    return md_table(
        [f"## Stock vLLM's Triton decode vs kvcompress's per-head backends ({report.get('dtype')}, "
         "Llama-3.1-8B layer: 32 q / 8 KV heads, head 128, block 16; cold L2)", "",
         "Stock = vLLM's `unified_attention` over its own cache, every head at ctx (split-KV "
         "below 16 sequences, as its backend), replayed from a CUDA graph as vLLM runs "
         "decode-only steps (eager beside it). Graph = kvcompress's decode-only default (the "
         "slot-indexed Triton decode, grid sized for ctx, metric pass launched) replayed from a "
         "CUDA graph; cuda / triton / vllm_triton = `paged_attention` on that backend, eager "
         "(vllm_triton reads lengths on the host). kvcompress at rate 1 holds every head at ctx "
         "(kernel parity); at rate r the per-head lengths are uniform in [ctx/2r, 3ctx/2r]. "
         "x stock = stock ms / backend ms (above 1: faster than stock).", ""],
        ["batch", "ctx", "rate", "stock ms (graph)", "stock ms (eager)", "graph ms", "x stock",
         "cuda ms", "x stock", "triton ms", "x stock", "vllm_triton ms", "x stock", "note"],
        [[str(r["batch"]), str(r["context"]), str(r.get("rate", "-")), *_timed_cells(r, PARITY_COLUMNS),
          (r.get("skipped") or r.get("error") or "")[:80]] for r in parity],
    )


def _md_prompt_steps(report: dict) -> list[str]:
    """Steps with prompt rows, one call vs per head, eager and back to back."""
    prompt_steps = report.get("vllm_prompt_steps") or []
    if not prompt_steps:
        return []
    lines = md_table(
        [f"## Steps with prompt rows: stock vLLM vs kvcompress on vLLM's Triton kernel ({report.get('dtype')}, "
         "one Llama-3.1-8B layer, eager)", "",
         "A chunk of prompt tokens after ctx tokens plus decode rows at ctx. x stock = stock ms / "
         "kvcompress ms. One call = the flattened call over H x S sequences; per head = one call "
         "per KV head.", ""],
        ["chunk", "ctx", "decode rows", "stock ms", "rate 1 ms", "x stock", "rate 1 per head ms", "x stock",
         "rate 8 ms", "x stock", "note"],
        [[str(r["chunk"]), str(r["context"]), str(r["decodes"]), *_timed_cells(r, PROMPT_STEP_COLUMNS),
          (r.get("error") or "")[:80]] for r in prompt_steps],
    )
    if any(r.get("stock_pipe_ms") for r in prompt_steps):
        def timed(r: dict, key: str) -> str:
            return f"{fmt(r.get(key + '_pipe_ms'))} ({fmt(r.get(key + '_host_ms'))})"

        lines += md_table(
            ["Back to back (the layers of a forward): calls issued with no synchronisation "
             "between them; device ms per call from one pair of events around them all, host ms "
             "per call to issue them. per-step starts: the flattened starts copied once per step "
             "(the engine); per-call copy: copied at every call (a wait on the stream on CUDA).", ""],
            ["chunk", "ctx", "decode rows", "stock ms (host)", "rate 1 ms (host)", "x stock",
             "rate 1 per-call copy ms (host)", "x stock", "rate 8 ms (host)", "x stock"],
            [[str(r["chunk"]), str(r["context"]), str(r["decodes"]), timed(r, "stock"), timed(r, "rate1"),
              fmt(r.get("rate1_pipe_x_stock"), 2), timed(r, "rate1_copy"), fmt(r.get("rate1_copy_pipe_x_stock"), 2),
              timed(r, "rate8"), fmt(r.get("rate8_pipe_x_stock"), 2)] for r in prompt_steps],
        )
    return lines


def _md_vllm_checks(report: dict) -> list[str]:
    """vLLM's unified attention over flattened tables."""
    return _md_check_table(
        report.get("vllm_unified_checks") or [],
        "## vLLM's Triton unified attention over flattened per-head tables: {passed}/{total} cases within tolerance",
        ["case", "rel error", "metric error", "metric pass launches / host reads", "ok"],
        lambda c: [c["case"], fmt(c.get("rel_error"), 6), fmt(c.get("metric_error"), 8),
                   f"{c.get('metric_launches', '-')} / {', '.join(c.get('metric_host_reads') or []) or 'none'}",
                   "yes" if c.get("ok") else "NO"],
    )


def _md_move_cache(report: dict) -> list[str]:
    """MoveCache timings per backend."""
    move = report.get("move_cache")
    if not move:
        return []
    return md_table(
        [f"## MoveCache ({move['moves']} moves, {move['bytes_per_move']} B per move)", ""],
        ["backend", "ms", "GB/s (read + write)"],
        [[name, fmt(move[name].get("ms")), f"{fmt(move[name].get('GBps'), 0)} {move[name].get('error', '')}"]
         for name in ("cuda", "triton", "reference") if name in move],
    )


def _md_allocator(report: dict) -> list[str]:
    """Page-table fill timings."""
    alloc = report.get("allocator")
    if not alloc:
        return []
    return [
        *md_table(
            [f"## Allocator ({alloc['seqs']} seqs x {alloc['layers']} layers x {alloc['kv_heads']} "
             f"KV heads, {alloc['tokens']} tokens)", ""],
            ["step", "pages", "reference fill ms", "CUDA fill ms"],
            [[label, str(alloc[label]["pages"]), fmt(alloc[label].get("reference_fill_ms")),
              fmt(alloc[label].get("cuda_fill_ms"))] for label in ("decode_step", "prefill") if label in alloc],
        ),
        f"Reference `PerHeadPagedCache.append` of one decode step: {fmt(alloc.get('reference_append_decode_ms'))} ms",
        "",
    ]


def _md_eviction(report: dict) -> list[str]:
    """One eviction step's timings."""
    lines: list[str] = []
    evict = report.get("eviction")
    if evict:
        lines += [f"## Eviction step ({evict['seqs']} seqs x {evict['layers']} layers x {evict['kv_heads']} "
                  f"KV heads x {evict['tokens']} tokens, 25% of pages evicted)", ""]
        lines += [f"- {key}: {fmt(value)}" for key, value in evict.items()
                  if key.endswith("_ms") or key.endswith("_error") or key in ("note", "pages_freed", "head_dim")]
        lines.append("")
    return lines


def _md_errors(report: dict) -> list[str]:
    """Errors met on the way."""
    lines: list[str] = []
    if report.get("errors"):
        lines += ["## Errors", ""] + [f"- {e}" for e in report["errors"]] + [""]
    return lines


# (key, decimals) of the timed columns of the decode, parity and prompt-step tables, in order.
DECODE_COLUMNS = (("kv_GB", 3), ("cuda_ms", 3), ("cuda_GBps", 0), ("cuda_pct_copy", 1), ("triton_ms", 3),
                  ("triton_GBps", 0), ("graph_ms", 3), ("graph_GBps", 0), ("sdpa_ms", 3), ("sdpa_GBps", 0),
                  ("reference_ms", 3))
PARITY_COLUMNS = (("stock_ms", 3), ("stock_eager_ms", 3), ("graph_ms", 3), ("graph_x_stock", 2), ("cuda_ms", 3),
                  ("cuda_x_stock", 2), ("triton_ms", 3), ("triton_x_stock", 2), ("vllm_triton_ms", 3),
                  ("vllm_triton_x_stock", 2))
PROMPT_STEP_COLUMNS = (("stock_ms", 3), ("rate1_ms", 3), ("rate1_x_stock", 2), ("rate1_per_head_ms", 3),
                       ("rate1_per_head_x_stock", 2), ("rate8_ms", 3), ("rate8_x_stock", 2))


def _timed_cells(row: dict, columns: tuple[tuple[str, int], ...]) -> list[str]:
    """``fmt(row[key], decimals)`` per column; a key the row lacks reads "-"."""
    return [fmt(row.get(key), decimals) for key, decimals in columns]


def markdown_report(report: dict) -> str:
    """The report as markdown: the header, then one section per part that ran."""
    lines = _md_header(report)
    for section in (_md_checks, _md_decode, _md_vllm_parity, _md_prompt_steps, _md_vllm_checks, _md_move_cache, _md_allocator, _md_eviction, _md_errors):
        lines += section(report)
    return "\n".join(lines)


def device_slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "device"


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"kernels-{device_slug(report['device'])}-{report['date']}"
    json_path = out_dir / f"{stem}.json"
    md_path = out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    md_path.write_text(markdown_report(report))
    return json_path, md_path


# ----------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Build, check and benchmark the kvcompress CUDA kernels (needs a CUDA GPU; "
        "--dry-run-cpu runs a tiny reference-only smoke test of this script on CPU).")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="tiny shapes, PyTorch reference only, on CPU (no build, no GPU)")
    parser.add_argument("--build", choices=("auto", "import", "jit", "pip"), default="auto",
                        help="how to get kvcompress._C (default: import, else JIT with ninja, else pip -e)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="cache dtype of the benchmark")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--quick", action="store_true", help="fewer checks and shapes")
    parser.add_argument("--checks-only", action="store_true", help="build and check, no benchmark")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip", nargs="*", default=[], choices=("decode", "parity", "prompt", "move", "alloc", "evict"),
                        help="benchmark sections to skip")
    parser.add_argument("--vllm-path", type=Path, default=None,
                        help="vLLM's Python sources for a machine without vLLM "
                        "(scripts/stage_vllm_sources.sh): checks and times vLLM's Triton unified "
                        "attention (the CUDA default) over flattened per-head tables")
    parser.add_argument("--parity-batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--parity-contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rates", type=int, nargs="+", default=[1, 8],
                        help="compression rates of the stock-vs-kvcompress decode section")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--moves", type=int, default=1 << 20, help="MoveCache moves")
    parser.add_argument("--mem-fraction", type=float, default=0.85,
                        help="use at most this fraction of free device memory per config")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default benchmarks/results (a temporary folder with --dry-run-cpu)")
    return parser.parse_args(argv)


@contextmanager
def section(report: dict, name: str):
    print(f"== {name}", flush=True)
    started = time.perf_counter()
    try:
        yield
    except Exception as exc:
        traceback.print_exc()
        report["errors"].append(f"{name}: {exc!r}"[:1000])
    print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)


def dry_run_checks() -> list[dict]:
    """CPU: the reference against a float64 per-head oracle, MoveCache and page fill
    reference consistency: exercises this script's input builders and comparisons."""
    results = []
    for seed, (head_dim, block_size, group) in enumerate(((64, 16, 2), (32, 32, 3))):
        gen = torch.Generator().manual_seed(seed)
        lens = random_head_lens(3, 2, 0, 70, gen)
        lens[0, 0] = 0
        case = make_decode_case(lens, group, head_dim, block_size, torch.float32, "cpu", seed=seed)
        out = torch.full_like(case.query, float("nan"))
        reference_paged_attention(case.query, case.kv_pool(), case.paged_batch(), case.scale, out=out)
        error = rel_error(out, dense_decode_oracle(case))
        results.append({"op": "reference_paged_attention_vs_oracle", "dtype": "float32", "head_dim": head_dim,
                        "block_size": block_size, "group": group, "rel_error": error, "ok": error < 1e-5})
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(20, 2, 16, 8, generator=gen)
    moves = random_moves(20, 16, 50, "cpu", gen)
    metrics = torch.rand(20, 16, generator=gen)
    positions = torch.arange(320, dtype=torch.int32).view(20, 16)
    before = (pool.clone(), metrics.clone(), positions.clone())
    reference_move_cache(KVPool(pool[:, 0], pool[:, 1], positions, metrics), *moves)
    sp, so, dp, do = moves
    ok = torch.equal(pool[dp, :, do], before[0][sp, :, so]) and torch.equal(positions[dp, do], before[2][sp, so])
    results.append({"op": "move_cache_reference", "ok": bool(ok)})
    inputs = page_fill_inputs(3, 2, 2, 12, 3, "cpu", gen)
    tables = inputs["page_tables"]
    reference_page_fill(tables, inputs["free_stack"], inputs["stack_start"], inputs["offsets"],
                        inputs["first_column"], inputs["rows"], inputs["demand"], inputs["total"])
    filled = tables[tables >= 0]
    ok = filled.numel() == inputs["total"] and torch.equal(
        filled.sort().values, inputs["free_stack"][inputs["stack_start"]:].sort().values)
    results.append({"op": "page_fill_reference", "pages": inputs["total"], "ok": bool(ok)})
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}). Run it on a GPU machine, or use "
              "--dry-run-cpu for the tiny reference-only smoke test of this script.", file=sys.stderr)
        return 2
    dry = args.dry_run_cpu
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    report = {
        "device": "cpu-dry-run" if dry else torch.cuda.get_device_name(device),
        "date": _dt.date.today().isoformat(),
        "dtype": args.dtype,
        "environment": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
                        "python": platform.python_version(), "host": platform.node(),
                        "dispatch": True},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "errors": [],
    }
    if not dry:
        props = torch.cuda.get_device_properties(device)
        report["environment"].update(sm_count=props.multi_processor_count,
                                     memory_GiB=props.total_memory / 2**30,
                                     capability=f"{props.major}.{props.minor}")
    dtype = DTYPES[args.dtype]
    timer = Timer(device, iters=3 if dry else args.iters, warmup=1 if dry else args.warmup)
    cuda_ok = False
    triton_ok = False
    vllm_ok = False
    if not dry:
        # Before anything asks the dispatcher which backends exist (it caches the answer).
        with section(report, "vLLM's Triton unified attention"):
            reason = load_vllm_unified(args.vllm_path)
            vllm_ok = reason is None
            report["environment"]["vllm_unified"] = reason or "loaded"
            print(f"   {reason or 'loaded'}", flush=True)
        with section(report, "build kvcompress._C"):
            started = time.perf_counter()
            report["build"] = build_extension(args.build)
            report["build_seconds"] = time.perf_counter() - started
            cuda_ok = hasattr(torch.ops.kvcompress, "paged_decode_attention")
            print(f"   {report['build']}: ops registered = {cuda_ok}", flush=True)
        triton_ok = triton_available(device)
        report["environment"]["triton_backend"] = triton_ok
    else:
        report["build"] = "none (dry run)"

    if not args.skip_checks:
        if vllm_ok:
            with section(report, "vLLM unified attention checks (tests/unified_attention_cases.py)"):
                report["vllm_unified_checks"] = run_vllm_unified_cases(args.vllm_path)
                for c in report["vllm_unified_checks"]:
                    print(f"   {'ok  ' if c.get('ok') else 'FAIL'} {c}", flush=True)
        with section(report, "correctness checks"):
            if dry:  # harness on the reference ops (checks the script, not kernels)
                report["checks"] = dry_run_checks() + run_checks(device, ReferenceOps(), quick=True)
            else:
                report["checks"] = run_checks(device, cuda_ops(), args.quick) if cuda_ok else []
            failed = [c for c in report["checks"] if not c.get("ok")]
            for c in report["checks"]:
                print(f"   {'ok  ' if c.get('ok') else 'FAIL'} {c}", flush=True)
            print(f"   {len(report['checks']) - len(failed)}/{len(report['checks'])} passed", flush=True)
            if not dry and not cuda_ok:
                report["errors"].append("checks: the CUDA ops are not available")

    if not args.checks_only:
        batches = [1, 2] if dry else (args.batches if not args.quick else [1, 16, 256])
        contexts = [64, 128] if dry else (args.contexts if not args.quick else [1024, 32768])
        with section(report, "device copy bandwidth"):
            report["copy_bandwidth"] = copy_bandwidth(device, timer, (1 << 24) if dry else (4 << 30))
            print(f"   {report['copy_bandwidth']['GBps']:.0f} GB/s", flush=True)
        copy_gbps = report.get("copy_bandwidth", {}).get("GBps")
        if "decode" not in args.skip:
            with section(report, "decode attention"):
                shapes = dict(LLAMA, num_q_heads=4, num_kv_heads=2, head_dim=64) if dry else LLAMA
                report["decode"] = bench_decode(device, timer, dtype, batches, contexts, copy_gbps,
                                                args.mem_fraction, cuda_ok, triton_ok, shapes=shapes)
        if "parity" not in args.skip and vllm_ok:
            with section(report, "stock vLLM decode vs kvcompress"):
                batches = args.parity_batches if not args.quick else [1, 64]
                report["vllm_parity"] = bench_vllm_parity(device, timer, dtype, batches, args.parity_contexts,
                                                          args.rates, args.mem_fraction, cuda_ok, triton_ok)
        if "prompt" not in args.skip and vllm_ok:
            with section(report, "steps with prompt rows: stock vLLM vs kvcompress"):
                report["vllm_prompt_steps"] = bench_vllm_prompt_steps(device, timer, dtype, args.mem_fraction)
        if "move" not in args.skip:
            with section(report, "MoveCache"):
                report["move_cache"] = bench_move_cache(device, timer, dtype, 256 if dry else args.moves,
                                                        cuda_ok, triton_ok)
        sizes = (2, 2, 2, 64) if dry else (64, 32, 8, 4096)
        if "alloc" not in args.skip:
            with section(report, "allocator"):
                report["allocator"] = bench_allocator(device, timer, *sizes, LLAMA["block_size"], cuda_ok)
        if "evict" not in args.skip:
            with section(report, "eviction schedule / compress_sequences"):
                report["eviction"] = bench_eviction(device, timer, *sizes, LLAMA["block_size"],
                                                    16 if dry else LLAMA["head_dim"], dtype,
                                                    args.mem_fraction, cuda_ok, triton_ok)

    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="bench_kernels_")) if dry
                               else ROOT / "benchmarks" / "results")
    json_path, md_path = write_report(report, out_dir)
    print(markdown_report(report))
    print(f"wrote {json_path} and {md_path}")
    failed = [c for c in (report.get("checks") or []) + (report.get("vllm_unified_checks") or [])
              if not c.get("ok")]
    return 1 if failed or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
