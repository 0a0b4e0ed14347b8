"""Word spans of a prompt, for pooling eviction metrics over whole words (no vLLM).

Many tokenizers split a number into one token per digit (SmolLM, Qwen, Mistral, ...)
and long words into several pieces. Max-pooling metrics over a fixed window of 7
tokens then keeps 2-3 digits around the most attended one and the answer comes out
truncated. Pooling over *word spans* gives every token of a word the word's largest
metric, so a word is kept or evicted whole, whatever the tokenizer.

A word span is a run of tokens with no word boundary between them; two rules
(``--kv-compress-word-spans``) say where a boundary is:

- ``whitespace`` (the default): token ``t`` joins the span of ``t - 1`` when ``t - 1``'s
  text does not end with whitespace and ``t``'s text does not start with it (an empty
  text, a special token, is a boundary). A hyphenated identifier (a UUID: 36
  one-character tokens in SmolLM2's vocabulary) is kept or evicted whole; spans are cut
  every 64 tokens.
- ``alnum``: ``t`` joins ``t - 1`` when ``t - 1``'s text ends with a letter or digit and
  ``t``'s text starts with one (``str.isalnum``; a leading space, punctuation, a special
  token or a partial UTF-8 byte is a boundary); cut every 16 tokens. It splits a UUID at
  each hyphen, and on RULER's UUID needles kvc then kept only its first groups
  (``benchmarks/results/README.md``, RULER).

The cut keeps text without spaces (code, some scripts) from pooling over more than that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

SPAN_RULES = {"whitespace": 64, "alnum": 16}
"""Where a span ends (rule name, ``--kv-compress-word-spans``) -> its longest run (tokens)."""


@dataclass(frozen=True)
class WordEdges:
    """Per vocabulary id, whether its text starts / ends inside a word (by the span rule).

    Attributes:
        starts_in_word: ``[vocab]`` bool.
        ends_in_word: ``[vocab]`` bool.
        max_span: longest span (tokens), the rule's.
    """

    starts_in_word: np.ndarray
    ends_in_word: np.ndarray
    max_span: int

    @classmethod
    def from_texts(cls, token_texts: Sequence[str], rule: str) -> "WordEdges":
        """From each token id's decoded text (``tokenizer.batch_decode([[i] ...])``), by
        ``rule`` (``SPAN_RULES``): ``whitespace`` joins any two tokens with no whitespace
        between them, ``alnum`` a letter or digit to a letter or digit."""
        if rule not in SPAN_RULES:
            raise ValueError(f"word span rule {rule!r}: one of {', '.join(SPAN_RULES)}")
        in_word = str.isalnum if rule == "alnum" else (lambda c: not c.isspace())

        def starts_in(t: str) -> bool:
            return bool(t) and in_word(t[0])

        def ends_in(t: str) -> bool:
            return bool(t) and in_word(t[-1])
        starts = np.fromiter((starts_in(t) for t in token_texts), dtype=bool, count=len(token_texts))
        ends = np.fromiter((ends_in(t) for t in token_texts), dtype=bool, count=len(token_texts))
        return cls(starts, ends, SPAN_RULES[rule])

    @property
    def vocab_size(self) -> int:
        return len(self.starts_in_word)


def span_starts(token_ids: Sequence[int] | np.ndarray, edges: WordEdges, max_span: int | None = None) -> np.ndarray:
    """``[T]`` int64: the position of the first token of the word span holding each token
    (spans cut every ``max_span`` tokens, default ``edges.max_span``).

    Ids outside the vocabulary (added tokens past ``edges``) are boundaries.
    """
    max_span = edges.max_span if max_span is None else max_span
    if max_span < 1:
        raise ValueError(f"max_span must be >= 1, got {max_span}")
    ids = np.asarray(token_ids, dtype=np.int64)
    count = len(ids)
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    known = (ids >= 0) & (ids < edges.vocab_size)
    safe = np.where(known, ids, 0)
    starts_in = edges.starts_in_word[safe] & known
    ends_in = edges.ends_in_word[safe] & known
    joins = np.zeros(count, dtype=bool)
    joins[1:] = ends_in[:-1] & starts_in[1:]
    positions = np.arange(count, dtype=np.int64)
    run_start = np.maximum.accumulate(np.where(joins, 0, positions))
    return run_start + (positions - run_start) // max_span * max_span


def span_max_pool(values: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Every position gets the largest value of its span.

    Args:
        values: ``[H, T]`` metrics in position order (``-inf`` where nothing is held).
        starts: ``[T]`` int64 from :func:`span_starts`.

    Returns:
        ``[H, T]``.
    """
    index = starts.to(values.device).view(1, -1).expand_as(values)
    best = torch.full_like(values, float("-inf")).scatter_reduce_(1, index, values, "amax")
    return best.gather(1, index)
