"""Word-span pooling of prompt metrics (kvcompress.ops.word_spans, pool_metrics with
word_starts) against brute-force loops over token texts."""

from __future__ import annotations

import random

import pytest
import torch

from kvcompress.ops.metrics import pool_metrics
from kvcompress.ops.word_spans import WordEdges, span_max_pool, span_starts

VOCAB = [" ", "1", "2", "3", " the", "cat", "-", "t", "iger", ".", "<|im_end|>", "\n", " is", ":", "ab", "\ufffd", "é", " 9"]


def brute_spans(texts: list[str], max_span: int) -> list[int]:
    """The first position of each token's span, by walking the texts."""
    starts, run_start = [], 0
    for i, text in enumerate(texts):
        joins = i > 0 and texts[i - 1][-1:].isalnum() and text[:1].isalnum()
        if not joins:
            run_start = i
        starts.append(run_start + (i - run_start) // max_span * max_span)
    return starts


def test_digits_of_a_number_are_one_span():
    texts = [" is", ":", " ", "1", "2", "3", "2", "1", ".", " the", "cat"]
    ids = [VOCAB.index(t) for t in texts]
    starts = span_starts(ids, WordEdges.from_texts(VOCAB, rule="alnum"))
    assert starts.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 8, 9, 9]


@pytest.mark.parametrize("max_span", [1, 3, 16])
def test_span_starts_match_brute_force(max_span):
    rng = random.Random(max_span)
    edges = WordEdges.from_texts(VOCAB, rule="alnum")
    for _ in range(50):
        ids = [rng.randrange(len(VOCAB)) for _ in range(rng.randint(0, 60))]
        expected = brute_spans([VOCAB[i] for i in ids], max_span)
        assert span_starts(ids, edges, max_span).tolist() == expected


def brute_whitespace_spans(texts: list[str], max_span: int) -> list[int]:
    """The whitespace rule by walking the texts: no whitespace between two tokens joins them."""
    starts, run_start = [], 0
    for i, text in enumerate(texts):
        joins = i > 0 and texts[i - 1][-1:] not in ("",) and not texts[i - 1][-1].isspace() \
            and text[:1] not in ("",) and not text[0].isspace()
        if not joins:
            run_start = i
        starts.append(run_start + (i - run_start) // max_span * max_span)
    return starts


def test_whitespace_spans_keep_a_uuid_whole_and_match_brute_force():
    texts = [" is", ":", " ", "1", "3", "b", "-", "e", "3", "-", "4", "4", ".", " the", "cat", "\n", "ab"]
    vocab = sorted(set(texts) | set(VOCAB))
    ids = [vocab.index(t) for t in texts]
    edges = WordEdges.from_texts(vocab, rule="whitespace")
    assert edges.max_span == 64
    # ":" stays with " is"; the UUID-like run from "1" to "." is one span.
    assert span_starts(ids, edges).tolist() == [0, 0, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 13, 13, 15, 16]
    assert span_starts(ids, WordEdges.from_texts(vocab, rule="alnum")).tolist()[3:12] == [3, 3, 3, 6, 7, 7, 9, 10, 10]
    rng = random.Random(7)
    for max_span in (1, 3, 64):
        for _ in range(50):
            sample = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 80))]
            assert span_starts(sample, edges, max_span).tolist() == brute_whitespace_spans(
                [vocab[i] for i in sample], max_span)
    with pytest.raises(ValueError, match="word span rule 'spaces': one of whitespace, alnum"):
        WordEdges.from_texts(vocab, rule="spaces")


def test_the_setting_names_exactly_the_rules_and_defaults_to_whitespace():
    import typing

    from kvcompress.config import FLAGS, KVCompressConfig, KVCompressConfigError
    from kvcompress.ops.word_spans import SPAN_RULES

    field = KVCompressConfig.model_fields["word_spans"]
    assert typing.get_args(field.annotation) == tuple(SPAN_RULES)
    assert KVCompressConfig().word_spans == "whitespace"
    assert FLAGS["word_spans"] == "--kv-compress-word-spans"
    with pytest.raises(KVCompressConfigError, match="--kv-compress-word-spans"):
        KVCompressConfig.from_dict({"word_spans": "spaces"})


def test_ids_past_the_vocabulary_are_boundaries():
    edges = WordEdges.from_texts(VOCAB, rule="alnum")
    one = VOCAB.index("1")
    assert span_starts([one, len(VOCAB) + 3, one, one], edges).tolist() == [0, 1, 2, 2]


def test_span_max_pool_matches_loops():
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(3, 40, generator=gen)
    values[1, 5] = float("-inf")
    starts = torch.tensor(brute_spans([random.Random(1).choice(VOCAB) for _ in range(40)], 16))
    pooled = span_max_pool(values, starts)
    for h in range(3):
        for p in range(40):
            members = [q for q in range(40) if starts[q] == starts[p]]
            assert pooled[h, p] == max(values[h, q] for q in members)


