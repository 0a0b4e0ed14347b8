"""Adding a batch of token prompts to a vLLM engine under ids a script can map back.

The quality scripts step ``LLM.llm_engine`` themselves (to read page counts between
steps), so they add requests directly; vLLM may rename a request, and ``add_request``
returns the name it uses.
"""

from __future__ import annotations

from typing import Any, Sequence


def add_token_requests(engine: Any, tag: str, prompt_token_ids: Sequence[list[int]],
                       params: Sequence[Any]) -> dict[str, int]:
    """Add prompt ``i`` (token ids) with ``params[i]`` (``SamplingParams``) to ``engine``
    (vLLM's ``LLMEngine``) as request ``f"{tag}-{i}"``, in order. Returns the engine's
    request id -> ``i``."""
    from vllm.inputs import TokensPrompt

    internal: dict[str, int] = {}
    for index, (token_ids, sampling) in enumerate(zip(prompt_token_ids, params, strict=True)):
        request_id = engine.add_request(f"{tag}-{index}", TokensPrompt(prompt_token_ids=token_ids), sampling)
        internal[request_id] = index
    return internal
