"""The running batch's rows as arrays, kept while its composition holds.

A decode step of 256 running requests would otherwise look up each request in a few
dicts (its sequence slot, prompt length, whether it compresses): about a microsecond
each, a quarter of a millisecond per fact per step. Between admissions, finishes and
preemptions the same requests decode in the same order, so the rows are built once per
composition (one dict read per row for its slot, the other facts gathered from per-slot
arrays) and each step reads them as arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)
class BatchRows:
    """Per-row facts of one batch composition.

    Attributes:
        req_ids: the rows' request ids in batch order (what identifies the composition).
        slots: ``[B]`` int64 sequence slot of each row (numpy).
        seq_slots: the same on the cache's device.
        prompt_lens: ``[B]`` int64 prompt tokens of each row's request.
        compresses: ``[B]`` bool, rows whose request is compressed (its decode queries
            may add to the eviction metrics).
        grown: ``[B]`` int64 tokens each row's heads were grown for: the runner's
            per-slot count, kept here while the composition holds (one array op a step
            fewer) and written back when it ends.
        any_compresses: some row is compressed.
    """

    req_ids: tuple[str, ...]
    slots: np.ndarray
    seq_slots: torch.Tensor
    prompt_lens: np.ndarray
    compresses: np.ndarray
    grown: np.ndarray
    any_compresses: bool = field(init=False)
    # Once every row is past its prompt it stays so while the composition holds.
    _past_prompts: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.any_compresses = bool(self.compresses.any())

    def matches(self, req_ids) -> bool:
        """Whether ``req_ids`` (this step's rows, in order) is this composition."""
        return len(req_ids) == len(self.req_ids) and tuple(req_ids) == self.req_ids

    def past_prompts(self, computed: np.ndarray) -> bool:
        """Every row's next token (at ``computed``) is a generated one: no prompt query."""
        if not self._past_prompts:
            self._past_prompts = bool(len(computed)) and bool((computed >= self.prompt_lens).all())
        return self._past_prompts

    def decode_only(self, computed: np.ndarray, num_new: np.ndarray) -> bool:
        """Every row is one generated token (past its prompt): no prompt query."""
        return bool(len(num_new)) and bool((num_new == 1).all()) and self.past_prompts(computed)

    def metric_rows(self, computed: np.ndarray, stride: int) -> np.ndarray:
        """``[M]`` int64 rows whose decode query (at position ``computed``) adds to the
        metrics: compressing requests, every ``stride``-th token."""
        if not self.any_compresses:
            return _NO_ROWS
        return np.flatnonzero(self.compresses & (computed % stride == 0))


_NO_ROWS = np.zeros(0, np.int64)
