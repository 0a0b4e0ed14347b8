"""Make an XKV per-layer allocation profile (``--kv-compress-xkv-profile``).

XKV (Li et al.) allocates each layer's cache size from the layer-normalised attention
scores of the request itself (a mini-prefill) or, online, from a profile sampled on a
few requests of the task category and reused. This script is the second way: it runs
sample prompts through a kvcompress engine with ``--kv-compress-policy xkv`` (each
request allocates for itself), reads how many unprotected KVs every layer kept
(worker statistic ``kept_unprotected_by_layer``), and writes their shares:

    {"layer_shares": [...], "model": ..., "rate": ..., "prompts": N, ...}

A server started with ``--kv-compress-policy xkv --kv-compress-xkv-profile FILE`` then
splits every request's budget over layers by these shares (heads of a layer share it
uniformly), skipping the per-request allocation.

    python benchmarks/quality/xkv_profile.py --out xkv-smollm2.json                # essays
    python benchmarks/quality/xkv_profile.py --model /path/to/checkpoint --prompts 16 --length 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))  # last: the installed kvcompress still wins

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def collect_profile(llm, prompts: list[list[int]], rate: float) -> dict:
    """Run token-id ``prompts`` with per-request policy xkv at ``rate`` on a kvcompress
    engine ``llm`` and return the profile (shares over layers, summing to 1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def kept() -> list[int]:
        stats = llm.collective_rpc("kvc_pages_used")[0]
        return stats["kept_unprotected_by_layer"].get("xkv", [])

    before = kept()
    params = SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True,
        extra_args={"kv_compress_rate": rate, "kv_compress_policy": "xkv"},
    )  # fmt: skip
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    after = kept()
    if not after:
        raise RuntimeError("no xkv compression happened: prompts too short for this rate?")
    per_layer = [a - b for a, b in zip(after, before + [0] * (len(after) - len(before)))]
    total = sum(per_layer)
    if total <= 0:
        raise RuntimeError("xkv kept no unprotected KVs: prompts too short for this rate?")
    return {
        "layer_shares": [v / total for v in per_layer],
        "kept_unprotected_by_layer": per_layer,
        "rate": rate,
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
    }


def essay_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the Paul Graham essays."""
    from benchmarks.common.offline_assets import paul_graham_essays

    tokens = tokenizer.encode("\n\n".join(paul_graham_essays()), add_special_tokens=False)
    if len(tokens) < count * length:
        raise ValueError(f"the essays hold {len(tokens)} tokens, fewer than {count} x {length}")
    return [tokens[i * length : (i + 1) * length] for i in range(count)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory")
    parser.add_argument("--rate", type=float, default=8.0, help="compression rate of the sample requests")
    parser.add_argument("--prompts", type=int, default=8, help="sample prompts")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sample prompt")
    parser.add_argument("--out", required=True, help="profile JSON to write")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    import kvcompress
    from benchmarks.common.offline_assets import smollm2_checkpoint

    path = str(smollm2_checkpoint()) if args.model == "smollm2" else args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = essay_prompts(tokenizer, args.prompts, args.length)
    llm = kvcompress.LLM(
        path, kv_compress=True, dtype="float32", enforce_eager=True,
        max_model_len=args.length + 16, enable_prefix_caching=False, seed=0,
    )  # fmt: skip
    profile = {"model": args.model, **collect_profile(llm, prompts, args.rate)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    shares = ", ".join(f"{v:.3f}" for v in profile["layer_shares"])
    print(f"wrote {args.out}: layer shares {shares}", file=sys.stderr)
    return profile


if __name__ == "__main__":
    main()
