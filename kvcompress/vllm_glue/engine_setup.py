"""Turn kvcompress settings into vLLM engine settings, and refuse what cannot work.

Runs in the front-end process before any engine starts (from the patched
``EngineArgs.create_engine_config``), so bad flags and unsupported models fail
at startup with a message that names the flag.
"""

from __future__ import annotations

from typing import Any

from kvcompress.config import (
    ADDITIONAL_CONFIG_KEY,
    FLAGS,
    KVCompressConfig,
    KVCompressConfigError,
)

SCHEDULER_CLS = "kvcompress.vllm_glue.scheduler.KVCompressScheduler"
CPU_WORKER_CLS = "kvcompress.vllm_glue.worker.KVCompressCPUWorker"


def settings_from_engine_args(engine_args: Any) -> KVCompressConfig:
    section = (engine_args.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if isinstance(section, dict) and "enabled" not in section and section:
        # Any --kv-compress-* flag turns the per-head cache on.
        section = {**section, "enabled": True}
    return KVCompressConfig.from_dict(section if isinstance(section, dict) else None)


def prepare_engine_args(engine_args: Any) -> KVCompressConfig:
    """Validate the kvcompress section and set the engine fields it implies.

    Idempotent: a second call on the same arguments changes nothing.
    """
    settings = settings_from_engine_args(engine_args)
    if not settings.enabled:
        return settings
    from vllm.platforms import current_platform

    flag = FLAGS["enabled"]
    if engine_args.enable_prefix_caching:
        raise KVCompressConfigError(
            f"--enable-prefix-caching cannot be combined with {flag}: compressed "
            "per-head pages are not addressable by token hashes (leave prefix caching off)"
        )
    if engine_args.speculative_config:
        raise KVCompressConfigError(f"speculative decoding cannot be combined with {flag}")
    if engine_args.pipeline_parallel_size > 1:
        raise KVCompressConfigError(f"pipeline parallelism cannot be combined with {flag}")
    if engine_args.block_size not in (None, settings.block_size):
        raise KVCompressConfigError(
            f"--block-size {engine_args.block_size} conflicts with "
            f"{FLAGS['block_size']} {settings.block_size}: pass only the latter"
        )
    if engine_args.scheduler_cls not in (None, SCHEDULER_CLS) and not (
        isinstance(engine_args.scheduler_cls, str)
        and engine_args.scheduler_cls.endswith("v1.core.sched.scheduler.Scheduler")
    ):
        raise KVCompressConfigError(
            f"--scheduler-cls {engine_args.scheduler_cls} cannot be combined with {flag}"
        )
    if current_platform.is_cpu():
        worker_cls = CPU_WORKER_CLS
    else:
        raise KVCompressConfigError(
            f"{flag} currently runs on vLLM's CPU platform only; the CUDA backend "
            f"(csrc/ kernels) is not wired into the engine yet (platform: "
            f"{current_platform.device_name})"
        )
    if engine_args.worker_cls not in ("auto", worker_cls):
        raise KVCompressConfigError(
            f"--worker-cls {engine_args.worker_cls} cannot be combined with {flag}"
        )
    engine_args.enable_prefix_caching = False
    engine_args.block_size = settings.block_size
    engine_args.scheduler_cls = SCHEDULER_CLS
    engine_args.worker_cls = worker_cls
    engine_args.async_scheduling = False
    additional = dict(engine_args.additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = settings.model_dump()
    engine_args.additional_config = additional
    return settings


def check_model_supported(vllm_config: Any, settings: KVCompressConfig) -> None:
    """Refuse models whose attention the per-head paged cache cannot hold."""
    if not settings.enabled:
        return
    from kvcompress.vllm_glue.attention_backend import SUPPORTED_HEAD_SIZES

    model_config = vllm_config.model_config
    flag = FLAGS["enabled"]
    name = ", ".join(model_config.architectures or [model_config.model])
    problems = []
    if model_config.use_mla:
        problems.append("multi-head latent attention (MLA)")
    if model_config.get_sliding_window() is not None:
        problems.append("sliding-window attention layers")
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        problems.append(f"non-full-attention layers ({sorted(set(layer_types))})")
    if model_config.is_hybrid or model_config.is_attention_free:
        problems.append("state-space / hybrid layers")
    if model_config.is_encoder_decoder:
        problems.append("an encoder-decoder architecture")
    if model_config.is_multimodal_model:
        problems.append("multimodal inputs")
    if model_config.runner_type != "generate":
        problems.append(f"the '{model_config.runner_type}' runner")
    if problems:
        raise KVCompressConfigError(
            f"{flag} does not support model {name}: it uses " + "; ".join(problems)
        )
    head_size = model_config.get_head_size()
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise KVCompressConfigError(
            f"{flag} does not support head size {head_size} of model {name} "
            f"(supported: {list(SUPPORTED_HEAD_SIZES)})"
        )
