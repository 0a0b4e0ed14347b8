"""The surprisal policy's scoring ops (``kvcompress.ops.surprisal``, no vLLM) against
plain-Python and float64 references."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from kvcompress.ops.surprisal import (
    LOGIT_ROWS_PER_CHUNK,
    SURPRISAL_CLIP_NATS,
    SentenceEnds,
    sentence_scores,
    sentence_starts,
    token_surprisal,
)


def test_token_surprisal_matches_float64_log_softmax():
    generator = torch.Generator().manual_seed(0)
    rows, hidden_size, vocab = LOGIT_ROWS_PER_CHUNK * 2 + 37, 24, 300  # several chunks
    hidden = torch.randn(rows, hidden_size, generator=generator)
    head = torch.randn(hidden_size, vocab, generator=generator) * 3
    next_ids = torch.randint(0, vocab, (rows,), generator=generator)
    calls = []

    def logits_of(h):
        calls.append(len(h))
        return h @ head

    got = token_surprisal(hidden, next_ids, logits_of)
    want = -torch.log_softmax(hidden.double() @ head.double(), dim=1)[torch.arange(rows), next_ids]
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert max(calls) <= LOGIT_ROWS_PER_CHUNK and sum(calls) == rows


def _starts_reference(ids, ends_text, max_span):
    """Plain Python: a new sentence after a token whose text holds . ? ! or a line
    break (ids outside the vocabulary end nothing), cut every ``max_span`` tokens."""
    starts, start, last_cut = [], 0, 0
    for position, _ in enumerate(ids):
        if position > 0:
            previous = ids[position - 1]
            if ends_text is not None and 0 <= previous < len(ends_text) and any(c in ends_text[previous] for c in ".?!\n"):
                start = last_cut = position
        if position - last_cut >= max_span:
            last_cut += max_span
        starts.append(last_cut if last_cut > start else start)
    return starts


@pytest.mark.parametrize("max_span", [1, 3, 5, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sentence_starts_match_a_plain_walk(max_span, seed):
    rng = random.Random(seed)
    texts = ["the", " cat", ".", " sat", "?!", "\n", " 4", "2", "e.g", " on", ""]
    ids = [rng.randrange(-2, len(texts) + 2) for _ in range(200)]  # some ids outside the vocabulary
    ends = SentenceEnds.from_texts(texts)
    got = sentence_starts(ids, ends, max_span).tolist()
    assert got == _starts_reference(ids, texts, max_span)
    assert sentence_starts(ids, None, max_span).tolist() == [p // max_span * max_span for p in range(len(ids))]


def test_sentence_starts_rejects_empty_spans():
    with pytest.raises(ValueError, match="max_span"):
        sentence_starts([1, 2], None, 0)
    assert sentence_starts([], None).tolist() == []


def _scores_reference(nats, known, starts):
    sums, counts = {}, {}
    for value, is_known, start in zip(nats, known, starts):
        sums.setdefault(start, 0.0)
        counts.setdefault(start, 0)
        if is_known:
            sums[start] += min(max(value, 0.0), SURPRISAL_CLIP_NATS)
            counts[start] += 1
    means = {s: sums[s] / counts[s] for s in sums if counts[s]}
    if not means:
        return [0.0] * len(nats)
    fallback = sum(means.values()) / len(means)
    per_token = [means.get(s, fallback) for s in starts]
    top = max(per_token)
    return [v / top if top > 0 else 0.0 for v in per_token]


@pytest.mark.parametrize("seed", range(4))
def test_sentence_scores_are_normalised_sentence_means(seed):
    rng = random.Random(seed)
    length = 300
    nats = [rng.expovariate(0.3) if rng.random() > 0.02 else 1e4 for _ in range(length)]  # a few past the clip
    known = [rng.random() > 0.1 for _ in range(length)]
    known[:20] = [False] * 20  # a whole unknown sentence (prefix-cache hits)
    texts = ["w", "."]
    ids = [1 if rng.random() < 0.06 else 0 for _ in range(length)]
    ids[19] = 1  # sentence edge right after the unknown run
    starts = sentence_starts(ids, SentenceEnds.from_texts(texts), 40)
    got = sentence_scores(torch.tensor(nats), torch.tensor(known), torch.from_numpy(starts))
    want = _scores_reference(nats, known, starts.tolist())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-5)
    assert math.isclose(float(got.max()), 1.0, rel_tol=1e-6)


def test_sentence_scores_with_nothing_known_are_zero():
    starts = torch.from_numpy(np.zeros(5, dtype=np.int64))
    got = sentence_scores(torch.ones(5), torch.zeros(5, dtype=torch.bool), starts)
    assert got.tolist() == [0.0] * 5
