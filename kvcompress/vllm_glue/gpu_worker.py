"""CUDA worker and model runner over the per-(layer, KV head) page pool.

Selected through vLLM's public ``--worker-cls`` when kvcompress runs on vLLM's CUDA
platform (``engine_setup.prepare_engine_args``). The per-head work is the same
``KVCompressRunnerMixin`` as on CPU; what differs is where vLLM gets the attention
backend: on CUDA it honours the engine's ``attention_backend``, which kvcompress
sets to ``CUSTOM`` and registers as ``KVCompressAttentionBackend``
(``patches/attention_registry.register_cuda_backend``). That backend calls
``kvcompress.ops.dispatch``: the ``kvcompress._C`` decode kernel when built, Triton
for prefill / chunked-prefill batches, the PyTorch reference otherwise.

CUDA graphs: the backend declares ``UNIFORM_SINGLE_TOKEN_DECODE`` where the Triton
slot-indexed decode is capturable, so decode-only batches replay as full graphs over the
fixed-address ``DecodeBuffers`` (vLLM pads them to a captured size; padding rows read an
empty slot and write the scratch page), and mixed batches run piecewise graphs with
attention and compression eager on the step's plan. Warm-up runs take the decode path
over padding rows, so its kernels compile before capture; the kernels of steps with
prompt rows are compiled when the pool is built (``warm_up.py``), before vLLM arms its
JIT monitor.

Not yet run on a GPU (no GPU machine is lent to this project): this module is import-
and configuration-checked on CPU (``tests/test_cuda_engine_setup.py``,
``tests/test_cuda_path.py``).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from kvcompress.patches.shutdown import WorkerProcessGuard
from kvcompress.vllm_glue.memory import KVCompressWorkerMemory
from kvcompress.vllm_glue.runner import KVCompressRunnerMixin
from kvcompress.vllm_glue.worker_rpcs import KVCompressWorkerRPCs


class KVCompressGPUModelRunner(KVCompressRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU model runner over the per-(layer, KV head) page pool."""


class KVCompressGPUWorker(WorkerProcessGuard, KVCompressWorkerRPCs, KVCompressWorkerMemory, Worker):
    """vLLM's worker building the per-head runner; bounded exit (patches/shutdown.py);
    the per-head metadata inside the KV memory (``memory.py``)."""

    def _make_model_runner(self) -> KVCompressGPUModelRunner:
        if self.use_v2_model_runner:
            raise ValueError(
                "--kv-compress needs vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        return KVCompressGPUModelRunner(self.vllm_config, self.device)
