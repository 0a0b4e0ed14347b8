"""Bad settings fail before any engine starts, with a message naming the flag."""

from __future__ import annotations

import json
import os

import pytest

from kvcompress.config import KVCompressConfig, KVCompressConfigError


@pytest.mark.parametrize(
    "values,flag",
    [
        ({"rate": 0.5}, "--kv-compress-rate"),
        ({"protected_window": -1}, "--kv-compress-protected-window"),
        ({"max_cache_tokens": 0}, "--kv-compress-max-cache-tokens"),
        ({"block_size": 24}, "--kv-compress-block-size"),
        ({"pool_kernel": 4}, "--kv-compress-pool-kernel"),
        ({"metric": "l3"}, "--kv-compress-metric"),
        ({"metric_queries": "all"}, "--kv-compress-metric-queries"),
        ({"block_cost": "mean"}, "--kv-compress-block-cost"),
        ({"interval": -1}, "--kv-compress-interval"),
        ({"observation_window": 0}, "--kv-compress-observation-window"),
        ({"max_kv_per_iteration": 0}, "--kv-compress-max-kv-per-iteration"),
        ({"sink_tokens": -2}, "--kv-compress-sink-tokens"),
        ({"min_cache_tokens": -1}, "--kv-compress-min-cache-tokens"),
    ],
)
def test_invalid_values_name_the_flag(values, flag):
    with pytest.raises(KVCompressConfigError, match=flag):
        KVCompressConfig.from_dict({"enabled": True, **values})


def test_valid_settings_and_defaults():
    settings = KVCompressConfig.from_dict({"enabled": True, "rate": 8})
    assert settings.compresses and settings.protected_window == 64
    assert settings.block_size is None  # chosen per platform when the engine is configured
    assert not KVCompressConfig.from_dict({"enabled": True}).compresses


