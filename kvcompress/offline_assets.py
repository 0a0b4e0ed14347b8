"""Models and texts for tests and benchmarks, built locally and cached (no model hub).

Cached under ``$KVCOMPRESS_CACHE`` or ``~/.cache/kvcompress``; nothing here is committed.
CLI: ``python -m kvcompress.offline_assets tiny-llama``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    path = Path(os.environ.get("KVCOMPRESS_CACHE", Path.home() / ".cache" / "kvcompress"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def tiny_llama_checkpoint(
    num_layers: int = 4,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    hidden: int | None = None,
    vocab_size: int = 1024,
    seed: int = 0,
    max_position_embeddings: int = 8192,
    init_std: float = 0.08,
) -> Path:
    """A random-weight GQA ``LlamaForCausalLM`` (float32 safetensors, no tokenizer)."""
    hidden = hidden or num_q_heads * head_dim // 2
    key = f"tiny-llama-l{num_layers}-q{num_q_heads}-kv{num_kv_heads}-d{head_dim}-h{hidden}-v{vocab_size}-s{seed}-std{init_std}"
    target = cache_dir() / key
    if (target / "config.json").exists():
        return target
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, init_std)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging, safe_serialization=True)
    config_path = staging / "config.json"
    values = json.loads(config_path.read_text())
    values.setdefault("rope_theta", 10000.0)
    config_path.write_text(json.dumps(values, indent=2))
    try:
        staging.rename(target)
    except OSError:
        pass  # another process won the race; its copy is identical
    return target


if __name__ == "__main__":
    if sys.argv[1:] == ["tiny-llama"]:
        print(tiny_llama_checkpoint())
    else:
        raise SystemExit("usage: python -m kvcompress.offline_assets tiny-llama")
