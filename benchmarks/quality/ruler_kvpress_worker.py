"""The generation side of ``ruler_kvpress.py``: run by the kvpress venv's Python (never by
the project's; no vLLM here), it answers RULER samples with kvpress 0.5.5's pipeline.

    .venv-kvpress/bin/python ruler_kvpress_worker.py JOB.json ANSWERS.jsonl

``JOB.json`` (written by ``ruler_kvpress.write_job``)::

    {"model_dir": str, "press": str | null, "compression_ratio": float,
     "items": [{"task": str, "index": int, "input": str, "question_start": int,
                "max_new_tokens": int}, ...]}

``question_start`` is the character offset in ``input`` where the question begins. The
whole input is tokenized once, exactly as ``vllm serve`` tokenizes a completion prompt,
and the ids are cut at the first token that ends past ``question_start``: the context ids
are prefilled under the press (compressed), the question ids (question and the answer
prefix) are then fed against the compressed cache and answered greedily; this is the
pipeline's own prefill/decode stage (``KVPressTextGenerationPipeline.forward``) with its
greedy loop replaced by :func:`greedy_ids`, which stops as vLLM does (:func:`load_pipeline`). The
pipeline's text front-end is bypassed on purpose: it would wrap the context in the chat
template (or prepend BOS) and put a newline before the answer prefix, and the model would
then read other tokens than stock vLLM read.

One JSON line per answered sample is appended to ``ANSWERS.jsonl``
(``{"task", "index", "answer", "context_tokens", "kept_tokens"}``: the context's length and
the KV pairs of it left in the cache, unmasked, averaged over layers and KV heads, a check
that the press did compress); samples already there are skipped, so a stopped run
resumes. Float32 on the CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# --presses name -> kvpress 0.5.5 class; all compress the prefilled context by
# ``compression_ratio`` (the fraction of KV pairs removed). ObservedAttentionPress is left
# out: it needs eager attention, which would change the no-press reference too.
PRESS_CLASSES = {
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",
    "kvzip": "KVzipPress",
    "streaming_llm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "pyramidkv": "PyramidKVPress",
    "keydiff": "KeyDiffPress",
    "random": "RandomPress",
}


def make_press(name: str | None, compression_ratio: float):
    """The kvpress press ``name`` at ``compression_ratio`` (None: no press)."""
    if name is None:
        return None
    import kvpress

    return getattr(kvpress, PRESS_CLASSES[name])(compression_ratio=compression_ratio)


def load_pipeline(model_dir: str):
    """kvpress's text-generation pipeline over the float32 checkpoint at ``model_dir``,
    its greedy loop replaced by :func:`greedy_ids` (vLLM's stop rule)."""
    import kvpress  # noqa: F401  registers "kv-press-text-generation"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    torch.manual_seed(0)  # RandomPress draws from torch's generator
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    stops = stop_token_ids(model, tokenizer)

    def generate_answer(question_ids, cache, context_length: int, max_new_tokens: int) -> str:
        ids = greedy_ids(model, question_ids, cache, context_length, max_new_tokens, stops)
        return tokenizer.decode(ids, skip_special_tokens=True)

    pipe.generate_answer = generate_answer  # the instance's, called by pipe.forward
    return pipe


def split_ids(tokenizer, text: str, question_start: int):
    """``text``'s prompt ids ([1, n] tensors) cut into context and question at the first
    token ending past character ``question_start``."""
    import torch

    encoded = tokenizer(text, return_offsets_mapping=True)  # special tokens as vLLM adds them
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    cut = sum(1 for _, end in offsets if end <= question_start)  # offsets rise: a prefix
    as_tensor = lambda part: torch.tensor([part], dtype=torch.long)  # noqa: E731
    return as_tensor(ids[:cut]), as_tensor(ids[cut:])


def stop_token_ids(model, tokenizer) -> set[int]:
    """The tokens ``vllm serve`` stops a completion at: the tokenizer's EOS and the
    generation config's (vLLM adds those as stop tokens)."""
    configured = model.generation_config.eos_token_id
    configured = [] if configured is None else configured if isinstance(configured, list) else [configured]
    return {*configured, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}


def greedy_ids(model, question_ids, cache, context_length: int, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy answer ids after ``question_ids`` read against ``cache`` (holding the pressed
    context, positions from ``context_length`` on), stopping AT a stop token (not kept) as
    vLLM does, the first answer token included: kvpress 0.5.5's own loop checks only from
    the second token, so an answer whose first token is EOS (vLLM: an empty answer) went
    on past it there (measured on SmolLM2's RULER QA samples)."""
    import torch

    positions = torch.arange(context_length, context_length + question_ids.shape[1]).unsqueeze(0)
    inputs, ids = question_ids, []
    with torch.no_grad():
        while len(ids) < max_new_tokens:
            logits = model(input_ids=inputs, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            if token in stop_ids:
                break
            ids.append(token)
            positions = positions[:, -1:] + 1
            inputs = torch.tensor([[token]], dtype=torch.long)
    return ids


def answer(pipe, press, item: dict) -> dict:
    """The answer to ``item`` and the KV pairs kept of its context (first layer: the
    pipeline trims the question and answer off the cache after generating); ``pipe`` from
    :func:`load_pipeline`."""
    from transformers import DynamicCache

    context_ids, question_ids = split_ids(pipe.tokenizer, item["input"], item["question_start"])
    inputs = {"context_ids": context_ids, "questions_ids": [question_ids]}
    cache = DynamicCache()
    text = pipe.forward(inputs, press=press, max_new_tokens=item["max_new_tokens"], cache=cache)[0]
    return {"answer": text, "context_tokens": context_ids.shape[1], "kept_tokens": kept_context_tokens(pipe.model, cache)}


def kept_context_tokens(model, cache) -> float:
    """The context's KV pairs a sample kept, averaged over layers and KV heads: each layer's
    cache length less what a masking press hides from attention. KVzip and AdaKV-style
    presses leave the cache whole and list the removed (batch, head, token) entries in
    ``self_attn.masked_key_indices`` (kvpress's attention patch replaces those keys during
    decoding); counting only the length would report them as keeping everything."""
    kv_heads = model.config.num_key_value_heads
    kept = []
    for index, layer in enumerate(model.model.layers):
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        hidden = 0 if masked is None else len(masked[2]) / kv_heads
        kept.append(cache.get_seq_length(index) - hidden)
    return sum(kept) / len(kept)


def done_keys(path: Path) -> set[tuple[str, int]]:
    if not path.exists():
        return set()
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(line["task"], line["index"]) for line in lines}


def main(job_path: str, answers_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out = Path(answers_path)
    done = done_keys(out)
    todo = [item for item in job["items"] if (item["task"], item["index"]) not in done]
    if not todo:
        return
    pipe = load_pipeline(job["model_dir"])
    press = make_press(job["press"], job["compression_ratio"])
    with open(out, "a", encoding="utf-8") as handle:
        for item in todo:
            line = {"task": item["task"], "index": item["index"], **answer(pipe, press, item)}
            handle.write(json.dumps(line) + "\n")
            handle.flush()  # the parent counts lines for its progress bar


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
