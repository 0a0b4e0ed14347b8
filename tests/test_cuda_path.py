"""The CUDA engine path's contracts with vLLM 0.32, checked on CPU (issue 15: what a
reading against vLLM's GPU model runner showed would break on a GPU). Real vLLM objects
where the code path allows; the builder / runner / cache methods called directly where
it does not. vLLM is imported inside the tests (the Triton interpreter tests must import
triton first)."""

from __future__ import annotations

import pytest
import torch

from kvcompress.ops import PerHeadPagedCache


def _common_metadata(num_reqs: int, num_tokens: int):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.arange(num_reqs + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts,
        seq_lens=torch.full((num_reqs,), 40, dtype=torch.int32), num_reqs=num_reqs,
        num_actual_tokens=num_tokens, max_query_len=1, max_seq_len=40,
        block_table_tensor=torch.zeros((num_reqs, 4), dtype=torch.int32),
        slot_mapping=torch.zeros(num_reqs, dtype=torch.int64),
    )


def _decode_step(num_reqs: int, decode_only: bool, kernel_decode=None):
    from kvcompress.vllm_glue.step import PerHeadStep

    cache = PerHeadPagedCache(64, 2, 2, 16, max_seqs=8, max_pages_per_head=8)
    slots = torch.tensor([cache.new_sequence() for _ in range(num_reqs)])
    cache.append(slots, torch.full((num_reqs,), 39), torch.cat([torch.arange(39)] * num_reqs))
    plan = cache.append(slots, torch.ones(num_reqs, dtype=torch.int64), torch.full((num_reqs,), 39))
    return PerHeadStep(
        num_reqs=num_reqs, num_tokens=num_reqs, query_start_loc=list(range(num_reqs + 1)),
        query_positions=torch.full((num_reqs,), 39), block_tables=None, head_lens=None,
        max_head_len=40, plan=plan, decode_only=decode_only, kernel_decode=kernel_decode,
    )


@pytest.fixture
def builder():
    from kvcompress.vllm_glue.attention_backend import PerHeadAttentionMetadataBuilder

    return PerHeadAttentionMetadataBuilder(None, ["layers.0.attn"], None, torch.device("cpu"))


def test_padded_decode_batch_of_a_full_cuda_graph_is_accepted(builder):
    """Item 1: vLLM pads a decode-only batch to a captured graph size (3 rows -> 4) and
    builds the metadata with the padded row count; the DecodeBuffers path takes it."""
    from kvcompress.vllm_glue import step as step_state

    step_state.set_current_step(_decode_step(3, decode_only=True))
    try:
        metadata = builder.build(0, _common_metadata(num_reqs=4, num_tokens=4))
        assert metadata.decode_only and metadata.step.num_reqs == 3
    finally:
        step_state.set_current_step(None)


@pytest.mark.parametrize("case", ["mixed-step", "cpu-kernel-decode", "fewer-rows"])
def test_other_batch_mismatches_are_still_refused(builder, case):
    """Only a decode step over the DecodeBuffers may be padded; a mixed step, a CPU
    kernel decode (tables built for exactly its rows) or a batch SMALLER than the plan
    is a bug and stops the step."""
    from kvcompress.vllm_glue import step as step_state

    step = {
        "mixed-step": lambda: _decode_step(3, decode_only=False),
        "cpu-kernel-decode": lambda: _decode_step(3, decode_only=True, kernel_decode=[]),
        "fewer-rows": lambda: _decode_step(3, decode_only=True),
    }[case]()
    rows = 2 if case == "fewer-rows" else 4
    step_state.set_current_step(step)
    try:
        with pytest.raises(RuntimeError, match="covers 3 requests but vLLM built a batch of"):
            builder.build(0, _common_metadata(num_reqs=rows, num_tokens=rows))
    finally:
        step_state.set_current_step(None)
