"""Decode queries kept per sequence until several can share one metric pass.

On vLLM's CPU kernel the decode-time eviction metrics are a pass of their own
(:func:`kvcompress.ops.metrics.decode_metrics_by_head`): it copies every page a head
holds to score a handful of queries, and the copy and the per-op overhead, not the
arithmetic, set its cost (one query set of a 4-layer step: 0.26 ms; four: 0.41 ms). So a
sequence's metric queries wait here, all layers of each, until it has ``batch`` of them;
then one pass scores them together, with those of every other sequence of the step that
holds some (:meth:`DecodeStepMetrics.run <kvcompress.ops.cpu_attention.DecodeStepMetrics.run>`):
sequences reach their ``batch``-th query at different steps (each queries every
``decode_metric_stride``-th position of its own), and a pass for each would cost one
pass's ops per sequence phase. Sequences holding fewer queries than the most are padded
with a copy of their last query at weight 0 (``query_weights``), so one pass serves all.

Deferring changes nothing the eviction reads. A decode query sees the KVs its head
held in its own step: those at positions up to its own (KVs are appended in position
order), and a head loses KVs only when its sequence is compressed. So the pass masks
later positions (``query_positions``), and the pending queries of a sequence are scored
(:meth:`DeferredDecodeQueries.flush`) before anything reads or evicts its metrics: a
compression, a test's record of them. A sequence released (finished, preempted) drops
them: nothing reads its metrics any more. ``tests/test_deferred_metrics.py`` checks the
result against the pass run every step.

Memory: ``batch`` queries of every layer per sequence with pending queries,
``batch * L * Hq * D`` of the model's dtype (tiny model 32 KiB, SmolLM2-135M 276 KiB in
float32), outside the KV budget like the step's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.ops.kv_pool import KVPool

DEFAULT_BATCH = 4
"""Query sets a sequence gathers before its pass (4: the pass costs 1.6x one set's)."""


@dataclass
class _Pending:
    queries: torch.Tensor  # [batch, L, Hq, D]
    positions: np.ndarray  # [batch] int64
    count: int = 0


class DeferredDecodeQueries:
    """Per sequence slot, decode queries (every layer) not yet added to the metrics.

    Args:
        batch: queries a slot gathers before its pass (1: score at once).
    """

    def __init__(self, batch: int = DEFAULT_BATCH) -> None:
        if batch < 1:
            raise ValueError(f"DeferredDecodeQueries: batch must be >= 1, got {batch}")
        self.batch = batch
        self._pending: dict[int, _Pending] = {}
        self._scale: float | None = None
        self._power: int | None = None
        self.passes = 0  # metric passes run (for tests and stats)

    def __contains__(self, slot: int) -> bool:
        return slot in self._pending and self._pending[slot].count > 0

    def add(
        self, slots: np.ndarray, positions: np.ndarray, queries: torch.Tensor, scale: float, power: int,
    ) -> np.ndarray:
        """Keep one decode query per slot.

        Args:
            slots: ``[M]`` sequence slots (distinct); positions: ``[M]`` their queries'
                token positions.
            queries: ``[L, M, Hq, D]`` the queries of every layer.
            scale, power: the pass's softmax scale and metric power (the same for
                every query the object holds).

        Returns:
            Indices into ``slots`` of those now holding ``batch`` queries (due for
            :meth:`flush`).
        """
        if self._scale is None:
            self._scale, self._power = scale, power
        elif (scale, power) != (self._scale, self._power):
            raise ValueError("DeferredDecodeQueries: every query must share one scale and metric power")
        full = []
        for index, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
            pending = self._pending.get(slot)
            if pending is None:
                shape = (self.batch, *queries.shape[:1], *queries.shape[2:])
                pending = self._pending[slot] = _Pending(
                    torch.empty(shape, dtype=queries.dtype, device=queries.device), np.zeros(self.batch, np.int64),
                )
            pending.queries[pending.count].copy_(queries[:, index])
            pending.positions[pending.count] = position
            pending.count += 1
            if pending.count == self.batch:
                full.append(index)
        return np.asarray(full, dtype=np.int64)

    def flush(
        self, pool: KVPool, slots: list[int], block_tables: torch.Tensor, head_lens: torch.Tensor,
    ) -> None:
        """Add the pending queries of ``slots`` to ``pool.slot_metrics`` and forget them:
        one pass for all of them, whatever each holds (fewer than the most: padded with
        a copy of its last query at weight 0).

        Args:
            slots: sequence slots (those with nothing pending are skipped).
            block_tables: ``[L, n, H, P]`` page ids of each slot's heads now.
            head_lens: ``[L, n, H]`` KVs each of those heads holds now.
        """
        indices = [index for index, slot in enumerate(slots) if slot in self]
        if not indices:
            return
        pending = [self._pending[slots[i]] for i in indices]
        counts = [p.count for p in pending]
        most = max(counts)
        queries = torch.stack([p.queries[:most] for p in pending])  # [n, most, L, Hq, D]
        positions = np.stack([p.positions[:most] for p in pending])
        weights = None
        if min(counts) < most:
            weights = torch.zeros((len(pending), most), dtype=torch.float32)
            for row, count in enumerate(counts):
                weights[row, :count] = 1.0
                # Copies of a real query at its position: finite scores, so weight 0
                # adds exactly nothing.
                queries[row, count:] = queries[row, count - 1]
                positions[row, count:] = positions[row, count - 1]
        chosen = torch.tensor(indices, dtype=torch.int64)
        self._score(
            pool, queries, torch.from_numpy(positions), block_tables[:, chosen], head_lens[:, chosen], weights,
        )
        for p in pending:
            p.count = 0

    def _score(
        self, pool: KVPool, queries: torch.Tensor, positions: torch.Tensor,
        block_tables: torch.Tensor, head_lens: torch.Tensor, weights: torch.Tensor | None = None,
    ) -> None:
        """One pass: ``queries [n, c, L, Hq, D]`` at ``positions [n, c]`` (weighted by
        ``weights [n, c]``, None: all 1) over the heads of ``block_tables [L, n, H, P]`` /
        ``head_lens [L, n, H]``."""
        from kvcompress.ops.metrics import decode_metrics_by_head

        num_seqs, count, num_layers, num_q_heads, head_dim = queries.shape
        num_kv_heads = block_tables.shape[2]
        group = num_q_heads // num_kv_heads
        # Head-sequence (layer, seq, KV head) gets its c x G queries (query c, group g).
        per_head = queries.view(num_seqs, count, num_layers, num_kv_heads, group, head_dim)
        per_head = per_head.permute(2, 0, 3, 1, 4, 5).reshape(-1, count * group, head_dim)
        query_positions = positions.view(1, num_seqs, 1, count, 1).expand(
            num_layers, num_seqs, num_kv_heads, count, group
        ).reshape(-1, count * group)
        query_weights = None
        if weights is not None:
            query_weights = weights.view(1, num_seqs, 1, count, 1).expand(
                num_layers, num_seqs, num_kv_heads, count, group
            ).reshape(-1, count * group)
        decode_metrics_by_head(
            per_head, pool, block_tables.reshape(-1, block_tables.shape[-1]), head_lens.reshape(-1),
            self._scale, self._power, query_positions=query_positions, query_weights=query_weights,
        )
        self.passes += 1

    def drop(self, slots) -> None:
        """Forget the pending queries of released ``slots`` (their metrics are never read)."""
        for slot in slots:
            self._pending.pop(int(slot), None)


class StepDecodeQueries:
    """The metric rows' decode queries of a step that also has prompt rows, kept layer
    by layer during the forward, for :class:`DeferredDecodeQueries` after it (a decode
    row riding in a prompt step then costs what it costs in a decode step: no metric
    pass of its own at every layer).

    Args:
        token_rows: ``[M]`` int64 the rows' query tokens in the step's ``[T, Hq, D]``.
        slots: ``[M]`` their sequence slots; positions: ``[M]`` their queries' positions.
        num_layers: layers that record (each once, in any order).
    """

    def __init__(self, token_rows: torch.Tensor, slots: np.ndarray, positions: np.ndarray, num_layers: int) -> None:
        self.token_rows = token_rows
        self.slots = slots
        self.positions = positions
        self.num_layers = num_layers
        self.queries: torch.Tensor | None = None  # [L, M, Hq, D], allocated at the first record
        self.scale: float | None = None
        self.layers_recorded = 0

    def record(self, layer: int, query: torch.Tensor, scale: float) -> None:
        """Keep layer ``layer``'s queries of the rows (``query [T, Hq, D]``, ``scale`` its
        softmax scale)."""
        if self.queries is None:
            self.queries = torch.empty(
                (self.num_layers, self.token_rows.shape[0], *query.shape[1:]), dtype=query.dtype, device=query.device,
            )
        torch.index_select(query, 0, self.token_rows, out=self.queries[layer])
        self.scale = scale
        self.layers_recorded += 1

    @property
    def complete(self) -> bool:
        """Every layer recorded (a forward that did not run every layer hands nothing on)."""
        return self.layers_recorded == self.num_layers

    def hand_to(self, deferred: DeferredDecodeQueries, power: int) -> np.ndarray:
        """Give the queries to ``deferred``; returns the indices of ``slots`` now due
        for its flush (:meth:`DeferredDecodeQueries.add`)."""
        assert self.complete and self.queries is not None and self.scale is not None
        return deferred.add(self.slots, self.positions, self.queries, self.scale, power)
