"""Backend choice for the GPU-capable ops: CUDA extension -> Triton -> PyTorch reference.

Entry points with the reference signatures:

- :func:`paged_attention` (see :func:`kvcompress.ops.paged_attention.paged_attention`)
- :func:`paged_decode_by_slot` (see
  :func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference`): decode over
  slot-indexed tables, the CUDA-graph path; Triton or reference (the CUDA op takes
  gathered tables, so a selected ``"cuda"`` runs Triton here)
- :func:`move_cache` (see :func:`kvcompress.ops.move_cache.move_cache`)
- :func:`fill_page_tables` (see :func:`kvcompress.ops.paged_cache.fill_page_tables`):
  the allocator's page-table scatter; CUDA op or reference (it has no Triton kernel:
  a forced ``"triton"`` runs the reference)

Backends:

- ``"cuda"``: the compiled extension ``kvcompress._C`` registering
  ``torch.ops.kvcompress.paged_decode_attention`` and ``torch.ops.kvcompress.move_cache``;
  only for CUDA tensors. The CUDA attention op is decode-only and compiled for some
  shapes (query and caches of one dtype, head size 64/128/256, block size 16/32,
  contiguous 16-byte aligned rows): any other batch (a prefill / chunked-prefill row,
  another shape) goes to Triton (or the reference when triton is missing) even when
  ``"cuda"`` is selected.
- ``"triton"``: :mod:`kvcompress.ops.triton_attention` / :mod:`~kvcompress.ops.triton_move_cache`;
  CUDA tensors, or any tensors under ``TRITON_INTERPRET=1`` when forced (tests).
- ``"reference"``: the PyTorch ops (any device).

``"auto"`` (default) picks the first available in that order for CUDA tensors and the
reference otherwise (the interpreter is never chosen automatically). The choice is
overridable with the environment variable ``KVCOMPRESS_OPS_BACKEND`` (read at each
call) and, taking precedence, the context manager :func:`use_backend`. A forced backend
that cannot run raises :class:`BackendUnavailableError` naming the reason.

Importable without vLLM, without triton and without the CUDA extension.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from kvcompress.ops.move_cache import move_cache as _reference_move_cache
from kvcompress.ops.paged_attention import paged_attention as _reference_paged_attention

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "BackendUnavailableError",
    "available_backends",
    "decode_by_slot_capturable",
    "cuda_decode_supports",
    "fill_page_tables",
    "move_cache",
    "paged_attention",
    "paged_decode_by_slot",
    "requested_backend",
    "selected_backend",
    "use_backend",
]

BACKENDS = ("auto", "cuda", "triton", "reference")
ENV_VAR = "KVCOMPRESS_OPS_BACKEND"
# Op name -> name of the CUDA op registered by kvcompress._C.
CUDA_OPS = {
    "paged_attention": "paged_decode_attention",
    "move_cache": "move_cache",
    "fill_page_tables": "allocate_pages",
}


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run the op on the given device."""


_local = threading.local()


def _check_name(name: str) -> str:
    lowered = str(name).strip().lower()
    if lowered not in BACKENDS:
        raise ValueError(f"unknown kvcompress ops backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return lowered


def requested_backend() -> str:
    """The backend asked for: innermost :func:`use_backend`, else ``$KVCOMPRESS_OPS_BACKEND``,
    else ``"auto"``."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    return _check_name(os.environ.get(ENV_VAR, "auto") or "auto")


@contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Force a backend (``auto``, ``cuda``, ``triton``, ``reference``) inside a ``with`` block
    (per thread; nests)."""
    name = _check_name(name)
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        yield name
    finally:
        stack.pop()


# -- availability ---------------------------------------------------------------------

_extension_state: dict = {}


def _load_extension() -> str | None:
    """Import ``kvcompress._C`` once; returns None on success, else why it failed."""
    if "error" not in _extension_state:
        try:
            import kvcompress._C  # noqa: F401

            _extension_state["error"] = None
        except Exception as exc:  # ImportError, or an ABI mismatch (OSError, ...)
            _extension_state["error"] = f"kvcompress._C is not importable ({type(exc).__name__}: {exc})"
    return _extension_state["error"]


def _cuda_op(op: str):
    """The registered CUDA op for ``op`` or None."""
    name = CUDA_OPS[op]
    if _load_extension() is not None:
        return None
    try:
        namespace = getattr(torch.ops, "kvcompress")
        if not hasattr(namespace, name):
            return None
        return getattr(namespace, name)
    except Exception:
        return None


def _cuda_unavailable_reason(device: torch.device, op: str) -> str | None:
    if device.type != "cuda":
        return f"tensors are on {device}, the CUDA extension needs CUDA tensors"
    error = _load_extension()
    if error is not None:
        return error
    if _cuda_op(op) is None:
        return f"kvcompress._C does not register torch.ops.kvcompress.{CUDA_OPS[op]}"
    return None


def _triton_unavailable_reason(device: torch.device, op: str) -> str | None:
    from kvcompress.ops import triton_attention

    if op == "fill_page_tables":
        return "there is no Triton kernel for fill_page_tables"

    if not triton_attention.HAS_TRITON:
        return "triton is not importable"
    if device.type == "cuda" or triton_attention.interpreter_active():
        return None
    return f"tensors are on {device}; Triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)"


def available_backends(device: torch.device | str, op: str = "paged_attention") -> list[str]:
    """Backends that can run ``op`` (``paged_attention`` or ``move_cache``) on ``device``,
    in preference order (the interpreter counts only when ``TRITON_INTERPRET=1``)."""
    device = torch.device(device)
    if op not in CUDA_OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(CUDA_OPS)}")
    found = []
    if _cuda_unavailable_reason(device, op) is None:
        found.append("cuda")
    if _triton_unavailable_reason(device, op) is None:
        found.append("triton")
    found.append("reference")
    return found


