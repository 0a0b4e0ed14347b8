"""The running batch's rows as arrays, kept while its composition holds.

A decode step of 256 running requests would otherwise look up each request in a few
dicts (its sequence slot, prompt length, whether it compresses): about a microsecond
each, a quarter of a millisecond per fact per step. Between admissions, finishes and
preemptions the same requests decode in the same order, so the rows are built once per
composition (one dict read per row for its slot, the other facts gathered from per-slot
arrays) and each step reads them as arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class BatchRows:
    """Per-row facts of one batch composition.

    Attributes:
        req_ids: the rows' request ids in batch order (what identifies the composition).
        slots: ``[B]`` int64 sequence slot of each row (numpy).
        seq_slots: the same on the cache's device.
        prompt_lens: ``[B]`` int64 prompt tokens of each row's request.
        compresses: ``[B]`` bool, rows whose request is compressed (its decode queries
            may add to the eviction metrics).
    """

    req_ids: tuple[str, ...]
    slots: np.ndarray
    seq_slots: torch.Tensor
    prompt_lens: np.ndarray
    compresses: np.ndarray

    def matches(self, req_ids) -> bool:
        """Whether ``req_ids`` (this step's rows, in order) is this composition."""
        return len(req_ids) == len(self.req_ids) and tuple(req_ids) == self.req_ids

    def decode_only(self, computed: np.ndarray, num_new: np.ndarray) -> bool:
        """Every row is one generated token (past its prompt): no prompt query."""
        return bool(len(num_new)) and bool((num_new == 1).all()) and bool((computed >= self.prompt_lens).all())

    def metric_rows(self, computed: np.ndarray, stride: int) -> np.ndarray:
        """``[M]`` int64 rows whose decode query (at position ``computed``) adds to the
        metrics: compressing requests, every ``stride``-th token."""
        return np.flatnonzero(self.compresses & (computed % stride == 0))
