"""The project's Triton backend: :mod:`kvcompress.ops.triton_attention` and
:mod:`kvcompress.ops.triton_move_cache`.

CUDA tensors, or any tensors under ``TRITON_INTERPRET=1`` when forced (tests; ``auto``
never picks the interpreter). Its slot decode reads no lengths on the host, so it is
the one captured in full CUDA graphs. There is no Triton page-table fill.

Importable without triton (the kernel modules say ``HAS_TRITON``).
"""

from __future__ import annotations

import torch

from kvcompress.ops.backend import KernelBackend


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when Triton kernels can run on tensors of ``device``, else why not."""
    from kvcompress.ops import triton_attention

    if not triton_attention.HAS_TRITON:
        return "triton is not importable"
    if device.type == "cuda" or triton_attention.interpreter_active():
        return None
    return f"tensors are on {device}; Triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)"


class TritonBackend(KernelBackend):
    """Triton attention, slot decode and MoveCache."""

    name = "triton"
    meta_rows = False  # its kernels read slot metadata by page id (design-61-metadata-rows.md)
    ops = frozenset(("paged_attention", "paged_decode_by_slot", "move_cache"))
    capturable_decode = True
    sliding_window = True  # by stored position (`_score_tile`)

    def unavailable_reason(self, device: torch.device, op: str) -> str | None:
        if op == "fill_page_tables":
            return "there is no Triton kernel for fill_page_tables"
        return triton_unavailable_reason(device)

    def chosen_by_auto(self, device: torch.device, op: str) -> bool:
        return device.type == "cuda"  # never the interpreter

    def paged_attention(self, query, pool, batch, scale, out, metrics, *, max_query_chunk, partition_size):
        from kvcompress.ops.triton_attention import paged_attention_triton

        return paged_attention_triton(query, pool, batch, scale, out, metrics, partition_size=partition_size)

    def decode_by_slot(self, query, pool, batch, scale, out, metrics, *, partition_size):
        from kvcompress.ops.triton_attention import paged_decode_by_slot_triton

        return paged_decode_by_slot_triton(query, pool, batch, scale, out, metrics, partition_size=partition_size)

    def move_cache(self, pool, src_pages, src_offsets, dst_pages, dst_offsets) -> None:
        from kvcompress.ops.triton_move_cache import move_cache_triton

        move_cache_triton(pool, src_pages, src_offsets, dst_pages, dst_offsets)


BACKEND = TritonBackend()