def selected_backend(device: torch.device | str, op: str = "paged_attention") -> str:
    """Which backend runs ``op`` on tensors of ``device`` under the current setting.

    ``"auto"``: ``cuda`` > ``triton`` > ``reference`` for CUDA tensors, ``reference``
    elsewhere. A forced backend is returned as is when it can run, else
    :class:`BackendUnavailableError` is raised. (For ``paged_attention`` this is the
    backend of decode-only batches: with ``cuda``, batches with prefill rows or shapes
    without a CUDA kernel (:func:`cuda_decode_supports`) run on Triton when available,
    else on the reference.)
    """
    device = torch.device(device)
    if op not in CUDA_OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(CUDA_OPS)}")
    wanted = requested_backend()
    if wanted == "auto":
        if device.type != "cuda":
            return "reference"
        if _cuda_unavailable_reason(device, op) is None:
            return "cuda"
        if _triton_unavailable_reason(device, op) is None:
            return "triton"
        return "reference"
    if wanted == "reference":
        return "reference"
    reason = (
        _cuda_unavailable_reason(device, op) if wanted == "cuda" else _triton_unavailable_reason(device, op)
    )
    if reason is not None:
        source = "use_backend()" if getattr(_local, "stack", None) else f"{ENV_VAR}={os.environ.get(ENV_VAR)}"
        raise BackendUnavailableError(
            f"kvcompress ops backend {wanted!r} was forced ({source}) but cannot run {op}: {reason}"
        )
    return wanted


# -- calling the CUDA ops -------------------------------------------------------------------


def _call_by_schema(op, values: dict):
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


def _is_decode_only(query_start_loc: list[int]) -> bool:
    return all(query_start_loc[s + 1] - query_start_loc[s] == 1 for s in range(len(query_start_loc) - 1))


CUDA_DECODE_HEAD_SIZES = (64, 128, 256)
CUDA_DECODE_BLOCK_SIZES = (16, 32)


def _rows_aligned(cache: torch.Tensor) -> bool:
    size = cache.element_size()
    return (
        cache.stride(2) == 1
        and cache.data_ptr() % 16 == 0
        and (cache.stride(0) * size) % 16 == 0
        and (cache.stride(1) * size) % 16 == 0
    )


def cuda_decode_supports(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor | None
) -> bool:
    """Whether ``torch.ops.kvcompress.paged_decode_attention`` has a kernel for these tensors."""
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


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_positions: torch.Tensor,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    query_start_loc,
    query_positions: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_chunk: int = 512,
    slot_metrics: torch.Tensor | None = None,
    metric_seqs: torch.Tensor | None = None,
    metric_power: int = 2,
    *,
    max_head_len: int | None = None,
    partition_size: int = 512,
) -> torch.Tensor:
    """Attention of one layer over per-head paged KVs on the selected backend.

    Arguments and result as :func:`kvcompress.ops.paged_attention.paged_attention`.
    ``max_head_len`` (optional upper bound of the decode rows' head lengths) lets the
    Triton decode size its partition grid without reading ``head_lens`` on the host.
    ``partition_size``: keys per decode partition (CUDA and Triton; a multiple of the
    block size).
    """
    backend = selected_backend(query.device, "paged_attention")
    if isinstance(query_start_loc, torch.Tensor):
        query_start_loc = query_start_loc.tolist()
    if backend == "cuda":
        num_seqs = len(query_start_loc) - 1
        if _is_decode_only(query_start_loc) and cuda_decode_supports(query, key_cache, value_cache, out):
            if out is None:
                out = torch.empty_like(query)
            if num_seqs == 0:
                return out
            # Decode-only: query row s is sequence s (rows past the batch are padding).
            values = dict(
                out=out[:num_seqs], query=query[:num_seqs], key_cache=key_cache,
                value_cache=value_cache, slot_positions=slot_positions, block_tables=block_tables,
                head_lens=head_lens, query_positions=query_positions[:num_seqs],
                scale=float(scale), partition_size=int(partition_size),
                slot_metrics=slot_metrics if metric_seqs is not None else None,
                metric_seqs=metric_seqs if slot_metrics is not None else None,
                metric_power=int(metric_power),
                max_head_len=max_head_len,
            )
            _call_by_schema(_cuda_op("paged_attention"), values)
            return out
        # The CUDA op is decode-only: other batches run on Triton when it can.
        backend = "triton" if _triton_unavailable_reason(query.device, "paged_attention") is None else "reference"
    if backend == "triton":
        from kvcompress.ops.triton_attention import paged_attention_triton

        return paged_attention_triton(
            query, key_cache, value_cache, slot_positions, block_tables, head_lens,
            query_start_loc, query_positions, scale, out=out, max_query_chunk=max_query_chunk,
            slot_metrics=slot_metrics, metric_seqs=metric_seqs, metric_power=metric_power,
            max_head_len=max_head_len, partition_size=partition_size,
        )
    return _reference_paged_attention(
        query, key_cache, value_cache, slot_positions, block_tables, head_lens,
        query_start_loc, query_positions, scale, out=out, max_query_chunk=max_query_chunk,
        slot_metrics=slot_metrics, metric_seqs=metric_seqs, metric_power=metric_power,
    )


