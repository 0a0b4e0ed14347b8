"""``make test`` runs pytest-xdist workers: each worker's engines get a core of their own."""

from __future__ import annotations

import os

from conftest import xdist_worker_core


def test_workers_get_distinct_cores_round_robin():
    cores = [0, 1]
    assert [xdist_worker_core(f"gw{n}", 2, cores) for n in range(2)] == ["0", "1"]
    assert [xdist_worker_core(f"gw{n}", 4, cores) for n in range(4)] == ["0", "1", "0", "1"]
    assert xdist_worker_core("gw2", 3, [4, 6, 9]) == "9"


def test_workers_share_many_cores_as_tp_ranks_do():
    cores = list(range(16))
    assert [xdist_worker_core(f"gw{n}", 4, cores) for n in range(4)] == \
        ["0,1,2,3", "4,5,6,7", "8,9,10,11", "12,13,14,15"]


def test_no_binding_outside_xdist():
    assert xdist_worker_core(None, 1, [0, 1]) is None
    assert xdist_worker_core("master", 1, [0, 1]) is None


def test_this_worker_is_bound_when_run_under_xdist():
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        assert xdist_worker_core(worker, 1, sorted(os.sched_getaffinity(0))) is None
    else:
        bound = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        assert bound.split("|")[0] != ""
        # conftest pins the worker to the cores its engines bind to (unless the user set a binding)
        import conftest

        if conftest.XDIST_PINNED is not None:
            assert os.sched_getaffinity(0) == conftest.XDIST_PINNED == {int(cpu) for cpu in bound.split(",")}
