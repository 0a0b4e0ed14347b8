"""Turn kvcompress settings into vLLM engine settings, and refuse what cannot work.

Runs in the front-end process before any engine starts (from the patched
``EngineArgs.create_engine_config``: ``prepare_engine_args`` before vLLM builds the
engine config, ``check_model_supported`` after), so bad flags and unsupported models
fail at startup with a message that names the flag.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from kvcompress.config import (
    ADDITIONAL_CONFIG_KEY,
    FLAGS,
    KVCompressConfig,
    KVCompressConfigError,
    SUPPORTED_BLOCK_SIZES,
)

SCHEDULER_CLS = "kvcompress.vllm_glue.scheduler.KVCompressScheduler"
CPU_WORKER_CLS = "kvcompress.vllm_glue.worker.KVCompressCPUWorker"
CUDA_WORKER_CLS = "kvcompress.vllm_glue.gpu_worker.KVCompressGPUWorker"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def settings_from_engine_args(engine_args: Any) -> KVCompressConfig:
    section = (engine_args.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if isinstance(section, dict) and "enabled" not in section and section:
        # Any --kv-compress-* flag turns the per-head cache on.
        section = {**section, "enabled": True}
    return KVCompressConfig.from_dict(section if isinstance(section, dict) else None)


def _backend_name(value: Any) -> str | None:
    """An attention-backend setting as an upper-case enum name (None: automatic)."""
    if value is None:
        return None
    name = getattr(value, "name", None) or str(value)
    return None if name.lower() == "auto" else name.upper()


def select_cuda_attention_backend(engine_args: Any) -> None:
    """Point the engine at vLLM's ``CUSTOM`` attention backend (the per-head one,
    registered by the plugin on CUDA); refuse any other explicit choice."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    flag = FLAGS["enabled"]
    config = engine_args.attention_config
    from_config = _backend_name(
        config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    )
    from_flag = _backend_name(engine_args.attention_backend)
    for source, chosen in (("--attention-backend", from_flag), ("--attention-config.backend", from_config)):
        if chosen not in (None, "CUSTOM"):
            raise KVCompressConfigError(
                f"{source} {chosen} cannot be combined with {flag}: kvcompress attends over "
                "its per-(layer, KV head) pages with its own backend (leave the backend unset)"
            )
    if from_config is None:
        engine_args.attention_backend = AttentionBackendEnum.CUSTOM


def require_v1_model_runner() -> None:
    """kvcompress extends vLLM's V1 GPU model runner, which CUDA builds with Triton
    replace by the V2 runner unless told otherwise."""
    value = os.environ.get(V2_RUNNER_ENV)
    if value is not None and value.strip().lower() in ("1", "true", "yes", "on"):
        raise KVCompressConfigError(
            f"{FLAGS['enabled']} needs vLLM's V1 model runner; unset {V2_RUNNER_ENV}={value}"
        )
    os.environ[V2_RUNNER_ENV] = "0"  # inherited by the worker processes


EXTENSION_MODULE = "kvcompress._C"
# Written by setup.py (``record_build``): whether it built the extension, and why not.
BUILD_RECORD_MODULE = "kvcompress._build_record"
NO_BUILD_RECORD = (
    "setup.py left no build record (kvcompress was not installed with pip); build it with "
    "KVCOMPRESS_BUILD_CUDA=1 pip install -e . --no-build-isolation"
)
# Messages this process has logged (vLLM may build an engine's config more than once).
_notices_logged: set[str] = set()


def extension_installed() -> bool:
    """Whether ``kvcompress._C`` is installed (found, not loaded: the engine's kernel
    dispatch loads it, and logs why when that fails)."""
    return importlib.util.find_spec(EXTENSION_MODULE) is not None


def extension_notice() -> tuple[int, str] | None:
    """``(log level, message)`` when ``kvcompress._C`` is not installed, with the reason
    setup.py recorded (pip shows its output only when a build fails); a warning unless
    ``KVCOMPRESS_NO_CUDA=1`` turned it off on purpose. None when it is installed."""
    if extension_installed():
        return None
    try:
        reason = importlib.import_module(BUILD_RECORD_MODULE).REASON or "unknown"
    except ImportError:
        reason = NO_BUILD_RECORD
    level = logging.INFO if reason == "KVCOMPRESS_NO_CUDA=1" else logging.WARNING
    return level, f"{EXTENSION_MODULE} not built: CUDA engines use the Triton kernels; reason: {reason}"


