"""Backend selection for the ops: the chain of :class:`~kvcompress.ops.backend.KernelBackend`
objects and the rule that picks one per op and device.

:func:`resolve_ops` picks the backends for a device once and returns a :class:`KernelOps`
whose methods run them (an engine resolves once; its attention and compression use that
object). The ops, their arguments and what each backend is: :mod:`kvcompress.ops.backend`
and the backends' modules (``backend_*``; ``vllm_cpu`` is :mod:`kvcompress.ops.cpu_attention`). The module-level functions of the ops' names resolve at
each call (tests, scripts).

**The chain** (:data:`CHAIN`, in preference order): ``vllm_triton``, ``cuda``,
``triton``, ``vllm_cpu``, ``reference``. A new backend is one module and one entry here.

**Resolution** of an op (``use_backend()`` innermost, else ``$KVCOMPRESS_OPS_BACKEND``,
else ``auto``; read when the ops are resolved):

- ``auto``: the first backend of the chain that implements the op, is chosen by auto
  for it (:meth:`~kvcompress.ops.backend.KernelBackend.chosen_by_auto`: the Triton
  backends only on CUDA tensors, never the interpreter; ``vllm_triton`` only for
  ``paged_attention``) and is available (``unavailable_reason`` None).
- forced, an op the backend implements: that backend, or :class:`BackendUnavailableError`
  naming the reason and the setting (``use_backend()`` or ``KVCOMPRESS_OPS_BACKEND=...``).
- forced, an attention op it lacks (``cuda``'s slot decode): the backend must be
  available for ``paged_attention`` (else the error), then its first available fallback.
- forced, a pool op it lacks (``move_cache`` / ``fill_page_tables`` of ``triton``,
  ``vllm_triton``, ``vllm_cpu``): the reference, no error.

At each attention call the resolved backend runs it when it
:meth:`~kvcompress.ops.backend.KernelBackend.supports` the tensors, else the first of its
``fallbacks`` available on the device (``cuda``: a batch with prompt rows or a shape
without a CUDA kernel; ``vllm_triton`` / ``vllm_cpu``: dtypes or layouts their kernels
lack).

What runs where (``-``: not chosen; ``ref``: the reference; ``T/ref``: Triton when
available, else the reference; ``!``: BackendUnavailableError when unavailable):

==================  ==================  ==================  ==============  ================
setting             paged_attention     paged_decode_by_slot move_cache     fill_page_tables
==================  ==================  ==================  ==============  ================
auto, CUDA tensors  vllm_triton > cuda  T/ref               cuda > triton   cuda > ref
                    > triton > ref                          > ref
auto, CPU tensors   vllm_cpu > ref      vllm_cpu > ref      ref             ref
cuda                cuda !              T/ref (cuda !)      cuda !          cuda !
triton              triton !            triton !            triton !        ref
vllm_triton         vllm_triton !       vllm_triton !       ref             ref
vllm_cpu            vllm_cpu !          vllm_cpu !          ref             ref
reference           ref                 ref                 ref             ref
==================  ==================  ==================  ==============  ================

:func:`selected_backend` / :func:`available_backends` answer for ``paged_attention``,
``move_cache`` and ``fill_page_tables`` without the pool-op rule (a forced backend
lacking the op raises). ``tests/test_dispatch_backends.py`` pins the table.

Importable without vLLM, without triton and without the CUDA extension.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from kvcompress.ops import backend_cuda, backend_reference, backend_triton, backend_vllm_triton, cpu_attention
from kvcompress.ops.backend import ALL_OPS, ATTENTION_OPS, POOL_OPS, KernelBackend
from kvcompress.ops.backend_cuda import CUDA_OPS, cuda_decode_supports
from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch

__all__ = [
    "BACKENDS",
    "CHAIN",
    "ENV_VAR",
    "OPS",
    "BackendUnavailableError",
    "KernelOps",
    "available_backends",
    "backend_named",
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

# The backends in preference order; the reference, which runs everything, is last.
CHAIN: list[KernelBackend] = [
    backend_vllm_triton.BACKEND,
    backend_cuda.BACKEND,
    backend_triton.BACKEND,
    cpu_attention.BACKEND,
    backend_reference.BACKEND,
]
BACKENDS = ("auto", *(backend.name for backend in CHAIN))
ENV_VAR = "KVCOMPRESS_OPS_BACKEND"
# The ops a KernelOps runs.
OPS = ALL_OPS
# The ops selected_backend / available_backends answer for (the slot decode follows
# paged_attention's availability).
SELECTABLE_OPS = tuple(CUDA_OPS)


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run the op on the given device."""


_local = threading.local()


def backend_named(name: str) -> KernelBackend:
    """The backend of the chain called ``name``."""
    for backend in CHAIN:
        if backend.name == name:
            return backend
    raise ValueError(f"no kvcompress ops backend {name!r} in the chain")


