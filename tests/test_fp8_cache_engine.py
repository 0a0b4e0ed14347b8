"""FP8 KV pages through the real engine on CPU (issue 60): ``--kv-cache-dtype fp8`` (E4M3)
and ``fp8_e5m2`` with ``--kv-compress``.

Oracle: Hugging Face's Llama in float64 whose attention sees each post-RoPE key and value
rounded through the same float8 type as the engine's pages hold them (unit scales, as
vLLM's default): by vLLM's CPU writer where the engine's attention is vLLM's CPU kernel
(it rounds toward zero), else torch's saturating cast (to nearest). Each token kvcompress
generated is scored by the oracle on kvcompress's own prefix (teacher forcing: one
near-tie cannot send the two down different paths), and its logprob must match; the same
oracle without the rounding must not (the random tiny model is sensitive enough that FP8
moves its logprobs by ~1). Where vLLM's CPU kernel takes FP8 caches (AVX-512 / AMX hosts)
stock vLLM's FP8 engine is the second oracle: rate 1 must give its tokens and logprobs.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from conftest import TINY_ENGINE_ARGS, TINY_HEAD_DIM, greedy_tokens_and_logprobs, page_stats

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (100, 300, 700)  # one page; several 128-token prefill chunks; most of max_model_len
FP8_TYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MAX_TOKENS = 12
ORACLE_TOLERANCE = 0.1
"""Largest |logprob difference| to the FP8 oracle (measured here: <= 0.045 over 5 prompts;
float32 against float64 keys may round a few values to the neighbouring float8 step). The
unrounded oracle differs by ~1 (the test asks its median difference to be 5x larger)."""


def vllm_cpu_rounded(values: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``values`` (float32, any shape ``[..., D]``) as vLLM's CPU writer stores them in an
    FP8 cache, read back as float32 (its ``vec`` path, unit scales)."""
    from kvcompress.ops.cpu_attention import KERNEL_FP8_CACHE_DTYPES, unavailable_reason
    from test_cpu_attention_fp8 import stock_layout_bytes

    assert unavailable_reason() is None  # loads vLLM's kernels into this process
    rows = values.reshape(-1, 1, values.shape[-1])
    _, stored = stock_layout_bytes(rows, rows, KERNEL_FP8_CACHE_DTYPES[fp8], block_size=32)
    return stored.view(fp8).float().reshape(values.shape)


def engine_rounding(llm, fp8: torch.dtype):
    """How ``llm``'s FP8 pages hold a float32 value: vLLM's CPU writer when its attention
    is vLLM's CPU kernel, else torch's saturating cast."""
    if llm.collective_rpc("kvc_pages_used")[0].get("attention_backend") == "vllm_cpu":
        return lambda t: vllm_cpu_rounded(t.float(), fp8)
    limit = torch.finfo(fp8).max
    return lambda t: t.float().clamp(-limit, limit).to(fp8).float()


@contextlib.contextmanager
def keys_values_rounded_through(rounding):
    """Hugging Face's eager Llama attention with K and V through ``rounding`` (a float32
    tensor's stored value; float32 first, as the engine's values are) or as they are (None)."""
    import transformers.models.llama.modeling_llama as llama

    plain = llama.eager_attention_forward

    def rounded(module, query, key, value, attention_mask, *args, **kwargs):
        if rounding is not None:
            key, value = (rounding(t).to(t.dtype) for t in (key, value))
        return plain(module, query, key, value, attention_mask, *args, **kwargs)

    llama.eager_attention_forward = rounded
    try:
        yield
    finally:
        llama.eager_attention_forward = plain


def oracle_logprobs(model, prompt: list[int], generated: list[int], rounding) -> list[float]:
    """Logprob of each ``generated`` token after ``prompt`` and the generated tokens
    before it, float64 (teacher-forced), K / V through ``rounding`` (None: as they are)."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad(), keys_values_rounded_through(rounding):
        logits = model(ids).logits[0, len(prompt) - 1:].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(generated)), torch.tensor(generated)].tolist()


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager", dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 1024, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["fp8", pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def fp8_llm(request, tiny_model):
    import kvcompress
    from kvcompress.vllm_glue.llm import shutdown

    llm = kvcompress.LLM(tiny_model, kv_compress_rate=1, kv_cache_dtype=request.param, **TINY_ENGINE_ARGS)
    yield request.param, llm
    shutdown(llm)


def _generate(llm, prompts, rate: float | None = 1.0):
    """Greedy tokens and logprobs at ``rate`` (None: no kvcompress field, for stock)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0,
                            extra_args=None if rate is None else {"kv_compress_rate": rate})
    return greedy_tokens_and_logprobs(
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False))


