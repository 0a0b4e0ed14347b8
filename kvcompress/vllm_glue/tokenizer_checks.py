"""What kvcompress needs from the model's tokenizer: the word edges of its vocabulary
(word-span pooling) and a startup warning where pooling settings are unsafe for it.

The tokenizer is vLLM's own (``vllm.tokenizers.cached_tokenizer_from_config``: same
mode, revision and remote-code setting as the server's); loaded once per process.
"""

from __future__ import annotations

import functools

from vllm.logger import init_logger

from kvcompress.config import FLAGS, KVCompressConfig
from kvcompress.ops.surprisal import SentenceEnds
from kvcompress.ops.word_spans import WordEdges

logger = init_logger(f"vllm.{__name__}")

PROBE_NUMBER = "1234567"
"""A 7-digit number, as in RULER's needles: how many tokens a tokenizer makes of it."""


def _tokenizer(model_config):
    if getattr(model_config, "skip_tokenizer_init", False):
        return None
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


def sentence_ends(model_config) -> SentenceEnds | None:
    """Which of the model's token ids end a sentence; None (with a warning) without a
    tokenizer: the surprisal policy then scores fixed spans of tokens."""
    return _from_vocabulary(
        model_config, SentenceEnds.from_texts,
        "policy 'surprisal' scores fixed spans of tokens instead of sentences",
    )


def word_edges(model_config, rule: str) -> WordEdges | None:
    """The model's :class:`WordEdges` by span ``rule`` (``--kv-compress-word-spans``);
    None (with a warning naming the flag) when the tokenizer cannot be had, e.g.
    ``--skip-tokenizer-init``: word pooling is then off."""
    return _from_vocabulary(
        model_config, functools.partial(WordEdges.from_texts, rule=rule),
        f"{FLAGS['pool_words']} is off: prompt metrics are pooled over tokens only",
    )


def _from_vocabulary(model_config, build, consequence: str):
    """``build(each token id's text)``; None, with a warning ending in ``consequence``,
    when the tokenizer cannot be had (any failure only turns that feature off)."""
    try:
        tokenizer = _tokenizer(model_config)
        if tokenizer is not None:
            return build(_vocabulary_texts(tokenizer))
        reason = "--skip-tokenizer-init is set"
    except Exception as error:  # noqa: BLE001 - only the feature is lost
        reason = f"the tokenizer could not be loaded ({error})"
    logger.warning("kvcompress: %s, so %s", reason, consequence)
    return None


@functools.lru_cache(maxsize=4)
def _vocabulary_texts(tokenizer) -> tuple[str, ...]:
    """Every token id's decoded text (~0.3 s for 49K ids): decoded once per tokenizer,
    whether word pooling, sentence spans or both read it."""
    size = max(len(tokenizer), getattr(tokenizer, "vocab_size", 0))
    return tuple(tokenizer.batch_decode([[i] for i in range(size)]))


def number_tokens(tokenizer) -> int:
    """Tokens the tokenizer makes of :data:`PROBE_NUMBER` after a space."""
    with_space = tokenizer.encode(" " + PROBE_NUMBER, add_special_tokens=False)
    alone = tokenizer.encode(" ", add_special_tokens=False)
    return max(1, len(with_space) - len(alone) if with_space[: len(alone)] == alone else len(with_space))


def pooling_warning(settings: KVCompressConfig, digits_tokens: int) -> str | None:
    """The warning for a server whose policy pools over tokens only while the tokenizer
    cuts a 7-digit number into ``digits_tokens`` tokens, more than the kernel's
    half-width reaches; None when safe."""
    spec = settings.policy_for().metric
    if not settings.compresses or "pool_kernel" not in spec.source.settings_read or spec.pool_words:
        return None
    reach = spec.pool_kernel // 2 + 1  # tokens of a number kept around its best one, one side
    if digits_tokens <= reach:
        return None
    return (
        f"kvcompress: this model's tokenizer cuts the number {PROBE_NUMBER} into "
        f"{digits_tokens} tokens, and policy {settings.policy!r} pools metrics over "
        f"{spec.pool_kernel} tokens without word spans ({FLAGS['pool_kernel']} "
        f"{spec.pool_kernel}, word pooling off): compressed prompts may lose digits of "
        f"numbers and names and answers come out truncated. Pass {FLAGS['pool_words']} "
        "(or use policy 'kvc', where it is the default)."
    )


def warn_if_pooling_unsafe(model_config, settings: KVCompressConfig) -> str | None:
    """Log :func:`pooling_warning` for the server's tokenizer (once, at startup);
    returns the message logged (None: nothing to say or no tokenizer)."""
    try:
        tokenizer = _tokenizer(model_config)
    except Exception:  # noqa: BLE001 - vLLM reports tokenizer problems itself
        return None
    if tokenizer is None:
        return None
    message = pooling_warning(settings, number_tokens(tokenizer))
    if message:
        logger.warning(message)
    return message