def log_extension_notice() -> None:
    """Log :func:`extension_notice` once per process."""
    notice = extension_notice()
    if notice is None or notice[1] in _notices_logged:
        return
    _notices_logged.add(notice[1])
    from vllm.logger import init_logger

    init_logger(f"vllm.{__name__}").log(*notice)


def worker_cls_for_platform(engine_args: Any, platform: Any) -> str:
    """The kvcompress worker class for vLLM's platform; sets what CUDA needs."""
    if platform.is_cpu():
        return CPU_WORKER_CLS
    if platform.is_cuda():
        select_cuda_attention_backend(engine_args)
        require_v1_model_runner()
        log_extension_notice()
        return CUDA_WORKER_CLS
    raise KVCompressConfigError(
        f"{FLAGS['enabled']} runs on vLLM's CPU and CUDA platforms; this is "
        f"{getattr(platform, 'device_name', None) or type(platform).__name__}"
    )


def refuse_micro_batching(engine_args: Any) -> None:
    """Dual-batch overlap and micro-batching (vLLM's ``ParallelConfig.use_ubatching``)
    build attention metadata per sub-batch of a step, while the runner plans the step
    as one batch: the first split step would stop in the metadata builder."""
    flag = FLAGS["enabled"]
    if engine_args.enable_dbo:
        raise KVCompressConfigError(
            f"--enable-dbo cannot be combined with {flag}: the per-head step plan covers the "
            "whole batch, not vLLM's micro-batches"
        )
    if (engine_args.ubatch_size or 0) > 1:
        raise KVCompressConfigError(
            f"--ubatch-size {engine_args.ubatch_size} cannot be combined with {flag}: the "
            "per-head step plan covers the whole batch, not vLLM's micro-batches (leave it at 0 or 1)"
        )


def default_block_size(platform: Any) -> int:
    """Tokens per page when ``--kv-compress-block-size`` is not given: 64 on CPU, where
    vLLM's attention kernel reads 64-token pages within 0.97-1.14x of stock's time even
    scattered over the pool, and faster than stock in the ascending runs the allocator
    hands out (its work per page is fixed: smaller pages cost more when scattered;
    ``benchmarks/results/kernel-page-size-cpu.md``), else 16 (the paper's; finer pages
    free memory sooner under compression)."""
    return 64 if platform.is_cpu() else 16


