"""Question-agnostic scores from the prompt's own surprisal (PyTorch + numpy, no vLLM).

A fact nobody has asked about yet (a code, a name, a number inside an essay) is what
the model could not have predicted: its tokens are surprising where the text around
them is not. The prefill computes every prompt token's hidden state anyway; the
logits of position ``t - 1`` give ``-log p(token t | tokens < t)``, the token's
surprisal in nats. Scoring single tokens keeps stray rare words; a question about a
fact needs its whole sentence (the key, the verb, the value). So each prompt KV
scores the *mean* surprisal of its sentence (a span of tokens ending at ``.``, ``?``,
``!`` or a line break, at most ``MAX_SENTENCE_TOKENS`` long), normalised to [0, 1]
over the prompt so the decode metrics added later (attention probabilities) stay
comparable, as with kvzip's scores.

Measured before this was built (a Hugging Face harness, SmolLM2-135M, 20 multi-turn
prompts of 2K tokens, one eviction at rate 8 keeping the same tokens in every head):
the second question answered 14 times where the full cache answered 13 (kvc, which
scores with the first question: 5); the sentence's largest surprisal instead of its
mean: 10; a 31-token max-pool of surprisal: 6. In the engine on 60 prompts at rate 8:
129% of the full cache's score (benchmarks/results/README.md, "Quality")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

SENTENCE_END_CHARS = ".?!\n"
"""A token whose text holds one of these ends its sentence."""
MAX_SENTENCE_TOKENS = 64
"""Longest span scored as one sentence (text without sentence ends is cut there)."""
SURPRISAL_CLIP_NATS = 30.0
"""A token's surprisal counts at most this much toward its sentence's mean (a single
token the model gave no probability at all does not carry a whole sentence)."""
LOGIT_ROWS_PER_CHUNK = 256
"""Prompt positions whose logits are held at once (``[rows, vocab]`` float32)."""


@dataclass(frozen=True)
class SentenceEnds:
    """Per vocabulary id, whether its text ends a sentence.

    Attributes:
        ends_sentence: ``[vocab]`` bool.
    """

    ends_sentence: np.ndarray

    @classmethod
    def from_texts(cls, token_texts: Sequence[str]) -> "SentenceEnds":
        """From each token id's decoded text."""
        ends = np.fromiter(
            (any(c in text for c in SENTENCE_END_CHARS) for text in token_texts), dtype=bool, count=len(token_texts),
        )
        return cls(ends)


def sentence_starts(
    token_ids: Sequence[int] | np.ndarray, ends: SentenceEnds | None, max_span: int = MAX_SENTENCE_TOKENS,
) -> np.ndarray:
    """``[T]`` int64: the position of the first token of the sentence holding each token.

    A token after one that ends a sentence starts a new one; spans are cut every
    ``max_span`` tokens. Without ``ends`` (no tokenizer) every span is ``max_span``
    tokens. Ids outside the vocabulary end nothing.
    """
    if max_span < 1:
        raise ValueError(f"max_span must be >= 1, got {max_span}")
    ids = np.asarray(token_ids, dtype=np.int64)
    count = len(ids)
    positions = np.arange(count, dtype=np.int64)
    if count == 0:
        return positions
    new = np.zeros(count, dtype=bool)
    new[0] = True
    if ends is not None:
        vocab = len(ends.ends_sentence)
        known = (ids >= 0) & (ids < vocab)
        ended = ends.ends_sentence[np.where(known, ids, 0)] & known
        new[1:] = ended[:-1]
    run_start = np.maximum.accumulate(np.where(new, positions, 0))
    return run_start + (positions - run_start) // max_span * max_span


def token_surprisal(hidden: torch.Tensor, next_ids: torch.Tensor, logits_of) -> torch.Tensor:
    """``-log p(next_ids[i] | hidden[i])`` in nats, ``[n]`` float32.

    Args:
        hidden: ``[n, hidden_size]`` final hidden states of consecutive prompt positions.
        next_ids: ``[n]`` int64, the token that follows each position.
        logits_of: maps ``[rows, hidden_size]`` to ``[rows, vocab]`` logits (the model's
            head); called on at most ``LOGIT_ROWS_PER_CHUNK`` rows at a time.
    """
    out = torch.empty(len(next_ids), dtype=torch.float32, device=hidden.device)
    for start in range(0, len(next_ids), LOGIT_ROWS_PER_CHUNK):
        end = min(len(next_ids), start + LOGIT_ROWS_PER_CHUNK)
        logits = logits_of(hidden[start:end])
        if logits is None:  # a head that gathers its logits to one rank only
            raise RuntimeError("the model's head returned no logits on this rank: the surprisal policy needs them on every rank")
        logits = logits.float()
        chosen = logits.gather(1, next_ids[start:end].to(logits.device).view(-1, 1)).squeeze(1)
        out[start:end] = torch.logsumexp(logits, dim=1) - chosen
    return out


def sentence_scores(surprisal: torch.Tensor, known: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Each prompt token's score: its sentence's mean surprisal over the tokens whose
    surprisal is known, divided by the prompt's largest such mean (values in [0, 1]).

    Args:
        surprisal: ``[T]`` float nats (any value where not ``known``).
        known: ``[T]`` bool, positions whose surprisal was computed (the first token
            has none; prefix-cached tokens were not run).
        starts: ``[T]`` int64 from :func:`sentence_starts`.

    Returns:
        ``[T]`` float32. A sentence with no known token scores the mean of the others
        (0 when nothing is known).
    """
    starts = starts.to(surprisal.device)
    values = torch.where(known, surprisal.float().clamp(0, SURPRISAL_CLIP_NATS), torch.zeros_like(surprisal, dtype=torch.float32))
    total = torch.zeros(len(values), dtype=torch.float32, device=values.device).index_add_(0, starts, values)
    count = torch.zeros_like(total).index_add_(0, starts, known.float())
    has = count > 0
    if not bool(has.any()):
        return torch.zeros_like(total)
    mean = torch.where(has, total / count.clamp_min(1), torch.zeros_like(total))
    fallback = mean[has].mean()
    per_token = torch.where(has[starts], mean[starts], fallback)
    top = per_token.max()
    return per_token / top if bool(top > 0) else torch.zeros_like(per_token)