def _check_name(name: str) -> str:
    lowered = str(name).strip().lower()
    names = ("auto", *(backend.name for backend in CHAIN))
    if lowered not in names:
        raise ValueError(f"unknown kvcompress ops backend {name!r}; choose one of {', '.join(names)}")
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
    """Force a backend (``auto`` or a name of :data:`CHAIN`) inside a ``with`` block
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


# -- selection ------------------------------------------------------------------------------


def _availability_op(op: str) -> str:
    """The op a backend's availability is asked for (the slot decode: ``paged_attention``)."""
    return "paged_attention" if op in ATTENTION_OPS else op


def _unavailable_reason(backend: KernelBackend, device: torch.device, op: str) -> str | None:
    return backend.unavailable_reason(device, _availability_op(op))


def _check_selectable(op: str) -> None:
    if op not in SELECTABLE_OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(SELECTABLE_OPS)}")


def available_backends(device: torch.device | str, op: str = "paged_attention") -> list[str]:
    """Backends that can run ``op`` (``paged_attention``, ``move_cache`` or
    ``fill_page_tables``) on ``device``, in preference order (the interpreter counts
    only when ``TRITON_INTERPRET=1``)."""
    device = torch.device(device)
    _check_selectable(op)
    return [backend.name for backend in CHAIN if _unavailable_reason(backend, device, op) is None]


def _auto(device: torch.device, op: str) -> KernelBackend:
    for backend in CHAIN:
        if op in backend.ops and backend.chosen_by_auto(device, op) and _unavailable_reason(backend, device, op) is None:
            return backend
    raise RuntimeError(f"no kvcompress ops backend runs {op} on {device} (the chain lacks the reference)")


def _forced(backend: KernelBackend, device: torch.device, op: str) -> KernelBackend:
    """``backend`` when it can run ``op`` on ``device``, else the error naming why."""
    reason = _unavailable_reason(backend, device, op)
    if reason is not None:
        source = "use_backend()" if getattr(_local, "stack", None) else f"{ENV_VAR}={os.environ.get(ENV_VAR)}"
        raise BackendUnavailableError(
            f"kvcompress ops backend {backend.name!r} was forced ({source}) but cannot run "
            f"{_availability_op(op)}: {reason}"
        )
    return backend


def _first_fallback(
    backend: KernelBackend, device: torch.device, op: str, windowed: bool = False, meta_rows: bool = False,
) -> KernelBackend:
    """The first of ``backend``'s fallbacks that implements ``op`` (and, ``windowed``,
    sliding windows; ``meta_rows``, pools with metadata rows) and can run it on
    ``device``; the reference when none does."""
    for name in backend.fallbacks:
        fallback = backend_named(name)
        if (windowed and not fallback.sliding_window) or (meta_rows and not fallback.meta_rows):
            continue
        if op in fallback.ops and _unavailable_reason(fallback, device, op) is None:
            return fallback
    return backend_reference.BACKEND


def selected_backend(device: torch.device | str, op: str = "paged_attention") -> str:
    """Which backend runs ``op`` on tensors of ``device`` under the current setting
    (``auto``: the first of the chain chosen by auto and available; a forced backend
    is returned as is when it can run, else :class:`BackendUnavailableError` is raised).
    For ``paged_attention`` this is the backend of the calls it supports (with ``cuda``,
    batches with prefill rows or shapes without a CUDA kernel (:func:`cuda_decode_supports`)
    run on Triton when available, else on the reference)."""
    device = torch.device(device)
    _check_selectable(op)
    wanted = requested_backend()
    if wanted == "auto":
        return _auto(device, op).name
    return _forced(backend_named(wanted), device, op).name


def _resolve(device: torch.device, op: str) -> KernelBackend:
    """The backend that runs ``op`` on ``device`` under the current setting (the table
    of the module docstring)."""
    wanted = requested_backend()
    if wanted == "auto":
        return _auto(device, op)
    backend = backend_named(wanted)
    if op in backend.ops:
        return _forced(backend, device, op)
    if op in POOL_OPS:
        return backend_reference.BACKEND  # an attention-only backend leaves them to the reference
    return _first_fallback(_forced(backend, device, op), device, op)


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
        backends[op] = _resolve(device, op).name
    return KernelOps(device, backends)


