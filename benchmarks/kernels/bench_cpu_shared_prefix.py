"""vLLM's CPU attention kernel over rows that share a prefix: stock's blocks against
kvcompress's per-head pages in row-major and head-major sequence order (issue 61).

One decode step of one layer (``cpu_attention_with_kv_cache``, a prepared work split, no
KV write), ``--batch`` rows of ``--context`` KVs whose first ``--shared`` KVs are the same
pages (a prefix-cache hit's prefix), every page run ascending (a fresh engine's):

- ``stock``: stock vLLM's cache ``[blocks, Hkv, b, D]``, one kernel sequence per row with
  all its KV heads;
- ``per-head row-major``: kvcompress's pool, one kernel sequence per (row, KV head), row
  ``b``'s heads one after another (sequence ``b * H + h``: kvcompress before 2026-12-02);
- ``per-head head-major``: the same sequences ordered ``h * B + b``
  (``cpu_attention.kernel_sequence_order``): the rows' reads of one shared head follow
  each other.

Variants interleave in a fresh random order each round, each after a 64 MiB cache flush;
medians (``bench_cpu_page_size.interleaved_medians``). ``--shared 0``: nothing shared (the orders should then cost the same).

    python benchmarks/kernels/bench_cpu_shared_prefix.py --shared 1472
    python benchmarks/kernels/bench_cpu_shared_prefix.py --shared 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins


def kernel_call(torch, heads_per_seq: int, args, generator, head_major: bool = False):
    """One layer's kernel call over ``args.batch`` rows sharing their first
    ``args.shared`` KVs: stock's layout (``heads_per_seq`` = H) or per-head pages (1)."""
    from kvcompress.ops import cpu_attention

    heads, group, dim, block = args.kv_heads, args.group, args.head_dim, args.block
    dtype = getattr(torch, args.dtype)
    pages_per_seq, shared_pages = -(-args.context // block), args.shared // block
    per_head = heads_per_seq == 1
    page_groups = heads if per_head else 1  # stock: a block holds every head
    num_seqs = args.batch * page_groups
    num_pages = page_groups * shared_pages + num_seqs * (pages_per_seq - shared_pages)
    if per_head:
        buffer = torch.randn(2, num_pages, block, dim, generator=generator).to(dtype)
        key_cache, value_cache = cpu_attention.kernel_cache_views(*cpu_attention.pool_views(buffer))
    else:
        shape = (num_pages, heads, block, dim)
        key_cache = torch.randn(shape, generator=generator).to(dtype)
        value_cache = torch.randn(shape, generator=generator).to(dtype)
    rows, next_page = [], page_groups * shared_pages
    for row in range(args.batch):
        for head in range(page_groups):
            own = list(range(next_page, next_page + pages_per_seq - shared_pages))
            rows.append((head, row, list(range(head * shared_pages, (head + 1) * shared_pages)) + own))
            next_page += pages_per_seq - shared_pages
    if head_major:
        rows.sort()
    block_table = torch.tensor([pages for _, _, pages in rows], dtype=torch.int32)
    query_heads = group if per_head else heads * group
    query = torch.randn(num_seqs, query_heads, dim, generator=generator).to(dtype)
    out = torch.empty_like(query)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    lens = torch.full((num_seqs,), args.context, dtype=torch.int32)
    ops = torch.ops._C
    metadata = ops.get_scheduler_metadata(
        num_seqs, query_heads, heads_per_seq, dim, lens, dtype, starts, True, -1,
        cpu_attention.kernel_isa(block, dim), True, None, "auto",
    )

    def run():
        ops.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, out, starts, lens, dim ** -0.5, True, None, -1,
            block_table, 0.0, metadata, None, None, 1.0, 1.0, "auto",
        )

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--shared", type=int, default=1472, help="KVs of every row on shared pages")
    parser.add_argument("--block", type=int, default=64, help="stock's block and kvcompress's page size")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from benchmarks.common.machine import cpu_model_name
    from benchmarks.kernels.bench_cpu_page_size import interleaved_medians
    from kvcompress.ops import cpu_attention

    reason = cpu_attention.unavailable_reason()
    if reason is not None:
        print(f"vLLM's CPU attention kernel is not available: {reason}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    variants = {
        "stock": kernel_call(torch, args.kv_heads, args, generator),
        "per-head row-major": kernel_call(torch, 1, args, generator),
        "per-head head-major": kernel_call(torch, 1, args, generator, head_major=True),
    }
    ms = interleaved_medians(torch, variants, args.rounds)
    print(f"{args.batch} rows x {args.context} KVs, {args.shared} shared, {args.kv_heads} KV heads x "
          f"{args.group}, D {args.head_dim}, {args.dtype}, block {args.block}; {args.threads} thread(s), "
          f"{cpu_model_name()}; medians of {args.rounds} interleaved rounds")
    for name in variants:
        print(f"  {name}: {ms[name]:.3f} ms ({ms[name] / ms['stock']:.2f} x stock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
