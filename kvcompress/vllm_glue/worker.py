"""Worker classes that run the per-(layer, KV head) model runner.

Selected through vLLM's public ``--worker-cls`` when kvcompress is enabled.
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker as cpu_worker_module
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from kvcompress.patches.attention_registry import per_head_attention_backend
from kvcompress.patches.cpu_sampling import CPUSeededChunkRewind
from kvcompress.patches.shutdown import WorkerProcessGuard
from kvcompress.patches.util import swapped_attribute
from kvcompress.vllm_glue.memory import KVCompressWorkerMemory
from kvcompress.vllm_glue.runner import KVCompressRunnerMixin
from kvcompress.vllm_glue.worker_rpcs import KVCompressWorkerRPCs


class KVCompressCPUModelRunner(CPUSeededChunkRewind, KVCompressRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner over the per-(layer, KV head) page pool (with the fix
    for seeded sampling under chunked prefill, ``patches/cpu_sampling.py``)."""


class KVCompressCPUWorker(WorkerProcessGuard, KVCompressWorkerRPCs, KVCompressWorkerMemory, CPUWorker):
    """vLLM's worker building the per-head runner; bounded exit (patches/shutdown.py);
    the per-head metadata inside the KV memory (``memory.py``)."""

    def init_device(self) -> None:
        if self.vllm_config.use_v2_model_runner:
            raise ValueError(
                "--kv-compress needs vLLM's V1 model runner; unset "
                "VLLM_USE_V2_MODEL_RUNNER=1"
            )
        # CPUWorker.init_device builds the runner by its module-level name.
        with swapped_attribute(cpu_worker_module, "CPUModelRunner", KVCompressCPUModelRunner):
            super().init_device()

    def load_model(self, *args, **kwargs) -> None:
        # Attention layers pick their backend while the model is built.
        with per_head_attention_backend():
            super().load_model(*args, **kwargs)

    def kvc_process_info(self) -> dict[str, object]:
        """Where this worker runs: pid, the cores it may use, torch's thread count, and
        the Ray actor id when it is a Ray worker (None under the mp executor)."""
        import os

        import torch

        actor_id = None
        try:
            import ray

            if ray.is_initialized():
                actor_id = ray.get_runtime_context().get_actor_id()
        except ImportError:
            pass
        return {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
                "threads": torch.get_num_threads(), "ray_actor_id": actor_id}
