"""Per-sequence tables sized by what the pool can hold (``page_accounting.live_sequence_limit``).

A pool of N pages gives at most N / (L x H) sequences one page in every (layer, KV head),
and every sequence that has run a step owns one there (its newest KV's page): the cache's
sequence slots (page tables, head lengths) are sized for that many when it is fewer than
``--max-num-seqs``, the scheduler admits no more, and the bytes saved go to pages."""

from __future__ import annotations

import random

import pytest

from conftest import TINY_KV_HEADS, TINY_LAYERS, _shutdown, tiny_kv_budget, worker_page_stats
from kvcompress.ops.page_tables import chunk_pages_for
from kvcompress.page_accounting import live_sequence_limit


def _brute_force_limit(num_pages: int, pages_per_sequence: int, max_num_seqs: int) -> int:
    """The most sequences (at least 1, at most ``max_num_seqs``) that each get
    ``pages_per_sequence`` pages of ``num_pages``, counted one by one."""
    count = 0
    while count < max_num_seqs and (count + 1) * pages_per_sequence <= num_pages:
        count += 1
    return max(1, count)


def test_live_sequence_limit_is_the_most_sequences_with_a_page_per_head():
    for num_pages in range(0, 130):
        for pages_per_sequence in (1, 2, 3, 8, 90):
            for max_num_seqs in (1, 2, 5, 16, 256):
                assert live_sequence_limit(num_pages, pages_per_sequence, max_num_seqs) == _brute_force_limit(
                    num_pages, pages_per_sequence, max_num_seqs
                ), (num_pages, pages_per_sequence, max_num_seqs)


def _smollm2_layout(max_num_seqs: int = 256):
    from kvcompress.vllm_glue.memory import PerHeadLayout

    # SmolLM2-135M in float32 (30 layers x 3 KV heads x 64), CPU pages of 64 tokens, the
    # decode-heavy benchmark's 2048 + 256 tokens (+16 of its slack).
    return PerHeadLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, block_size=64,
                         max_num_seqs=max_num_seqs, max_model_len=2320, max_rows=max_num_seqs)


def test_a_small_pool_keeps_the_bytes_of_tables_no_sequence_could_use():
    """The benchmark's 9472-token budget: tables for 256 sequences left 12959 pages, one
    short of four 2304-token sequences (4 x 36 pages x 90 heads): stock vLLM ran four, the
    per-head cache recomputed one. Sized for the ~145 sequences the pool can hold, they fit."""
    layout = _smollm2_layout()
    heads = layout.num_layers * layout.num_kv_heads
    available = 9472 * heads * layout.page_bytes // layout.block_size
    four_sequences = 4 * 36 * heads

    full_slots = layout.max_num_seqs + 1  # before: every --max-num-seqs slot
    fixed = layout.metadata_bytes(0, max_seqs=full_slots)
    span = chunk_pages_for(layout.max_pages_per_head)  # the slope as page_bytes_for takes it
    per_page = -(-(layout.metadata_bytes(span, max_seqs=full_slots) - fixed) // span)

    def allocatable(for_pages: int) -> int:
        # vLLM counts whole token blocks (L x H pages each) in what is left for pages, all
        # allocatable (kv_layout.pages_in_pool; the scratch page is past them).
        return for_pages // (layout.page_bytes * heads) * heads

    before = allocatable((available - fixed) * layout.page_bytes // (layout.page_bytes + per_page))
    num_pages = allocatable(layout.page_bytes_for(available))
    assert before < num_pages  # (the scratch page past the pool: before is now exactly four)
    assert num_pages >= four_sequences
    slots = layout.sequence_slots(num_pages)
    assert slots - 1 == num_pages // heads < layout.max_num_seqs
    # What the worker allocates for the pages it got fits beside them.
    assert num_pages * layout.page_bytes + layout.metadata_bytes(num_pages) <= available


@pytest.mark.parametrize("seed", range(4))
def test_pages_and_tables_fit_the_memory_whatever_the_pool_holds(seed):
    """Random shapes and memories, small to large pools (the slot bound binding or not),
    with and without prefix caching: the worker's tables for the pages it gets (its own
    slot count, never more than the budget's) fit beside them in the memory."""
    from kvcompress.vllm_glue.memory import PerHeadLayout

    rng = random.Random(seed)
    for _ in range(60):
        layout = PerHeadLayout(
            num_layers=rng.choice([1, 4, 30]), num_kv_heads=rng.choice([1, 2, 3, 8]),
            head_dim=rng.choice([64, 128]), dtype_bytes=rng.choice([2, 4]), block_size=rng.choice([16, 64]),
            max_num_seqs=rng.choice([1, 8, 256, 1024]), max_model_len=rng.choice([256, 2320, 32768]),
            max_rows=rng.choice([8, 256, 1024]), prefix_caching=rng.random() < 0.5,
        )
        heads = layout.num_layers * layout.num_kv_heads
        available = rng.randint((heads + 2) * layout.page_bytes * 2, 400 * heads * layout.page_bytes * 64)
        try:
            for_pages = layout.page_bytes_for(available)
        except ValueError as error:
            assert "--max-num-seqs" in str(error)
            continue
        num_pages = for_pages // layout.page_bytes
        slots = layout.sequence_slots(num_pages)
        assert 2 <= slots <= layout.slots_for_memory(available) <= layout.max_num_seqs + 1
        shared = min(layout.max_pages_per_head, num_pages // heads) if layout.prefix_caching else 0
        assert for_pages + layout.metadata_bytes(num_pages, shared, slots) <= available


@pytest.mark.engine
def test_the_scheduler_runs_no_more_sequences_than_the_cache_has_slots(tiny_model, stock_tiny_llm):
    """A pool of about five 128-token sequences' pages under --max-num-seqs 16: the
    worker's cache has a slot for each sequence the pool can hold (+1), the scheduler
    admits that many at a time, and ten requests all finish with the tokens stock vLLM
    gives them. (Pages of 128 tokens, stock's CPU block: at 64 a request that never
    compresses is counted in pairs of pages, ``kv_layout.grant_pages_for``, and five would
    not run at once.)"""
    import kvcompress
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcompress.vllm_glue.llm import page_stats

    max_num_seqs = 16
    llm = kvcompress.LLM(
        tiny_model, kv_compress_rate=1, kv_compress_block_size=128, skip_tokenizer_init=True, dtype="float32",
        enforce_eager=True, max_model_len=128, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, seed=0,
        kv_cache_memory_bytes=tiny_kv_budget(5 * 128, block_size=128, max_num_seqs=max_num_seqs, max_model_len=128),
    )
    try:
        heads = TINY_LAYERS * TINY_KV_HEADS
        worker = worker_page_stats(llm)
        limit = live_sequence_limit(worker["num_pages"], heads, max_num_seqs)
        assert 2 <= limit <= 5 < max_num_seqs
        assert worker["sequence_slots"] == limit + 1
        assert page_stats(llm)["running_limit"] == limit

        rng = random.Random(3)
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 1000) for _ in range(40)]) for _ in range(10)]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        got = llm.generate(prompts, params, use_tqdm=False)
        expected = stock_tiny_llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in expected]
        stats = page_stats(llm)
        assert stats["max_running"] == limit
        assert stats["num_free"] == stats["num_pages"]
        assert worker_page_stats(llm)["live_requests"] == 0
    finally:
        _shutdown(llm)