# -- running them ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class KernelOps:
    """The ops bound to backends resolved once for one device (:func:`resolve_ops`).

    Attributes:
        device: the device the backends were chosen for.
        backends: op name -> backend name (see the table of :mod:`kvcompress.ops.dispatch`;
            an attention call the backend does not support runs on its first available
            fallback).
    """

    device: torch.device
    backends: dict[str, str]

    def __str__(self) -> str:
        return ", ".join(f"{op}={backend}" for op, backend in self.backends.items())

    def backend(self, op: str) -> KernelBackend:
        """The backend object resolved for ``op``."""
        if op not in self.backends:
            raise RuntimeError(f"{op} was not resolved for these ops (resolved: {self})")
        return backend_named(self.backends[op])

    def _backend_for_call(
        self, op: str, query: torch.Tensor, pool: KVPool, batch, out: torch.Tensor | None,
    ) -> KernelBackend:
        """The resolved backend of attention op ``op`` when it supports this call, else
        the first of its fallbacks available on the query's device (for a batch with a
        sliding window, the first that applies it)."""
        backend = self.backend(op)
        windowed = getattr(batch, "sliding_window", None) is not None
        rows = pool.page_meta_row is not None
        if (windowed and not backend.sliding_window) or (rows and not backend.meta_rows):
            return _first_fallback(backend, query.device, op, windowed=windowed, meta_rows=rows)
        if backend.supports(query, pool, batch, out):
            return backend
        return _first_fallback(backend, query.device, op, meta_rows=rows)

    @property
    def kernel_page_layout(self) -> bool:
        """Whether the attention reads pages in vLLM's CPU kernel layout (K ``[D, b]``
        inside a page): the engine then builds its pool with
        :func:`kvcompress.ops.cpu_attention.pool_views`."""
        return "paged_attention" in self.backends and self.backend("paged_attention").kernel_page_layout

    @property
    def decode_by_slot_capturable(self) -> bool:
        """Whether ``paged_decode_by_slot`` runs a graph-capturable kernel (Triton on CUDA;
        the reference reads lengths on the host)."""
        return (
            self.device.type == "cuda"
            and "paged_decode_by_slot" in self.backends
            and self.backend("paged_decode_by_slot").capturable_decode
        )

    def paged_attention(
        self, query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
        out: torch.Tensor | None = None, metrics: MetricSink | None = None, *,
        max_query_chunk: int = 512, partition_size: int = 512,
    ) -> torch.Tensor:
        """Attention of one layer over per-head paged KVs; arguments and result as
        :func:`kvcompress.ops.reference_attention.reference_paged_attention`. ``partition_size``: keys
        per decode partition (CUDA and Triton; a multiple of the block size)."""
        backend = self._backend_for_call("paged_attention", query, pool, batch, out)
        return backend.paged_attention(
            query, pool, batch, scale, out, metrics, max_query_chunk=max_query_chunk, partition_size=partition_size,
        )

    def paged_decode_by_slot(
        self, query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
        out: torch.Tensor | None = None, metrics: MetricSink | None = None, *,
        partition_size: int = 512,
    ) -> torch.Tensor:
        """Slot-indexed decode attention; arguments as
        :func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference`."""
        backend = self._backend_for_call("paged_decode_by_slot", query, pool, batch, out)
        return backend.decode_by_slot(query, pool, batch, scale, out, metrics, partition_size=partition_size)

    def decode_planned(
        self, query: torch.Tensor, pool: KVPool, tables, scale: float, out: torch.Tensor,
        metric_power: int | None = None, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Decode rows of one layer with the tables planned for this step (backends with a
        per-step plan: ``vllm_cpu``, :func:`kvcompress.ops.cpu_attention.plan_decode_step`,
        built only when ``paged_attention`` resolved to it and the pool suits it), writing
        the rows' new ``key`` / ``value`` at the plan's slots first when given."""
        backend = self.backend("paged_decode_by_slot") if "paged_decode_by_slot" in self.backends else None
        if backend is None or not backend.plans_decode_steps:
            raise RuntimeError(f"decode_planned needs the vllm_cpu backend (resolved: {self})")
        return backend.decode_planned(query, pool, tables, scale, out, metric_power, key, value, sliding_window)

    def write_kv(
        self, pool: KVPool, key: torch.Tensor, value: torch.Tensor,
        write_pages: torch.Tensor, write_offsets: torch.Tensor,
    ) -> None:
        """Store new KVs in their pages, by the attention's backend (its page layout);
        arguments as :func:`kvcompress.ops.reference_attention.reference_write_kv` (``key`` / ``value``
        ``[T, H, D]``, targets ``[T, H]``)."""
        backend = self.backend("paged_attention") if "paged_attention" in self.backends else backend_reference.BACKEND
        backend.write_kv(pool, key, value, write_pages, write_offsets)

    def move_cache(
        self, pool: KVPool, src_pages: torch.Tensor, src_offsets: torch.Tensor,
        dst_pages: torch.Tensor, dst_offsets: torch.Tensor,
    ) -> None:
        """MoveCache; arguments as :func:`kvcompress.ops.move_cache.move_cache`."""
        backend = self.backend("move_cache")
        if src_pages.numel() == 0:
            return
        if pool.page_meta_row is not None and not backend.meta_rows:
            backend = backend_reference.BACKEND
        backend.move_cache(pool, src_pages, src_offsets, dst_pages, dst_offsets)

    def fill_page_tables(
        self, page_tables: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
        first_column: torch.Tensor, rows: torch.Tensor,
    ) -> None:
        """The allocator's page-table fill; arguments as
        :func:`kvcompress.ops.page_tables.fill_page_tables`."""
        self.backend("fill_page_tables").fill_page_tables(page_tables, pages, offsets, first_column, rows)


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