def paged_decode_by_slot(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_positions: torch.Tensor,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    seq_slots: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    slot_metrics: torch.Tensor | None = None,
    metric_slots: torch.Tensor | None = None,
    metric_power: int = 2,
    max_head_len: int | None = None,
    *,
    partition_size: int = 512,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slot-indexed decode attention on the selected backend (Triton for CUDA tensors
    when importable, else the reference); arguments as
    :func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference`."""
    backend = selected_backend(query.device, "paged_attention")
    if backend == "cuda":
        backend = "triton" if _triton_unavailable_reason(query.device, "paged_attention") is None else "reference"
    if backend == "triton":
        from kvcompress.ops.triton_attention import paged_decode_by_slot_triton

        return paged_decode_by_slot_triton(
            query, key_cache, value_cache, slot_positions, block_tables, head_lens, seq_slots,
            query_positions, scale, out=out, slot_metrics=slot_metrics, metric_slots=metric_slots,
            metric_power=metric_power, max_head_len=max_head_len, partition_size=partition_size,
            row_index=row_index,
        )
    from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference

    return paged_decode_by_slot_reference(
        query, key_cache, value_cache, slot_positions, block_tables, head_lens, seq_slots,
        query_positions, scale, out=out, slot_metrics=slot_metrics, metric_slots=metric_slots,
        metric_power=metric_power,
    )


def decode_by_slot_capturable(device: torch.device | str) -> bool:
    """Whether :func:`paged_decode_by_slot` runs a graph-capturable kernel on ``device``
    (Triton on CUDA; the reference reads lengths on the host)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    try:
        backend = selected_backend(device, "paged_attention")
    except BackendUnavailableError:
        return False
    if backend == "reference":
        return False
    return _triton_unavailable_reason(device, "paged_attention") is None


def move_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_metrics: torch.Tensor,
    slot_positions: torch.Tensor,
    src_pages: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_pages: torch.Tensor,
    dst_offsets: torch.Tensor,
) -> None:
    """MoveCache on the selected backend; arguments as
    :func:`kvcompress.ops.move_cache.move_cache`."""
    backend = selected_backend(key_cache.device, "move_cache")
    if src_pages.numel() == 0:
        return
    if backend == "cuda":
        _call_by_schema(
            _cuda_op("move_cache"),
            dict(
                key_cache=key_cache, value_cache=value_cache, slot_metrics=slot_metrics,
                slot_positions=slot_positions, src_pages=src_pages, src_offsets=src_offsets,
                dst_pages=dst_pages, dst_offsets=dst_offsets,
            ),
        )
        return
    if backend == "triton":
        from kvcompress.ops.triton_move_cache import move_cache_triton

        move_cache_triton(
            key_cache, value_cache, slot_metrics, slot_positions,
            src_pages, src_offsets, dst_pages, dst_offsets,
        )
        return
    _reference_move_cache(
        key_cache, value_cache, slot_metrics, slot_positions,
        src_pages, src_offsets, dst_pages, dst_offsets,
    )


def fill_page_tables(
    page_tables: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    first_column: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """The allocator's page-table fill on the selected backend; arguments as
    :func:`kvcompress.ops.paged_cache.fill_page_tables`."""
    from kvcompress.ops.paged_cache import fill_page_tables as reference_fill

    wanted = requested_backend()
    backend = "reference" if wanted == "triton" else selected_backend(page_tables.device, "fill_page_tables")
    if backend == "cuda" and page_tables.is_contiguous() and pages.is_contiguous():
        # The op pops from a free stack: ``pages`` is that slice, so it starts at 0.
        _call_by_schema(
            _cuda_op("fill_page_tables"),
            dict(
                page_tables=page_tables, free_stack=pages.to(torch.int64), stack_start=0,
                offsets=offsets, first_column=first_column, rows=rows,
            ),
        )
        return
    reference_fill(page_tables, pages, offsets, first_column, rows)
