"""The reconstruction pass of ``kvzip`` requests: question-agnostic eviction metrics.

A request whose policy's metric source is ``ReconstructionScores`` (this module's
:class:`ReconstructionPass` is that scoring kind's glue) has no prompt query score its keys. Instead, at the end of the step in which its prompt finished
prefilling (before the scheduler can order it compressed), the model runner runs
the model once more per chunk of the prompt: scoring tokens (the instruction
``REPEAT_INSTRUCTION``, then the chunk) placed right after the cached KVs. Their attention
(``kvcompress.ops.reconstruction``) reads the request's pages and themselves and
writes nothing to the cache; each cached KV keeps the largest probability a
scoring query gave it. The scores become the request's slot metrics, pooled as its
policy says, and the block-eviction schedule ranks them like any other metrics.

Cost: one extra forward over the prompt (plus the instruction per chunk) for every
such request; its attention is the PyTorch reference's (the scores need the
probabilities). Chunks are at most ``max_num_batched_tokens`` tokens, so the
forward's activations stay within what vLLM profiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from kvcompress.ops.metrics import accumulate_metrics, pool_metrics
from kvcompress.policies import MetricSpec
from kvcompress.vllm_glue.attention_backend import KVCompressAttentionMetadata
from kvcompress.vllm_glue.scoring_kind import PromptChunk, ScoringContext, ScoringKindGlue
from kvcompress.vllm_glue.step import ReconstructionStep, StepTables

logger = init_logger(f"vllm.{__name__}")

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly.\n\n"
"""What the scoring tokens of each chunk start with (KVzip's prompt)."""
CHUNK_TOKENS = 1024
"""Prompt tokens repeated per forward (fewer if ``max_num_batched_tokens`` is lower)."""


@dataclass(frozen=True)
class PendingReconstruction:
    """A request whose prompt finished prefilling this step.

    Attributes:
        request_id: the request.
        seq_slot: its row in the cache's tables.
        context: the token ids its cached KVs hold, in position order.
        spec: its policy's metric settings (pooling).
        word_starts: ``[len(context)]`` int64 first position of each token's word span
            (None: pooling over tokens only).
    """

    request_id: str
    seq_slot: int
    context: list[int]
    spec: MetricSpec
    word_starts: torch.Tensor | None = None


def instruction_ids(model_config) -> list[int]:
    """``REPEAT_INSTRUCTION`` in the model's tokens (:func:`instruction_for`); empty
    (with a warning) without a tokenizer: the scoring tokens are then the chunk alone."""
    if not getattr(model_config, "skip_tokenizer_init", False):
        try:
            from vllm.tokenizers import cached_tokenizer_from_config

            return instruction_for(cached_tokenizer_from_config(model_config))
        except Exception as error:  # noqa: BLE001 - only the instruction is lost
            reason = f"the tokenizer could not be loaded or used ({error})"
    else:
        reason = "--skip-tokenizer-init is set"
    logger.warning("kvcompress: %s, so the kvzip reconstruction pass repeats prompts without an instruction", reason)
    return []


def instruction_for(tokenizer) -> list[int]:
    """``REPEAT_INSTRUCTION`` as ``tokenizer``'s ids, as plain text. Measured against a
    user turn in the model's chat format (SmolLM2, 20 samples each, rate 8): multi-turn
    needles 77% of full either way (69% vs 77% on another 20), perplexity windows 71%
    vs 49% of full (raw text, where a chat turn is out of place)."""
    return list(tokenizer.encode(REPEAT_INSTRUCTION, add_special_tokens=False))


def pending_reconstruction(chunk: PromptChunk) -> PendingReconstruction | None:
    """The reconstruction of a request whose prompt ends in ``chunk``: the KVs it holds
    after this step (its prompt, and its outputs when it resumes after a preemption);
    None, with a warning, for prompt embeddings (no tokens to repeat: its KVs keep the
    decode metrics only)."""
    num_cached = chunk.first + chunk.count
    state = chunk.vllm_state
    context = [*(state.prompt_token_ids or ()), *state.output_token_ids][:num_cached]
    if len(context) < num_cached:
        logger.warning(
            "kvcompress: request %s has prompt embeddings, which the kvzip reconstruction "
            "pass cannot repeat: its KVs are ranked without reconstruction scores", chunk.request_id,
        )
        return None
    spec = chunk.request.compression.policy.metric
    words = chunk.word_starts() if spec.pool_words else None
    return PendingReconstruction(chunk.request_id, chunk.request.seq_slot, context, spec, words)


class ReconstructionPass(ScoringKindGlue):
    """The glue of ``ReconstructionScores`` (kvzip): queues each request whose prompt
    finishes prefilling and runs its reconstruction pass after the step's forward."""

    recorded_as = "reconstruction_scores"  # the pass's raw scores, [L][H][KV]

    def __init__(self, context: ScoringContext) -> None:
        super().__init__(context)
        self.runner = context.runner  # its model forward (``_model_forward``) and vLLM's config
        self.state = context.state
        self.layer_names = context.layer_names
        config = self.runner.vllm_config
        self.max_model_len = config.model_config.max_model_len
        self.max_tokens = config.scheduler_config.max_num_batched_tokens
        self._instruction: list[int] | None = None
        self.pending: list[PendingReconstruction] = []

    def instruction(self) -> list[int]:
        if self._instruction is None:
            self._instruction = instruction_ids(self.runner.vllm_config.model_config)
        return self._instruction

    def prompt_rows(self, chunk: PromptChunk) -> None:
        """Queue the request when this chunk ends its prompt; no prompt query scores keys."""
        if chunk.first + chunk.count < chunk.prompt_len:
            return None
        pending = pending_reconstruction(chunk)
        if pending is not None:
            self.pending.append(pending)
        return None

    def after_forward(self) -> None:
        pending, self.pending = self.pending, []
        if pending:
            self.run(pending)

    @torch.inference_mode()
    def run(self, pending: list[PendingReconstruction]) -> None:
        """Score every pending request's KVs and write them as its slot metrics."""
        for request in pending:
            self._score(request)

    def _score(self, request: PendingReconstruction) -> None:
        state = self.state
        cache = state.cache
        num_cached = len(request.context)
        slots = torch.tensor([request.seq_slot], dtype=torch.int64, device=cache.device)
        tables, _ = StepTables.for_rows(cache, slots, np.array([num_cached]))
        step = ReconstructionStep(
            tables=tables,
            head_lens=cache.head_lens[request.seq_slot],
            scores=torch.zeros(
                (cache.num_layers, cache.num_kv_heads, tables.num_pages * cache.block_size),
                dtype=torch.float32, device=cache.device,
            ),
        )
        instruction = self.instruction()
        chunk = max(1, min(CHUNK_TOKENS, self.max_tokens - len(instruction)))
        for start in range(0, num_cached, chunk):
            self._forward(step, instruction + request.context[start : start + chunk], num_cached)
        if self.recording is not None:
            self.recording[request.request_id] = step.scores[:, :, :num_cached].clone()
        pool, spec = state.pool, request.spec
        for layer in range(cache.num_layers):
            meta_tables, lens = pool.meta_tables(tables.layer(layer)[0]), step.head_lens[layer]
            accumulate_metrics(pool.slot_metrics, meta_tables, lens, step.scores[layer])
            pool_metrics(pool.slot_metrics, meta_tables, lens, spec.pool_kernel, spec.pool, request.word_starts)

    def _forward(self, step: ReconstructionStep, token_ids: list[int], first_position: int) -> None:
        """One chunk's forward, its tokens at ``first_position`` on (moved back so the
        last stays inside ``max_model_len``: the rotary tables end there)."""
        runner = self.runner
        device = step.head_lens.device
        num_tokens = len(token_ids)
        first_position = max(0, min(first_position, self.max_model_len - num_tokens))
        metadata = KVCompressAttentionMetadata(num_actual_tokens=num_tokens, step=step)
        with set_forward_context({name: metadata for name in self.layer_names}, runner.vllm_config, num_tokens=num_tokens):
            runner._model_forward(
                input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
                positions=torch.arange(first_position, first_position + num_tokens, device=device),
                intermediate_tensors=None,
                inputs_embeds=None,
            )
