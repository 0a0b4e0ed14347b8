"""What a kernel backend is: the :class:`KernelBackend` every backend module implements.

A backend is one object (one module each: ``backend_reference``, ``backend_cuda``,
``backend_triton``, ``backend_vllm_triton``, ``cpu_attention``) that says whether it
can run an op on a device (:meth:`~KernelBackend.unavailable_reason`, asked once when
the ops are resolved), whether it takes one call's tensors
(:meth:`~KernelBackend.supports`, asked at each call) and runs the ops it implements.
Every method has the PyTorch reference as its default, so a backend overrides only
what it accelerates. :mod:`kvcompress.ops.dispatch` holds the chain of backends and
picks among them; a new backend is one module plus one entry in that chain.

The ops (arguments as :mod:`kvcompress.ops.kv_pool` names them):

- ``paged_attention``: attention of one layer over per-head paged KVs;
- ``paged_decode_by_slot``: decode over slot-indexed tables (the CUDA-graph path);
- ``move_cache`` / ``fill_page_tables``: the pool-maintenance ops of compression and
  the allocator.

Importable without vLLM, triton and the CUDA extension.
"""

from __future__ import annotations

import torch

from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch
from kvcompress.ops.move_cache import move_cache as reference_move_cache
from kvcompress.ops.page_tables import fill_page_tables as reference_fill_page_tables
from kvcompress.ops.reference_attention import reference_paged_attention
from kvcompress.ops.reference_attention import reference_write_kv

# Every op a backend may implement.
ATTENTION_OPS = ("paged_attention", "paged_decode_by_slot")
POOL_OPS = ("move_cache", "fill_page_tables")
ALL_OPS = ATTENTION_OPS + POOL_OPS


class KernelBackend:
    """One way of running the ops; the defaults are the PyTorch reference.

    Attributes:
        name: what ``use_backend`` / ``$KVCOMPRESS_OPS_BACKEND`` call it.
        ops: the ops it implements (the others run elsewhere, see
            :mod:`kvcompress.ops.dispatch`).
        fallbacks: names of the backends that take the attention calls it does not
            support (:meth:`supports` False), in order; the first one available on the
            device runs them.
        kernel_page_layout: whether its attention reads pages in vLLM's CPU kernel
            layout (the engine then builds its pool with
            :func:`kvcompress.ops.cpu_attention.pool_views`).
        capturable_decode: whether its ``paged_decode_by_slot`` can be captured in a
            CUDA graph (no host reads) when it runs on CUDA tensors.
        plans_decode_steps: whether it has a per-step decode plan
            (:meth:`decode_planned`).
        sliding_window: whether its attention applies a batch's ``sliding_window``
            (:attr:`~kvcompress.ops.kv_pool.PagedBatch.sliding_window`); calls with a
            window go to a fallback that does otherwise (the reference does).
        meta_rows: whether its ops read slot positions and metrics through a pool's
            ``page_meta_row`` (:class:`~kvcompress.ops.kv_pool.KVPool`); calls on a pool
            with rows go to a fallback that does otherwise (the reference does).
    """

    name: str = "reference"
    ops: frozenset[str] = frozenset(ALL_OPS)
    fallbacks: tuple[str, ...] = ()
    kernel_page_layout: bool = False
    capturable_decode: bool = False
    plans_decode_steps: bool = False
    sliding_window: bool = False
    meta_rows: bool = True

    def __repr__(self) -> str:
        return f"<kernel backend {self.name}>"

    def unavailable_reason(self, device: torch.device, op: str) -> str | None:
        """None when it can run ``op`` (``paged_attention``, ``move_cache`` or
        ``fill_page_tables``; ``paged_decode_by_slot`` is asked as ``paged_attention``)
        on tensors of ``device``, else why not."""
        return None

    def chosen_by_auto(self, device: torch.device, op: str) -> bool:
        """Whether ``auto`` may pick it for ``op`` on ``device`` (when available)."""
        return True

    def supports(
        self, query: torch.Tensor, pool: KVPool, batch: PagedBatch | SlotBatch | None = None,
        out: torch.Tensor | None = None,
    ) -> bool:
        """Whether it takes this attention call (else the first of :attr:`fallbacks`
        available runs it)."""
        return True

    def paged_attention(
        self, query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
        out: torch.Tensor | None, metrics: MetricSink | None, *, max_query_chunk: int, partition_size: int,
    ) -> torch.Tensor:
        """As :func:`kvcompress.ops.reference_attention.reference_paged_attention`."""
        return reference_paged_attention(query, pool, batch, scale, out, metrics, max_query_chunk)

    def decode_by_slot(
        self, query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
        out: torch.Tensor | None, metrics: MetricSink | None, *, partition_size: int,
    ) -> torch.Tensor:
        """As :func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference`."""
        return paged_decode_by_slot_reference(query, pool, batch, scale, out, metrics)

    def write_kv(
        self, pool: KVPool, key: torch.Tensor, value: torch.Tensor,
        write_pages: torch.Tensor, write_offsets: torch.Tensor,
    ) -> None:
        """As :func:`kvcompress.ops.reference_attention.reference_write_kv` (``key`` / ``value``
        ``[T, H, D]``, targets ``[T, H]``)."""
        reference_write_kv(pool.key_cache, pool.value_cache, key, value, write_pages, write_offsets)

    def move_cache(
        self, pool: KVPool, src_pages: torch.Tensor, src_offsets: torch.Tensor,
        dst_pages: torch.Tensor, dst_offsets: torch.Tensor,
    ) -> None:
        """As :func:`kvcompress.ops.move_cache.move_cache` (never called with no moves)."""
        reference_move_cache(pool, src_pages, src_offsets, dst_pages, dst_offsets)

    def fill_page_tables(
        self, page_tables: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
        first_column: torch.Tensor, rows: torch.Tensor,
    ) -> None:
        """As :func:`kvcompress.ops.page_tables.fill_page_tables`."""
        reference_fill_page_tables(page_tables, pages, offsets, first_column, rows)

    def decode_planned(
        self, query: torch.Tensor, pool: KVPool, tables, scale: float, out: torch.Tensor,
        metric_power: int | None = None, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Decode one layer with the step's plan (backends with :attr:`plans_decode_steps`),
        within ``sliding_window`` when given."""
        raise NotImplementedError(f"the {self.name} backend has no per-step decode plan")
