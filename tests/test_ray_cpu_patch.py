"""patches/ray_cpu.py without an engine: which executor vLLM's ``Executor.get_class``
gives each engine, the legacy executor refused by name, and the classes Ray ships to
other processes found again there by reference. The engine runs on Ray in
``test_tensor_parallel_engine.py`` (token-exact with stock at TP=2)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

# vLLM is imported inside the tests, never at collection: importing it imports triton,
# which test_triton_kernels must import first, under TRITON_INTERPRET=1.


def _config(kvcompress: bool, backend: str = "ray"):
    from kvcompress.config import KVCompressConfig

    additional = {"kvcompress": KVCompressConfig(enabled=True, rate=8).to_additional_config()} if kvcompress else {}
    return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend),
                           additional_config=additional)


@pytest.fixture(autouse=True)
def _patched():
    from kvcompress.vllm_glue.plugin import register

    register()  # the patches, as vLLM's plugin loader applies them


def test_a_kvcompress_engine_gets_the_cpu_ray_executor_and_stock_keeps_vllms():
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    from kvcompress.patches.ray_cpu import cpu_ray_executor_class

    executor = Executor.get_class(_config(kvcompress=True))
    assert executor is cpu_ray_executor_class() and issubclass(executor, RayExecutorV2)
    assert executor._get_actor_resource_kwargs() == {"num_gpus": 0}  # no custom "CPU" resource
    assert Executor.get_class(_config(kvcompress=False)) is RayExecutorV2  # stock: untouched
    assert Executor.get_class(_config(kvcompress=True, backend="mp")) is MultiprocExecutor


def test_the_compiled_dag_executor_is_refused_by_name(monkeypatch):
    from vllm.v1.executor.abstract import Executor

    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    with pytest.raises(ValueError, match="VLLM_USE_RAY_V2_EXECUTOR_BACKEND"):
        Executor.get_class(_config(kvcompress=True))


def test_ray_finds_the_classes_again_in_another_process():
    """Ray pickles actor and executor classes by reference (module + name): these
    must come back as the very same classes, not as copies by value."""
    from kvcompress.patches import ray_cpu

    for cls in (ray_cpu.cpu_ray_executor_class(), ray_cpu.cpu_ray_worker_class()):
        assert cls.__module__ == "kvcompress.patches.ray_cpu"
        data = pickle.dumps(cls)
        assert len(data) < 200  # a reference, not the class body
        assert pickle.loads(data) is cls


def test_a_cpu_ray_worker_reports_no_device_ids(monkeypatch):
    import ray

    from kvcompress.patches.ray_cpu import cpu_ray_worker_class

    context = SimpleNamespace(get_node_id=lambda: "node-a",
                              get_accelerator_ids=lambda: {"GPU": []})  # Ray has no "CPU" key
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    worker = cpu_ray_worker_class().__new__(cpu_ray_worker_class())
    assert worker.get_node_and_physical_gpu_ids() == ("node-a", [])