@pytest.mark.parametrize("kernel,mode", [(1, "max"), (7, "max"), (7, "avg")])
def test_pool_metrics_with_words_is_kernel_then_span_max(kernel, mode):
    """Pages in shuffled pool order, heads of different lengths: each held position
    gets the largest kernel-pooled metric of its span's held positions."""
    gen = torch.Generator().manual_seed(kernel)
    block_size, num_heads, pages_per_head = 4, 2, 5
    page_ids = torch.randperm(num_heads * pages_per_head + 3, generator=gen)[: num_heads * pages_per_head]
    tables = page_ids.view(num_heads, pages_per_head)
    lens = torch.tensor([20, 17])
    slot_metrics = torch.rand(num_heads * pages_per_head + 3, block_size, generator=gen)
    original = slot_metrics.clone()
    rng = random.Random(kernel)
    texts = [rng.choice(VOCAB) for _ in range(20)]
    starts = brute_spans(texts, 16)
    pool_metrics(slot_metrics, tables, lens, kernel, mode, torch.tensor(starts))
    for h in range(num_heads):
        n = int(lens[h])
        logical = [float(original[tables[h, p // block_size], p % block_size]) for p in range(n)]
        half = kernel // 2
        window = [logical[max(0, p - half) : p + half + 1] for p in range(n)]
        if mode == "max":
            kernel_pooled = [max(w) for w in window]
        else:  # zero padding outside the head counts as not held
            kernel_pooled = [sum(w) / len(w) for w in window]
        for p in range(n):
            expected = max(kernel_pooled[q] for q in range(n) if starts[q] == starts[p])
            got = float(slot_metrics[tables[h, p // block_size], p % block_size])
            assert got == pytest.approx(expected, rel=1e-6)
    # slots of pages no head holds, and past a head's length, are untouched
    held = {(int(tables[h, p // block_size]), p % block_size) for h in range(num_heads) for p in range(int(lens[h]))}
    for page in range(slot_metrics.shape[0]):
        for slot in range(block_size):
            if (page, slot) not in held:
                assert slot_metrics[page, slot] == original[page, slot]


@pytest.mark.assets
def test_real_tokenizer_keeps_a_number_in_one_span():
    from transformers import AutoTokenizer

    from offline_assets import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint()))
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    text = "One of the special magic numbers for brave-tiger is: 9876543. Then 13b93773-e385-44f3-8678-b59a4bd120b4 x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    digits = [p for p, piece in enumerate(pieces) if piece.strip().isdigit() and len(piece.strip()) == 1]
    assert len([p for p in digits if p < pieces.index(" Then")]) == 7, pieces  # one token per digit
    words = {}
    for rule in ("alnum", "whitespace"):
        starts = span_starts(ids, WordEdges.from_texts(texts, rule=rule))
        assert len({int(starts[p]) for p in digits[:7]}) == 1, rule
        words[rule] = ["".join(pieces[q] for q in range(len(ids)) if starts[q] == s).strip()
                       for s in sorted(set(starts.tolist()))]
    assert {"9876543", "special", "tiger", "13b93773", "b59a4bd120b4"} <= set(words["alnum"])
    assert {"9876543.", "special", "brave-tiger", "is:", "13b93773-e385-44f3-8678-b59a4bd120b4"} <= set(words["whitespace"])

    from kvcompress.config import KVCompressConfig
    from kvcompress.vllm_glue.tokenizer_checks import number_tokens, pooling_warning

    assert number_tokens(tokenizer) == 7
    assert pooling_warning(KVCompressConfig(enabled=True, rate=8, policy="kvc-paper"), number_tokens(tokenizer))
    assert pooling_warning(KVCompressConfig(enabled=True, rate=8), number_tokens(tokenizer)) is None


def test_pooling_warning_names_the_flags():
    from kvcompress.config import KVCompressConfig
    from kvcompress.vllm_glue.tokenizer_checks import pooling_warning

    paper = KVCompressConfig(enabled=True, rate=8, policy="kvc-paper")
    assert pooling_warning(KVCompressConfig(enabled=True, rate=8, pool_words=False), 7) is None  # kernel 31 reaches
    message = pooling_warning(paper, digits_tokens=7)
    assert message and "--kv-compress-pool-words" in message and "--kv-compress-pool-kernel 7" in message
    assert pooling_warning(paper, digits_tokens=3) is None  # Llama-style 3-digit pieces: 7 reaches
    assert pooling_warning(KVCompressConfig(enabled=True, rate=8, pool_words=True), 7) is None
    assert pooling_warning(KVCompressConfig(enabled=True, rate=1, pool_words=False), 7) is None
    assert pooling_warning(KVCompressConfig(enabled=True, rate=8, policy="streamingllm"), 7) is None
