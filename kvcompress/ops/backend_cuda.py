"""The CUDA extension backend: ``kvcompress._C``'s decode attention, MoveCache and page-table fill.

The extension registers ``torch.ops.kvcompress.paged_decode_attention``,
``move_cache`` and ``allocate_pages``; only for CUDA tensors. The attention op is
decode-only and compiled for some shapes (query and caches of one dtype, head size
64/128/256, block size 16/32, contiguous 16-byte aligned rows): any other batch (a
prefill / chunked-prefill row, another shape) goes to Triton (or the reference when
triton is missing). It has no slot-indexed decode (its op takes gathered tables), so
``paged_decode_by_slot`` runs on Triton / the reference. The ops are called by their
schema argument names (the C++ side is written separately).

Importable without the extension (it is imported on first use).
"""

from __future__ import annotations

import torch

from kvcompress.ops.backend import KernelBackend
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch

# Op name -> name of the CUDA op registered by kvcompress._C.
CUDA_OPS = {
    "paged_attention": "paged_decode_attention",
    "move_cache": "move_cache",
    "fill_page_tables": "allocate_pages",
}
CUDA_DECODE_HEAD_SIZES = (64, 128, 256)
CUDA_DECODE_BLOCK_SIZES = (16, 32)


def call_by_schema(op, values: dict):
    """Call a registered op, passing the entries of ``values`` whose names match its schema.

    The CUDA ops are written separately; matching by argument name keeps this glue
    independent of argument order. A required schema argument missing from ``values``
    is an error naming it.
    """
    schema = op.default._schema
    kwargs = {}
    for argument in schema.arguments:
        if argument.name in values:
            kwargs[argument.name] = values[argument.name]
        elif not argument.has_default_value():
            raise TypeError(
                f"{schema.name}: don't know what to pass for argument {argument.name!r} "
                f"(available: {', '.join(sorted(values))})"
            )
    return op(**kwargs)


def _rows_aligned(cache: torch.Tensor) -> bool:
    size = cache.element_size()
    return (
        cache.stride(2) == 1
        and cache.data_ptr() % 16 == 0
        and (cache.stride(0) * size) % 16 == 0
        and (cache.stride(1) * size) % 16 == 0
    )


def cuda_decode_supports(query: torch.Tensor, pool: KVPool, out: torch.Tensor | None) -> bool:
    """Whether ``torch.ops.kvcompress.paged_decode_attention`` has a kernel for these tensors."""
    key_cache, value_cache = pool.key_cache, pool.value_cache
    return (
        key_cache.dtype == value_cache.dtype == query.dtype
        and (out is None or out.dtype == query.dtype)
        and query.shape[-1] in CUDA_DECODE_HEAD_SIZES
        and key_cache.shape[1] in CUDA_DECODE_BLOCK_SIZES
        and query.stride(-1) == 1
        and (out is None or out.stride(-1) == 1)
        and _rows_aligned(key_cache)
        and _rows_aligned(value_cache)
    )


class CudaBackend(KernelBackend):
    """``kvcompress._C``; the import is tried once per backend object."""

    name = "cuda"
    meta_rows = False  # its kernels read slot metadata by page id (design-61-metadata-rows.md)
    ops = frozenset(("paged_attention", "move_cache", "fill_page_tables"))
    fallbacks = ("triton", "reference")

    def __init__(self) -> None:
        self._extension_error: str | None = None
        self._extension_tried = False

    def extension_error(self) -> str | None:
        """Import ``kvcompress._C`` once; None on success, else why it failed."""
        if not self._extension_tried:
            try:
                import kvcompress._C  # noqa: F401
            except Exception as exc:  # ImportError, or an ABI mismatch (OSError, ...)
                self._extension_error = f"kvcompress._C is not importable ({type(exc).__name__}: {exc})"
            self._extension_tried = True
        return self._extension_error

    def op(self, op: str):
        """The registered CUDA op for ``op`` or None."""
        if self.extension_error() is not None:
            return None
        try:
            return getattr(torch.ops.kvcompress, CUDA_OPS[op], None)
        except Exception:
            return None

    def unavailable_reason(self, device: torch.device, op: str) -> str | None:
        if device.type != "cuda":
            return f"tensors are on {device}, the CUDA extension needs CUDA tensors"
        error = self.extension_error()
        if error is not None:
            return error
        if self.op(op) is None:
            return f"kvcompress._C does not register torch.ops.kvcompress.{CUDA_OPS[op]}"
        return None

    def supports(self, query, pool, batch=None, out=None) -> bool:
        """Decode-only batches of the shapes the op is compiled for."""
        return batch is not None and batch.decode_only() and cuda_decode_supports(query, pool, out)

    def paged_attention(self, query, pool, batch, scale, out, metrics, *, max_query_chunk, partition_size):
        return self._decode(query, pool, batch, scale, out, metrics, partition_size)

    def _decode(
        self, query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
        out: torch.Tensor | None, metrics: MetricSink | None, partition_size: int,
    ) -> torch.Tensor:
        """``paged_decode_attention`` on a decode-only batch: query row ``s`` is sequence
        ``s`` (rows past the batch are padding)."""
        if out is None:
            out = torch.empty_like(query)
        num_seqs = len(batch.query_start_loc) - 1
        if num_seqs == 0:
            return out
        values = dict(
            pool.tensors(),
            out=out[:num_seqs], query=query[:num_seqs], block_tables=batch.block_tables,
            head_lens=batch.head_lens, query_positions=batch.query_positions[:num_seqs],
            scale=float(scale), partition_size=int(partition_size), max_head_len=batch.max_head_len,
            metric_seqs=None if metrics is None else metrics.selected,
            metric_power=2 if metrics is None else int(metrics.power),
        )
        if metrics is None:
            values["slot_metrics"] = None
        call_by_schema(self.op("paged_attention"), values)
        return out

    def move_cache(self, pool, src_pages, src_offsets, dst_pages, dst_offsets) -> None:
        moves = dict(src_pages=src_pages, src_offsets=src_offsets, dst_pages=dst_pages, dst_offsets=dst_offsets)
        call_by_schema(self.op("move_cache"), {**pool.tensors(), **moves})

    def fill_page_tables(self, page_tables, pages, offsets, first_column, rows) -> None:
        if not (page_tables.is_contiguous() and pages.is_contiguous()):
            super().fill_page_tables(page_tables, pages, offsets, first_column, rows)
            return
        # The op pops from a free stack: ``pages`` is that slice, so it starts at 0.
        call_by_schema(
            self.op("fill_page_tables"),
            dict(
                page_tables=page_tables, free_stack=pages.to(torch.int64), stack_start=0,
                offsets=offsets, first_column=first_column, rows=rows,
            ),
        )


BACKEND = CudaBackend()
