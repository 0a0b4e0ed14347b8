"""Demo: the same greedy batch on stock vLLM and on the per-(layer, KV head) cache.

Prints engine start time, decode time per step and whether outputs are identical.
Runs on CPU with a tiny random GQA Llama (built locally, cached).

    python benchmarks/demo.py [--prompts 8] [--output-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def run(label: str, make_llm, prompts, params) -> tuple[list, dict]:
    start = time.perf_counter()
    llm = make_llm()
    started = time.perf_counter() - start
    llm.generate(prompts[:1], params, use_tqdm=False)  # first-call warm-up
    prefill_params = params.clone()
    prefill_params.max_tokens = 1
    t0 = time.perf_counter()
    llm.generate(prompts, prefill_params, use_tqdm=False)
    prefill_time = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    decode_steps = params.max_tokens - 1
    stats = {
        "engine_start_s": started,
        "decode_step_ms": 1000 * max(0.0, total - prefill_time) / decode_steps,
    }
    print(f"{label:>10}: engine start {started:.1f} s, decode step {stats['decode_step_ms']:.1f} ms "
          f"(batch {len(prompts)})")
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvcompress
    from offline_assets import tiny_llama_checkpoint

    model = str(tiny_llama_checkpoint())
    rng = np.random.default_rng(0)
    prompts = [
        TokensPrompt(prompt_token_ids=rng.integers(3, 1000, args.prompt_len).tolist())
        for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    engine = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=2048, kv_cache_memory_bytes=256 << 20,
                  enable_prefix_caching=False)  # so repeated prompts are recomputed
    stock, _ = run("stock", lambda: LLM(model=model, **engine), prompts, params)
    per_head, _ = run("kvcompress", lambda: kvcompress.LLM(model, kv_compress_rate=1, **engine),
                      prompts, params)
    print("outputs identical:", stock == per_head)


if __name__ == "__main__":
    main()
