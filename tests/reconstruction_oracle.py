"""Independent oracles for the question-agnostic policies' scores (tests only), from
Hugging Face's eager Llama, not vLLM and not kvcompress: kvzip's (the prompt followed
by each repeated chunk) and surprisal's (the prompt's own log-softmax)."""

from __future__ import annotations

from conftest import TINY_KV_HEADS


def reconstruction_scores(model_path: str, prompt: list[int], chunk: int, num_kv_heads: int = TINY_KV_HEADS):
    """``[L, H, len(prompt)]`` kvzip scores from Hugging Face's eager Llama (not vLLM,
    not kvcompress): for each chunk, the prompt then the chunk repeated (no instruction:
    the tiny engine has no tokenizer), at positions right after the prompt; a prompt
    KV's score is the largest attention probability a repeating query of its KV head's
    group gives it, over every chunk."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager", dtype=torch.float32)
    n = len(prompt)
    best = None
    with torch.no_grad():
        for start in range(0, n, chunk):
            repeated = prompt[start : start + chunk]
            ids = torch.tensor([prompt + repeated])
            out = model(input_ids=ids, output_attentions=True)
            # [L, Hq, scoring queries, prompt keys] -> max over queries and the group
            probs = torch.stack([a[0, :, n:, :n] for a in out.attentions])
            layers, q_heads = probs.shape[:2]
            scores = probs.amax(dim=2).view(layers, num_kv_heads, q_heads // num_kv_heads, n).amax(dim=2)
            best = scores if best is None else torch.maximum(best, scores)
    return best


def surprisal_nats(model_path: str, prompt: list[int]):
    """``[len(prompt)]`` float64 ``-log p(token t | tokens < t)``; NaN at position 0."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].double()
    nats = -torch.log_softmax(logits[:-1], dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    return torch.cat([torch.tensor([float("nan")], dtype=torch.float64), nats])
