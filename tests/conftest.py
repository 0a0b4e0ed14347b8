"""Shared engines: a vLLM engine start costs 20-60 s on CPU, so each configuration
is started once per test session and reused."""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# Tiny random GQA Llama: 4 layers, 8 query heads, 2 KV heads, head dim 64.
TINY_LAYERS, TINY_KV_HEADS, TINY_HEAD_DIM = 4, 2, 64
# float32 KV bytes per token: layers x (K + V) x kv_heads x head_dim x 4.
TINY_BYTES_PER_TOKEN = TINY_LAYERS * 2 * TINY_KV_HEADS * TINY_HEAD_DIM * 4

# Small enough that the batch below does not fit at once: preemption is forced.
# Both engines get the same bytes (stock's 128-token blocks round it down to 1152).
TINY_ENGINE_ARGS = dict(
    skip_tokenizer_init=True,
    dtype="float32",
    enforce_eager=True,
    max_model_len=1024,
    max_num_seqs=8,
    max_num_batched_tokens=128,  # forces chunked prefill of every prompt > 128 tokens
    kv_cache_memory_bytes=1200 * TINY_BYTES_PER_TOKEN,
    seed=0,
)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvcompress.offline_assets import tiny_llama_checkpoint

    return str(
        tiny_llama_checkpoint(
            num_layers=TINY_LAYERS, num_q_heads=8, num_kv_heads=TINY_KV_HEADS, head_dim=TINY_HEAD_DIM
        )
    )


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def stock_tiny_llm(tiny_model):
    from vllm import LLM

    llm = LLM(model=tiny_model, **TINY_ENGINE_ARGS)
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="session")
def kvc_tiny_llm(tiny_model):
    import kvcompress

    llm = kvcompress.LLM(tiny_model, kv_compress_rate=1, **TINY_ENGINE_ARGS)
    yield llm
    _shutdown(llm)


def page_stats(llm) -> dict:
    """Scheduler-side page counters (engine-core process)."""
    return llm.llm_engine.engine_core.call_utility("kvcompress_page_stats")


def worker_page_stats(llm) -> dict:
    """Worker-side page counters (model-runner process)."""
    return llm.collective_rpc("kvcompress_pages_used")[0]