def _engine_config(model: str, **kwargs):
    """Run vLLM's own config path (patched by the plugin) without starting an engine."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=512, **kwargs)
    return args.create_engine_config()


def _write_config(tmp_path, **overrides) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "torch_dtype": "float32",
    }
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _kvc(**section):
    return {"additional_config": {"kvcompress": {"enabled": True, **section}}}


def test_engine_config_selects_kvcompress_scheduler_and_worker(tmp_path):
    config = _engine_config(_write_config(tmp_path), **_kvc(rate=1))
    assert config.scheduler_config.scheduler_cls.endswith("KVCompressScheduler")
    assert config.parallel_config.worker_cls.endswith("KVCompressCPUWorker")
    assert config.cache_config.block_size == 64  # the CPU default page size
    assert config.cache_config.enable_prefix_caching is False


def test_page_size_defaults_per_platform_and_follows_a_lone_block_size(tmp_path):
    from kvcompress.vllm_glue.engine_setup import default_block_size

    class Cuda:
        def is_cpu(self):
            return False

    assert default_block_size(Cuda()) == 16
    config = _engine_config(_write_config(tmp_path), block_size=32, **_kvc(rate=1))
    assert config.cache_config.block_size == 32
    section = config.additional_config["kvcompress"]
    assert section["block_size"] == 32
    with pytest.raises(KVCompressConfigError, match="--block-size 8 .*--kv-compress-block-size"):
        _engine_config(_write_config(tmp_path), block_size=8, **_kvc(rate=1))


def test_stock_engine_config_is_untouched(tmp_path):
    config = _engine_config(_write_config(tmp_path))
    assert "kvcompress" not in str(config.scheduler_config.scheduler_cls)
    assert "kvcompress" not in config.parallel_config.worker_cls


def test_bad_rate_fails_in_engine_args(tmp_path):
    with pytest.raises(KVCompressConfigError, match="--kv-compress-rate"):
        _engine_config(_write_config(tmp_path), **_kvc(rate=0))


def test_prefix_caching_is_opt_in_with_compression(tmp_path):
    """Stock vLLM turns prefix caching on by default; with kvcompress it is on only when
    asked for, and the shared-prefix flag without it names both flags."""
    model = _write_config(tmp_path)
    assert _engine_config(model, **_kvc(rate=4)).cache_config.enable_prefix_caching is False
    config = _engine_config(model, enable_prefix_caching=True, **_kvc(rate=4))
    assert config.cache_config.enable_prefix_caching is True
    with pytest.raises(KVCompressConfigError, match="--kv-compress-shared-prefix-tokens 256 needs --enable-prefix-caching"):
        _engine_config(model, **_kvc(rate=4, shared_prefix_tokens=256))


def test_cpu_worker_binding_gives_each_worker_its_cores():
    """vLLM's automatic CPU binding wants a NUMA node per worker; with fewer nodes the
    cores are split in contiguous shares, one per worker; too few cores is an error."""
    from kvcompress.vllm_glue.engine_setup import cpu_worker_binding

    assert cpu_worker_binding(2, [0, 1], 1, "x") == "0|1"
    assert cpu_worker_binding(2, [3, 0, 2, 1, 4], 1, "x") == "0,1|2,3"
    assert cpu_worker_binding(4, list(range(8)), 2, "x") == "0,1|2,3|4,5|6,7"
    assert cpu_worker_binding(2, list(range(8)), 2, "x") is None  # vLLM's own binding works
    with pytest.raises(KVCompressConfigError, match="--tensor-parallel-size 4 on CPU needs a core per worker"):
        cpu_worker_binding(4, [0, 1], 1, "--tensor-parallel-size 4")


def test_worker_binding_is_set_only_when_left_to_vllm(monkeypatch):
    from kvcompress.vllm_glue import engine_setup

    monkeypatch.setattr(engine_setup.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(engine_setup, "_numa_nodes", lambda: 1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    engine_setup.bind_cpu_workers(2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # the user's choice stands
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    engine_setup.bind_cpu_workers(2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    engine_setup.bind_cpu_workers(2, data_parallel_size=2)  # DP-rank-major, as vLLM slices it
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|2|3"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    engine_setup.bind_cpu_workers(2, nnodes=2)  # one worker on this node: vLLM's own binding
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    with pytest.raises(KVCompressConfigError, match="--tensor-parallel-size 4 --data-parallel-size 2"):
        engine_setup.bind_cpu_workers(4, data_parallel_size=2)


def test_async_scheduling_asked_for_is_refused_and_otherwise_turned_off(tmp_path):
    """vLLM 0.32 schedules asynchronously by default on CUDA; kvcompress needs each
    step's report before the next is scheduled: it turns that off unless it was asked
    for, and then refuses, naming both flags."""
    model = _write_config(tmp_path)
    assert _engine_config(model, **_kvc(rate=4)).scheduler_config.async_scheduling is False
    with pytest.raises(KVCompressConfigError, match="--async-scheduling cannot be combined with --kv-compress"):
        _engine_config(model, async_scheduling=True, **_kvc(rate=4))
    _engine_config(model, async_scheduling=True)  # stock vLLM takes the flag (its CPU platform then drops it)


def test_conflicting_block_size_is_refused(tmp_path):
    with pytest.raises(KVCompressConfigError, match="--kv-compress-block-size"):
        _engine_config(_write_config(tmp_path), block_size=32, **_kvc(block_size=16))


def test_unsupported_head_size_is_refused(tmp_path):
    model = _write_config(tmp_path, head_dim=48, hidden_size=192)
    with pytest.raises(KVCompressConfigError, match=r"head size 48 .*supported on this platform: \[32, 64, 80"):
        _engine_config(model, **_kvc())


def test_head_size_of_vllms_cpu_kernel_is_taken(tmp_path):
    model = _write_config(tmp_path, head_dim=80, hidden_size=320)
    config = _engine_config(model, **_kvc())
    assert config.model_config.get_head_size() == 80


def test_sliding_window_model_runs_on_cpu_and_is_refused_on_other_platforms(tmp_path, monkeypatch):
    """Issue 60: on CPU a sliding-window model is taken (every layer allocated as full
    attention: vLLM's hybrid KV cache manager off); where the kernels apply no window
    (CUDA so far) it is refused before any work starts, naming the feature, the platform
    limit and the flag."""
    from vllm.platforms import current_platform

    from kvcompress.config import KVCompressConfig
    from kvcompress.vllm_glue.engine_setup import check_model_supported

    model = _write_config(
        tmp_path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128
    )
    config = _engine_config(model, **_kvc())
    assert config.model_config.get_sliding_window() == 128
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True
    # An XKV profile splits over the compressible (full-attention) layers: here none.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps([1, 1]))
    with pytest.raises(KVCompressConfigError, match=r"has 2 layer shares but model MistralForCausalLM has 0 "
                                                    r"full-attention \(compressible\) layers"):
        _engine_config(model, **_kvc(policy="xkv", xkv_profile=str(profile)))
    settings = KVCompressConfig.from_additional_config(config.additional_config)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(KVCompressConfigError,
                       match=r"--kv-compress does not support model MistralForCausalLM: it uses sliding-window "
                             r"attention layers, which kvcompress runs on CPU only so far .*"
                             r"KVCOMPRESS_CUDA_SLIDING_WINDOW=1 tries it"):
        check_model_supported(config, settings)
    # The opt-in (the GPU kit's windows case): taken, the hybrid manager turned off.
    monkeypatch.setenv("KVCOMPRESS_CUDA_SLIDING_WINDOW", "1")
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    check_model_supported(config, settings)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True


def test_cli_flags_reach_the_engine_config(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    model = _write_config(tmp_path)
    args = parser.parse_args(
        ["--model", model, "--skip-tokenizer-init", "--max-model-len", "512",
         "--kv-compress-rate", "8", "--kv-compress-protected-window", "32"]
    )
    engine_args = AsyncEngineArgs.from_cli_args(args)
    section = engine_args.additional_config["kvcompress"]
    assert section == {"rate": 8.0, "protected_window": 32}
    # Also in the parsed arguments, as --additional-config: the extra API servers of
    # --api-server-count N build their engine arguments from them before the plugin
    # patches from_cli_args there (without it they refused every vllm_xargs field).
    assert args.additional_config["kvcompress"] == section
    config = engine_args.create_engine_config()
    assert config.additional_config["kvcompress"]["enabled"] is True
    assert config.additional_config["kvcompress"]["rate"] == 8.0

    every = parser.parse_args(
        ["--model", model, "--skip-tokenizer-init", "--max-model-len", "512",
         "--kv-compress-metric", "l1", "--kv-compress-metric-queries", "full",
         "--kv-compress-block-cost", "sum", "--kv-compress-interval", "32",
         "--kv-compress-sink-tokens", "4", "--kv-compress-pool-kernel", "5",
         "--kv-compress-max-kv-per-iteration", "100000", "--kv-compress-min-cache-tokens", "64",
         "--kv-compress-observation-window", "16", "--kv-compress-full-skip-nearest", "4",
         "--no-kv-compress-pool-words"]
    )
    section = AsyncEngineArgs.from_cli_args(every).create_engine_config().additional_config["kvcompress"]
    assert {k: section[k] for k in ("metric", "metric_queries", "block_cost", "interval", "sink_tokens",
            "pool_kernel", "max_kv_per_iteration", "min_cache_tokens", "observation_window",
            "full_skip_nearest", "pool_words")} == {
        "metric": "l1", "metric_queries": "full", "block_cost": "sum", "interval": 32, "sink_tokens": 4,
        "pool_kernel": 5, "max_kv_per_iteration": 100000, "min_cache_tokens": 64,
        "observation_window": 16, "full_skip_nearest": 4, "pool_words": False,
    }
    words = parser.parse_args(["--model", model, "--skip-tokenizer-init", "--kv-compress-pool-words"])
    section = AsyncEngineArgs.from_cli_args(words).create_engine_config().additional_config["kvcompress"]
    assert section["pool_words"] is True and section["enabled"] is True
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        parser.parse_args(["--model", model, "--kv-compress-metric", "l3"])

    bad = parser.parse_args(["--model", model, "--skip-tokenizer-init", "--kv-compress-rate", "0.5"])
    with pytest.raises(KVCompressConfigError, match="--kv-compress-rate"):
        AsyncEngineArgs.from_cli_args(bad).create_engine_config()


def test_mla_model_is_refused(tmp_path):
    model = _write_config(
        tmp_path, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
        num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
        moe_intermediate_size=256, n_shared_experts=1,
    )
    with pytest.raises(KVCompressConfigError, match="MLA"):
        _engine_config(model, **_kvc())


_LLAMA_TEXT = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
_MAMBA = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "state_size": 16, "expand": 2,
          "conv_kernel": 4}
_JAMBA = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "attn_layer_period": 2,
          "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 1,
          "num_experts_per_tok": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 16}
_QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
               "layer_types": ["linear_attention", "full_attention"], "full_attention_interval": 2,
               "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
               "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 2, "num_experts_per_tok": 1,
               "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1}
_BART = {"architectures": ["BartForConditionalGeneration"], "model_type": "bart", "d_model": 64, "encoder_layers": 1,
         "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 128,
         "decoder_ffn_dim": 128, "max_position_embeddings": 1024}
_WHISPER = {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "d_model": 64,
            "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
            "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_source_positions": 1500,
            "max_target_positions": 512, "num_mel_bins": 80}
_RECURRENT = r"state-space / linear-attention layers.*, whose recurrent state vLLM 0.32 keeps only in its hybrid KV cache"


@pytest.mark.parametrize(
    "overrides,engine_args,refusal",
    [
        (_MAMBA, {}, rf"MambaForCausalLM: it uses {_RECURRENT}"),
        (_JAMBA, {}, rf"JambaForCausalLM: it uses {_RECURRENT}"),
        (_QWEN3_NEXT, {}, r"Qwen3NextForCausalLM: it uses state-space / linear-attention layers \(linear_attention\), "),
        (_BART, {}, r"BartForConditionalGeneration: it uses an encoder-decoder architecture$"),
        (_WHISPER, {}, r"WhisperForConditionalGeneration: it uses an encoder-decoder architecture; multimodal"),
        (_LLAMA_TEXT, {"runner": "pooling"}, r"LlamaForCausalLM: it uses the 'pooling' runner"),
    ],
    ids=["mamba", "jamba", "qwen3-next", "bart", "whisper", "pooling"],
)
def test_models_kvcompress_cannot_page_are_refused_naming_the_feature(tmp_path, overrides, engine_args, refusal):
    """Issue 60: each remaining refusal names the model, the feature and the flag, while
    stock vLLM takes the same configuration (so the refusal is kvcompress's)."""
    model = _write_config(tmp_path, **overrides)
    stock = _engine_config(model, **engine_args)
    assert stock.additional_config.get("kvcompress", {}).get("enabled") is not True
    with pytest.raises(KVCompressConfigError, match=rf"^--kv-compress does not support model {refusal}"):
        _engine_config(model, **engine_args, **_kvc())


def test_vllm_needs_its_hybrid_manager_for_recurrent_state():
    """Why recurrent (state-space / linear-attention) layers are refused: kvcompress turns
    vLLM's hybrid KV cache manager off, and with it off vLLM 0.32 itself cannot lay out a
    cache that mixes recurrent state with attention KVs (``unify_hybrid_kv_cache_specs``,
    what vLLM calls when the manager is off) -- while sliding-window layers beside full
    attention it can (they are promoted to full attention: what kvcompress relies on)."""
    import torch
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    def attention(cls=FullAttentionSpec, **extra):
        return cls(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, **extra)

    state = MambaSpec(block_size=16, shapes=((4, 64), (2, 16, 16)), dtypes=(torch.float32, torch.float32))
    with pytest.raises(ValueError, match="Failed to promote local KV cache specs to one unified type"):
        unify_hybrid_kv_cache_specs({"layers.0.attn": attention(), "layers.1.mixer": state})
    windowed = {"layers.0.attn": attention(), "layers.1.attn": attention(SlidingWindowSpec, sliding_window=32)}
    unify_hybrid_kv_cache_specs(windowed)
    assert all(type(spec) is FullAttentionSpec for spec in windowed.values())


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_is_taken_and_other_cache_dtypes_refused_before_any_worker_starts(tmp_path, cache_dtype):
    """Issue 60: FP8 pages are taken (on CPU the reference reads them; on CUDA the Triton
    kernels, ``test_cuda_engine_setup``); any other cache dtype is refused, naming the
    flag and its value, before any worker starts."""
    from kvcompress.vllm_glue.engine_setup import check_model_supported

    model = _write_config(tmp_path)
    config = _engine_config(model, kv_cache_dtype=cache_dtype, **_kvc())
    assert config.cache_config.cache_dtype == cache_dtype
    settings = KVCompressConfig.from_additional_config(config.additional_config)
    check_model_supported(config, settings)
    with pytest.raises(KVCompressConfigError, match=r"--kv-compress does not support model LlamaForCausalLM: "
                                                    r"it uses --kv-cache-dtype bfloat16 \(kvcompress pages hold auto, fp8"):
        _engine_config(model, kv_cache_dtype="bfloat16", **_kvc())  # the engine config's own check


def test_fp8_pages_take_unit_scales_only():
    """A checkpoint's (or a calculated) K / V scale would have to travel with every op
    that reads the pages: refused at the layer's first call, naming both scales."""
    from types import SimpleNamespace

    import torch

    from kvcompress.vllm_glue.attention_backend import require_unit_kv_scales
    from kvcompress.vllm_glue.kv_layout import page_dtype

    assert page_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert page_dtype("fp8", torch.bfloat16) == page_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert page_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_inc"):
        page_dtype("fp8_inc", torch.bfloat16)
    unit = SimpleNamespace(layer_name="model.layers.0.self_attn.attn", _k_scale_float=1.0, _v_scale_float=1.0,
                           calculate_kv_scales=False)
    require_unit_kv_scales(unit, "fp8")
    scaled = SimpleNamespace(**{**vars(unit), "_k_scale_float": 0.5})
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 takes unit K / V scales only \(layer "
                                         r"model.layers.0.self_attn.attn has k_scale 0.5, v_scale 1\)"):
        require_unit_kv_scales(scaled, "fp8")
    calculated = SimpleNamespace(**{**vars(unit), "calculate_kv_scales": True})
    with pytest.raises(ValueError, match="--calculate-kv-scales"):
        require_unit_kv_scales(calculated, "fp8_e5m2")


def test_other_vllm_version_fails_loudly(monkeypatch):
    import vllm

    from kvcompress.patches import UnsupportedVLLMVersionError, check_vllm_version

    check_vllm_version()  # the pinned version passes
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(UnsupportedVLLMVersionError, match="pinned to vLLM 0.32.0"):
        check_vllm_version()


def test_policy_flags_reach_the_engine_config_and_help_lists_them(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvcompress.policies import POLICY_NAMES

    import subprocess
    import sys
    from pathlib import Path

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    vllm_cli = Path(sys.executable).parent / "vllm"
    shown = subprocess.run([str(vllm_cli), "serve", "--help=kvcompress"], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    help_text = " ".join(shown.stdout.split())
    for flag in ("--kv-compress-policy", "--kv-compress-pyramid-beta", "--kv-compress-ada-floor",
                 "--kv-compress-xkv-profile", "--kv-compress-pool ", "--kv-compress-pool-words",
                 "--no-kv-compress-pool-words"):
        assert flag in help_text
    assert "{" + ",".join(POLICY_NAMES) + "}" in help_text
    assert "(default: 20.0)" in help_text and "(default: 0.5)" in help_text
    assert "(default: None)" not in help_text
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps([1, 1]))
    model = _write_config(tmp_path)
    args = parser.parse_args(
        ["--model", model, "--skip-tokenizer-init", "--max-model-len", "512",
         "--kv-compress-rate", "4", "--kv-compress-policy", "xkv", "--kv-compress-pool", "max",
         "--kv-compress-pyramid-beta", "8", "--kv-compress-ada-floor", "0.25",
         "--kv-compress-xkv-profile", str(profile)]
    )
    section = AsyncEngineArgs.from_cli_args(args).create_engine_config().additional_config["kvcompress"]
    settings = KVCompressConfig.from_dict(section)
    assert (settings.policy, settings.pool, settings.pyramid_beta, settings.ada_floor) == ("xkv", "max", 8.0, 0.25)
    assert settings.policy_for().split.layer_profile == (0.5, 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", model, "--kv-compress-policy", "pyramidinfer"])
    # A profile written for another model is refused before the engine starts.
    profile.write_text(json.dumps({"layer_shares": [1, 2, 3]}))
    with pytest.raises(KVCompressConfigError, match="--kv-compress-xkv-profile .* has 3 layer shares .* 2 attention layers"):
        AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_flag_help_comes_from_setting_docs_and_the_policy_registry():
    """Help text = the setting's docstring in config.py plus what the policy registry
    knows (per-policy defaults, the policies a split knob affects), no source parsing."""
    from kvcompress.config import FLAGS, flag_help, setting_type
    from kvcompress.policies import POLICY_NAMES

    assert FLAGS["enabled"] == "--kv-compress" and FLAGS["max_kv_per_iteration"] == "--kv-compress-max-kv-per-iteration"
    assert list(FLAGS) == list(KVCompressConfig.model_fields)
    assert flag_help("rate") == "Target compression rate: keep ~1/rate of each sequence's KVs. (default: 1.0)"
    assert flag_help("max_cache_tokens").endswith("(default: none)")
    assert flag_help("pool").endswith("default: the policy's (max; avg for xkv).")
    assert "4 for surprisal, streamingllm" in flag_help("sink_tokens") and "(default" not in flag_help("sink_tokens")
    assert "(pyramidkv, ada-pyramidkv only)" in flag_help("pyramid_beta")
    assert "(xkv only)" in flag_help("xkv_profile")
    assert all(name in flag_help("policy") for name in POLICY_NAMES)
    assert setting_type("policy") == (str, list(POLICY_NAMES))
    assert setting_type("observation_window") == (int, None)
    assert setting_type("ada_floor") == (float, None)


def test_validated_section_is_loaded_without_validating_again(monkeypatch, tmp_path):
    """The front end validates once and stores the values with a digest; the engine
    core and the workers trust that section. A section edited or written by hand
    (no matching digest) is validated in full, naming the flag."""
    import pickle

    from kvcompress.config import VALIDATED_KEY

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps([1, 3]))
    settings = KVCompressConfig.from_dict(
        {"enabled": True, "rate": 8, "policy": "xkv", "xkv_profile": str(profile)}
    )
    section = pickle.loads(pickle.dumps(settings.to_additional_config()))  # as shipped to a process
    assert VALIDATED_KEY in section and KVCompressConfig.from_dict(section) == settings

    def validate_again(*args, **kwargs):
        raise AssertionError("validated again")

    with monkeypatch.context() as patch:
        patch.setattr(KVCompressConfig, "from_dict", classmethod(validate_again))
        loaded = KVCompressConfig.from_additional_config({"kvcompress": section})
    assert loaded == settings and loaded.policy_for() == settings.policy_for()
    assert loaded.policy_for().split.layer_profile == (0.25, 0.75)

    for hand_made in ({**section, "rate": 0.5}, {"enabled": True, "rate": 0.5}, {**section, VALIDATED_KEY: "x", "rate": 0.5}):
        with pytest.raises(KVCompressConfigError, match="--kv-compress-rate"):
            KVCompressConfig.from_additional_config({"kvcompress": hand_made})
    with pytest.raises(KVCompressConfigError, match="ratio: unknown setting"):
        KVCompressConfig.from_additional_config({"kvcompress": {**section, "ratio": 2}})


def test_engine_config_stores_the_validated_section(tmp_path):
    from kvcompress.config import VALIDATED_KEY

    config = _engine_config(_write_config(tmp_path), **_kvc(rate=4, policy="snapkv"))
    section = config.additional_config["kvcompress"]
    assert VALIDATED_KEY in section
    settings = KVCompressConfig.from_additional_config(config.additional_config)
    assert (settings.enabled, settings.rate, settings.policy) == (True, 4.0, "snapkv")
    assert settings == KVCompressConfig.from_dict(section)


def test_the_section_is_written_once_by_the_engine_setup(tmp_path):
    """``additional_config["kvcompress"]`` is written in one place while vLLM builds an
    engine config: the engine setup stores the validated section (with its digest), and
    the patched ``create_engine_config`` around it writes nothing more."""
    from vllm.engine.arg_utils import EngineArgs

    from kvcompress.config import VALIDATED_KEY

    writes = []

    class RecordingArgs(EngineArgs):
        def __setattr__(self, name, value):
            if name == "additional_config":
                writes.append(value)
            super().__setattr__(name, value)

    args = RecordingArgs(model=_write_config(tmp_path), skip_tokenizer_init=True, max_model_len=512, **_kvc(rate=4))
    writes.clear()
    config = args.create_engine_config()
    assert len(writes) == 1 and VALIDATED_KEY in writes[0]["kvcompress"]
    assert KVCompressConfig.from_additional_config(config.additional_config).rate == 4.0
