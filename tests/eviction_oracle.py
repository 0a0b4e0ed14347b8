"""An engine-level oracle for eviction (tests only): run one request in a real kvcompress
engine until the worker compresses it, read what the compression was given (the
worker's opt-in record of every KV's position and metric, ``kvc_record_compressions``)
and what survived (``kvc_kept_positions``), and check the survivors against a
recount in plain Python (no kvcompress op):

- every head holds its sinks / shared prefix and its protected window, by position;
- the KVs a head lost are its lowest-ranked unprotected ones (the attention metric; the
  oldest for streamingllm);
- the pages freed are the pages ordered;
- kvc (the paper's schedule over all heads): the blocks evicted are the E cheapest of all
  candidate blocks, a head's k-th block costing its (k*b)-th lowest entry with the empty
  slots of its last page counted first (max cost).
"""

from __future__ import annotations


def compress_one_and_read(llm, prompt: list[int], policy: str, rate: float = 4.0) -> tuple[dict, list[set[int]]]:
    """One request of ``policy`` at ``rate``, stepped until the worker compresses it: the
    compression's recorded inputs and, per head, the positions kept right after (those
    of its context then; the request is aborted once read)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    llm.collective_rpc("kvc_record_compressions", args=(True,))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True,
                            extra_args={"kv_compress_rate": rate, "kv_compress_policy": policy})
    request_id = f"oracle-{policy}-{len(prompt)}"
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    recorded = kept = None
    try:
        while recorded is None and engine.has_unfinished_requests():
            engine.step()
            # The engine core keeps stepping between these calls: read the positions
            # after the record, so they are never those from before its compression
            # (later steps only append positions past the context).
            inputs = llm.collective_rpc("kvc_record_compressions", args=(True,))[0]
            if inputs:
                (recorded,) = inputs.values()
                (heads,) = llm.collective_rpc("kvc_kept_positions")[0].values()
                kept = [{p for p in head if p < recorded["context_len"]} for head in heads]
    finally:
        llm.collective_rpc("kvc_record_compressions", args=(False,))
        engine.abort_request([request_id])
        while engine.has_unfinished_requests():
            engine.step()
    assert recorded is not None, f"{policy}: no compression"
    return recorded, kept


def _block_costs(values: list[float], held: int, block: int, count: int) -> list[float]:
    """Costs of a head's ``count`` cheapest blocks (max cost) over its sorted evictable
    ``values``, ``held`` KVs in pages of ``block``."""
    empties = -(-held // block) * block - held
    return [values[k * block - empties - 1] for k in range(1, count + 1)]


def check_what_survived(recorded: dict, kept: list[set[int]], policy: str, block: int) -> None:
    context = recorded["context_len"]
    window, prefix = recorded["protected_window"], recorded["protected_prefix"]
    pages_freed, blocks, candidates = 0, [], []
    for head, survivors in zip(recorded["heads"], kept):
        assert len(head) == context and {p for p, _ in head} == set(range(context))
        protected = {p for p, _ in head if p < prefix or p >= context - window}
        assert protected <= survivors, sorted(protected - survivors)[:8]
        rank = {p: (p if policy == "streamingllm" else m) for p, m in head}
        evicted = sorted(rank[p] for p, _ in head if p not in survivors)
        unprotected = sorted(rank[p] for p, _ in head if p not in protected)
        assert evicted == unprotected[: len(evicted)], f"{policy}: a head kept a lower-ranked KV"
        freed = -(-context // block) - -(-len(survivors) // block)
        pages_freed += freed
        blocks += _block_costs(unprotected, context, block, freed)
        empties = -(-context // block) * block - context
        candidates += _block_costs(unprotected, context, block, (empties + len(unprotected)) // block)
    assert pages_freed == recorded["evict_pages"] > 0
    if policy == "kvc" and recorded["block_cost"] == "max":
        assert sorted(blocks) == sorted(candidates)[:pages_freed], "kvc: not the E cheapest blocks"