def test_rate_1_matches_the_float64_oracle_of_fp8_keys_and_values(fp8_llm, hf_model, prompts):
    cache_dtype, llm = fp8_llm
    tokens, logprobs = _generate(llm, prompts)
    rounding = engine_rounding(llm, FP8_TYPES[cache_dtype])
    rounded_diffs, plain_diffs = [], []
    for prompt, generated, got in zip(prompts, tokens, logprobs, strict=True):
        assert len(generated) == MAX_TOKENS
        rounded = oracle_logprobs(hf_model, prompt, generated, rounding)
        plain = oracle_logprobs(hf_model, prompt, generated, None)
        rounded_diffs += [abs(a - b) for a, b in zip(got, rounded)]
        plain_diffs += [abs(a - b) for a, b in zip(got, plain)]
    assert max(rounded_diffs) < ORACLE_TOLERANCE, (cache_dtype, max(rounded_diffs))
    assert np.median(plain_diffs) > 5 * np.median(rounded_diffs), (np.median(plain_diffs), np.median(rounded_diffs))
    stats = page_stats(llm)
    assert stats["compressions"] == 0 and stats["num_free"] == stats["num_pages"]


def test_rate_1_gives_stock_vllms_fp8_tokens_and_logprobs(fp8_llm, tiny_model, prompts):
    """Where vLLM's CPU kernel takes FP8 caches, kvcompress's FP8 pages are written and
    read by it (``cpu_attention``): rate 1 answers as stock vLLM's FP8 engine does, token
    for token, logprobs within float32 summation order (measured: equal)."""
    from vllm import LLM

    from kvcompress.ops import cpu_attention

    cache_dtype, llm = fp8_llm
    reason = cpu_attention.unavailable_reason() or cpu_attention.fp8_unavailable_reason()
    if reason is not None:
        pytest.skip(f"stock vLLM's FP8 cache on CPU: {reason}")
    assert llm.collective_rpc("kvc_pages_used")[0].get("attention_backend") == "vllm_cpu"
    tokens, logprobs = _generate(llm, prompts)
    stock = LLM(model=tiny_model, kv_cache_dtype=cache_dtype, **TINY_ENGINE_ARGS)
    try:
        stock_tokens, stock_logprobs = _generate(stock, prompts, rate=None)
    finally:
        _shutdown_quietly(stock)
    assert tokens == stock_tokens
    assert max(abs(a - b) for row, stock_row in zip(logprobs, stock_logprobs) for a, b in zip(row, stock_row)) < 1e-4


def _shutdown_quietly(llm) -> None:
    from kvcompress.vllm_glue.llm import shutdown

    with contextlib.suppress(Exception):
        shutdown(llm)


def test_fp8_pages_hold_about_four_times_the_float32_tokens(fp8_llm, kvc_tiny_llm):
    """Same KV memory as the float32 engine: pages of 1-byte values against 4-byte values
    (on CPU no slot metadata per page: rows carved from pages, only for requests that
    compress). vLLM counts whole token blocks of L x H pages: at this small budget the
    float32 engine's 18 blocks round down by up to one, so the ratio is 4 to ~4.25."""
    _, llm = fp8_llm
    fp8_pages, fp32_pages = page_stats(llm)["num_pages"], page_stats(kvc_tiny_llm)["num_pages"]
    per_slot = {"fp32": 2 * TINY_HEAD_DIM * 4, "fp8": 2 * TINY_HEAD_DIM * 1}
    ratio = per_slot["fp32"] / per_slot["fp8"]
    assert ratio * 0.98 <= fp8_pages / fp32_pages <= ratio * 1.07


def test_rate_8_compresses_fp8_pages_and_frees_them(fp8_llm, prompts):
    _, llm = fp8_llm
    before = page_stats(llm)
    tokens, logprobs = _generate(llm, prompts, rate=8.0)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert all(np.isfinite(lp).all() for lp in logprobs)
    stats = page_stats(llm)
    assert stats["compressions"] > before["compressions"] and stats["pages_freed"] > before["pages_freed"]
    assert stats["mismatches"] == 0 and stats["evict_mismatches"] == 0
    assert stats["num_free"] == stats["num_pages"]