def prepare_engine_args(engine_args: Any, platform: Any = None) -> KVCompressConfig:
    """Validate the kvcompress section and set the engine fields it implies.

    ``platform``: vLLM's platform object (default ``current_platform``).
    Idempotent: a second call on the same arguments changes nothing.
    """
    settings = settings_from_engine_args(engine_args)
    if not settings.enabled:
        return settings
    if platform is None:
        from vllm.platforms import current_platform as platform

    if settings.block_size is None:
        # vLLM's --block-size alone sets the page size (checked below like any value).
        chosen = engine_args.block_size or default_block_size(platform)
        if chosen not in SUPPORTED_BLOCK_SIZES:
            raise KVCompressConfigError(
                f"--block-size {chosen} is not a page size kvcompress supports "
                f"({', '.join(map(str, SUPPORTED_BLOCK_SIZES))}; {FLAGS['block_size']} sets it)"
            )
        settings = settings.model_copy(update={"block_size": chosen})
    flag = FLAGS["enabled"]
    # Prefix caching only when asked for (stock vLLM's default is on): cached blocks
    # are kept uncompressed, which a plain compression server does not want by default.
    prefix_caching = bool(engine_args.enable_prefix_caching)
    if settings.shared_prefix_tokens and not prefix_caching:
        raise KVCompressConfigError(
            f"{FLAGS['shared_prefix_tokens']} {settings.shared_prefix_tokens} needs "
            "--enable-prefix-caching (it says how much of a prompt to cache)"
        )
    if engine_args.speculative_config:
        raise KVCompressConfigError(f"speculative decoding cannot be combined with {flag}")
    if engine_args.pipeline_parallel_size > 1:
        raise KVCompressConfigError(f"pipeline parallelism cannot be combined with {flag}")
    refuse_micro_batching(engine_args)
    if engine_args.async_scheduling:
        # vLLM 0.32 turns it on by default on CUDA; kvcompress turns it off (below).
        raise KVCompressConfigError(
            f"--async-scheduling cannot be combined with {flag}: the scheduler needs each "
            "step's compression report (pages freed per head) before it schedules the next"
        )
    if engine_args.tensor_parallel_size * engine_args.data_parallel_size > 1 and platform.is_cpu():
        bind_cpu_workers(engine_args.tensor_parallel_size, engine_args.data_parallel_size,
                         nnodes=getattr(engine_args, "nnodes", 1) or 1)
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
    worker_cls = worker_cls_for_platform(engine_args, platform)
    if engine_args.worker_cls not in ("auto", worker_cls):
        raise KVCompressConfigError(
            f"--worker-cls {engine_args.worker_cls} cannot be combined with {flag}"
        )
    engine_args.enable_prefix_caching = prefix_caching
    engine_args.block_size = settings.block_size
    engine_args.scheduler_cls = SCHEDULER_CLS
    engine_args.worker_cls = worker_cls
    engine_args.async_scheduling = False
    # Validated here, once: the engine core and the workers load the section without
    # validating again (its digest, KVCompressConfig.from_additional_config).
    additional = dict(engine_args.additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = settings.to_additional_config()
    engine_args.additional_config = additional
    return settings


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_worker_binding(num_workers: int, cpus: list[int], numa_nodes: int, what: str) -> str | None:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``num_workers`` CPU workers
    (TP ranks of every DP engine, DP-rank-major as vLLM slices the list) its own
    contiguous share of ``cpus`` ("0|1" on 2 CPUs), or None where vLLM's automatic
    binding works (a NUMA node per worker); with fewer nodes it refuses to start.
    ``what``: the flags that asked for the workers (for the error)."""
    if numa_nodes >= num_workers:
        return None
    if len(cpus) < num_workers:
        raise KVCompressConfigError(
            f"{what} on CPU needs a core per worker ({num_workers}); this process may use "
            f"{len(cpus)} ({BIND_ENV} assigns them)"
        )
    share = len(cpus) // num_workers
    groups = [sorted(cpus)[rank * share:(rank + 1) * share] for rank in range(num_workers)]
    return "|".join(",".join(map(str, group)) for group in groups)


def _numa_nodes() -> int:
    try:
        return len([n for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit() and n.startswith("node")])
    except OSError:
        return 1


def bind_cpu_workers(tensor_parallel_size: int, data_parallel_size: int = 1, nnodes: int = 1) -> None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for TP / DP workers on CPU when the user left it
    to vLLM's automatic binding and that binding cannot start (fewer NUMA nodes than
    this node's workers, ``--nnodes`` splitting them evenly). A user's own value is
    left alone."""
    if os.environ.get(BIND_ENV, "auto") != "auto":
        return
    local_workers = tensor_parallel_size * data_parallel_size // max(1, nnodes)
    what = " ".join(
        f"--{name}-parallel-size {size}"
        for name, size in (("tensor", tensor_parallel_size), ("data", data_parallel_size)) if size > 1
    )
    binding = cpu_worker_binding(local_workers, sorted(os.sched_getaffinity(0)), _numa_nodes(), what)
    if binding is None:
        return
    os.environ[BIND_ENV] = binding
    from vllm.logger import init_logger

    init_logger(f"vllm.{__name__}").info(
        "kvcompress: %s=%s (one share of this process's cores per worker; vLLM's automatic "
        "binding needs a NUMA node per worker; set the variable to choose)", BIND_ENV, binding,
    )


def _sliding_window_problems(vllm_config: Any) -> list[str]:
    """Sliding-window layers where :func:`sliding_windows_allowed`. There vLLM's hybrid KV
    cache manager is turned off (as ``--disable-hybrid-kv-cache-manager``: it would put the
    windowed layers in a KV-cache group of their own), so every layer's KVs go to the
    per-head pool as full-attention allocation; a sliding-window layer gives back its pages
    behind the window and only the full-attention layers are compressed."""
    from kvcompress.vllm_glue.kv_layout import CUDA_SLIDING_WINDOW_ENV, sliding_windows_allowed

    if not sliding_windows_allowed():
        return ["sliding-window attention layers, which kvcompress runs on CPU only so far "
                "(its Triton kernels apply the window but have not run such a model on a GPU "
                f"yet; {CUDA_SLIDING_WINDOW_ENV}=1 tries it)"]
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
    return []


# Measured (tests/test_flags.py): vLLM 0.32 lays out a recurrent layer's state only through
# its hybrid KV cache manager; with the manager off, as the per-head pool needs it, vLLM's own
# unify_hybrid_kv_cache_specs refuses a model that mixes state and attention layers.
_RECURRENT_LAYERS = (
    "state-space / linear-attention layers{kinds}, whose recurrent state vLLM 0.32 keeps only in its "
    "hybrid KV cache manager, which kvcompress turns off (the per-head paged cache takes its place)"
)


def check_model_supported(vllm_config: Any, settings: KVCompressConfig) -> None:
    """Refuse models whose attention the per-head paged cache cannot hold."""
    if not settings.enabled:
        return
    from kvcompress.vllm_glue.attention_backend import supported_head_sizes

    model_config = vllm_config.model_config
    flag = FLAGS["enabled"]
    name = ", ".join(model_config.architectures or [model_config.model])
    problems = []
    if model_config.use_mla:
        problems.append("multi-head latent attention (MLA)")
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or []
    other_kinds = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if model_config.is_hybrid or model_config.is_attention_free:
        problems.append(_RECURRENT_LAYERS.format(kinds=f" ({', '.join(other_kinds)})" if other_kinds else ""))
    elif other_kinds:
        problems.append(f"layers that are neither full nor sliding-window attention ({', '.join(other_kinds)})")
    if model_config.get_sliding_window() is not None:
        problems += _sliding_window_problems(vllm_config)
    if model_config.is_encoder_decoder:
        problems.append("an encoder-decoder architecture")
    if model_config.is_multimodal_model:
        problems.append("multimodal inputs")
    if model_config.runner_type != "generate":
        problems.append(f"the '{model_config.runner_type}' runner")
    from kvcompress.vllm_glue.kv_layout import kv_cache_dtype_problem

    cache_dtype_problem = kv_cache_dtype_problem(vllm_config.cache_config.cache_dtype)
    if cache_dtype_problem:
        problems.append(cache_dtype_problem)
    if problems:
        raise KVCompressConfigError(
            f"{flag} does not support model {name}: it uses " + "; ".join(problems)
        )
    if settings.xkv_profile:
        from kvcompress.policies import load_layer_profile

        from kvcompress.vllm_glue.kv_layout import compressible_layers, model_layer_windows

        num_layers = model_config.get_num_layers(vllm_config.parallel_config)
        kind = "attention"
        if model_config.get_sliding_window() is not None:  # the profile splits over these only
            num_layers = len(compressible_layers(model_layer_windows(model_config, range(num_layers))))
            kind = "full-attention (compressible)"
        profile_layers = len(load_layer_profile(settings.xkv_profile))
        if profile_layers != num_layers:
            raise KVCompressConfigError(
                f"{FLAGS['xkv_profile']} {settings.xkv_profile} has {profile_layers} layer "
                f"shares but model {name} has {num_layers} {kind} layers (write the "
                "profile for this model with benchmarks/quality/xkv_profile.py)"
            )
    head_size = model_config.get_head_size()
    head_sizes = supported_head_sizes()
    if head_size not in head_sizes:
        raise KVCompressConfigError(
            f"{flag} does not support head size {head_size} of model {name} "
            f"(supported on this platform: {list(head_sizes)})"
        )
    from kvcompress.vllm_glue.tokenizer_checks import warn_if_pooling_unsafe

    warn_if_pooling_unsafe(model_config, settings)  # e.g. per-digit numbers, no word pooling
