"""Decode metrics: what decode queries add to the eviction metrics, and one owner of when.

What: each decode query adds ``softmax(q . K * scale) ** power``, summed over its query
group, into ``pool.slot_metrics`` at the slots its head holds (positions up to its own).
:func:`decode_metrics_by_head` is the one torch definition (:func:`decode_metrics` its
per-row view; the reference attention calls it), which every kernel is tested against.

When: CUDA and Triton add them during the forward. On vLLM's CPU kernel the pass costs
the copy of every page a head holds, so a sequence's queries wait in
:class:`DeferredDecodeQueries` until it has a few, then one pass scores those of every
row holding some. That changes nothing the eviction reads: each query is masked to the
KVs of its own step, and pending queries are scored before a compression reads them
(``tests/test_deferred_metrics.py``). :class:`DecodeMetrics` is the one object the
runner and step planner call: record, after_forward, flush, drop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.ops.kv_pool import KVPool, gather_pages
from kvcompress.ops.page_tables import decode_tables


def decode_metrics(query: torch.Tensor, pool, block_tables: torch.Tensor, head_lens: torch.Tensor,
                   scale: float, power: int = 2, query_positions: torch.Tensor | None = None) -> None:
    """Decode queries add their attention to the eviction metrics: the per-row view of
    :func:`decode_metrics_by_head` (one query per row, every KV head of the layer).

    Each row's query sees the KVs its heads hold (up to its own position if given) and
    adds ``softmax(q . K * scale) ** power``, summed over the query group, into
    ``pool.slot_metrics`` at those slots.

    Args:
        query: ``[B, num_q_heads, D]`` one decode query per row.
        pool: a :class:`~kvcompress.ops.kv_pool.KVPool` (K ``[num_pages, b, D]``, any
            strides; ``slot_metrics [num_pages, b]`` float32, added to in place).
        block_tables: ``[B, num_kv_heads, P]`` this layer's page ids of each row.
        head_lens: ``[B, num_kv_heads]`` KVs held per head.
        scale: softmax scale; power: 2 (L2) or 1 (L1).
        query_positions: ``[B]`` each query's token position (None: the newest token,
            which sees every KV its heads hold).
    """
    rows, num_kv_heads, num_pages = block_tables.shape
    if rows == 0:
        return
    group = query.shape[1] // num_kv_heads
    if query_positions is not None:
        query_positions = query_positions.view(rows, 1, 1).expand(rows, num_kv_heads, group).reshape(-1, group)
    decode_metrics_by_head(
        query.reshape(rows * num_kv_heads, group, query.shape[2]), pool,
        block_tables.reshape(rows * num_kv_heads, num_pages), head_lens.reshape(-1), scale, power,
        query_positions=query_positions,
    )


def decode_metrics_by_head(
    query: torch.Tensor,
    pool,
    block_tables: torch.Tensor,
    head_lens: torch.Tensor,
    scale: float,
    power: int = 2,
    max_pages_per_pass: int = 4096,
    query_positions: torch.Tensor | None = None,
    query_weights: torch.Tensor | None = None,
) -> None:
    """``decode_metrics`` over head-sequences of any layers at once, reading only the
    pages each head holds (no padding to the longest head).

    Head-sequence ``s`` is one (layer, row, KV head) of a decode step: its query group
    sees every KV the head holds (a decode query is the newest token) and adds
    ``softmax(q . K * scale) ** power``, summed over the group, into
    ``pool.slot_metrics`` at those slots. The softmax runs per page and is joined per
    head (segment max and sum), so one pass serves every layer of a step.

    Args:
        query: ``[S, G, D]`` the query group of each head-sequence.
        pool: a :class:`~kvcompress.ops.kv_pool.KVPool` (K ``[num_pages, b, D]``, any
            strides; ``slot_metrics [num_pages, b]`` float32, added to in place).
        block_tables: ``[S, P]`` page ids (int32 or int64) of each head-sequence.
        head_lens: ``[S]`` KVs held per head-sequence.
        scale: softmax scale; power: 2 (L2) or 1 (L1).
        max_pages_per_pass: pages gathered at once (bounds the key copy to
            ``max_pages_per_pass * b * D`` float32; whole heads per pass, at least one).
        query_positions: ``[S, G]`` token position of each query, for queries kept
            from earlier steps (:class:`DeferredDecodeQueries`): a query sees
            only the KVs at positions up to its own (``pool.slot_positions``), as in
            its own step. None: every query sees every KV the head holds.
        query_weights: ``[S, G]`` float32 factor on each query's contribution (0 for
            a padding query: head-sequences with fewer real queries than ``G`` share
            one pass). None: every query counts once.
    """
    num_heads, num_pages = block_tables.shape
    if num_heads == 0:
        return
    block_size = pool.key_cache.shape[1]
    pages_held = (head_lens.long() + block_size - 1) // block_size  # [S]
    if int(pages_held.max()) > num_pages:
        raise ValueError("decode_metrics_by_head: a head holds more KVs than its page table row")
    ends = torch.cumsum(pages_held, 0).tolist()
    if ends[-1] <= max_pages_per_pass:
        _decode_metrics_heads(
            query, pool, block_tables, head_lens, pages_held, scale, power, query_positions, query_weights,
        )
        return
    start_head, start_page = 0, 0
    for head, end_page in enumerate(ends):
        last = head == num_heads - 1
        if last or ends[head + 1] - start_page > max_pages_per_pass:
            _decode_metrics_heads(
                query[start_head : head + 1], pool, block_tables[start_head : head + 1],
                head_lens[start_head : head + 1], pages_held[start_head : head + 1], scale, power,
                None if query_positions is None else query_positions[start_head : head + 1],
                None if query_weights is None else query_weights[start_head : head + 1],
            )
            start_head, start_page = head + 1, end_page


def _decode_metrics_heads(
    query, pool, block_tables, head_lens, pages_held, scale, power, query_positions=None, query_weights=None,
) -> None:
    """One pass of :func:`decode_metrics_by_head` over whole heads."""
    num_heads = block_tables.shape[0]
    group = query.shape[1]
    key_cache = pool.key_cache
    block_size = key_cache.shape[1]
    device = block_tables.device
    head_of_page, page_ids, past_end = _held_pages(block_tables, head_lens, pages_held, block_size)
    if head_of_page.numel() == 0:
        return
    # K as [D, b] per page: vLLM's CPU layout stores it so (a copy of whole pages).
    keys = gather_pages(key_cache.transpose(1, 2), page_ids).float()  # [N, D, b]
    rows = pool.meta_index(page_ids)  # the pages' metadata rows
    scores = torch.bmm(query.float().mul(scale).index_select(0, head_of_page), keys)  # [N, G, b]
    if query_positions is None:
        scores.masked_fill_(past_end.unsqueeze(1), float("-inf"))
    else:  # [N, G, b]: later KVs than a query's own are not in its softmax
        later = (pool.slot_positions.index_select(0, rows).unsqueeze(1)
                 > query_positions.index_select(0, head_of_page).unsqueeze(-1))
        scores.masked_fill_(later.logical_or_(past_end.unsqueeze(1)), float("-inf"))
    head_max = torch.full((num_heads, group), float("-inf"), device=device).scatter_reduce_(
        0, head_of_page.unsqueeze(-1).expand(-1, group), scores.amax(dim=2), "amax",
    )
    probs = torch.exp_(scores.sub_(head_max.index_select(0, head_of_page).unsqueeze(-1)))
    totals = torch.zeros((num_heads, group), device=device).index_add_(0, head_of_page, probs.sum(dim=2))
    probs.div_(totals.index_select(0, head_of_page).unsqueeze(-1))
    if power != 1:
        probs.pow_(power)
    if query_weights is None:
        gained = probs.sum(dim=1)  # [N, b]
    else:  # [N, 1, G] @ [N, G, b]: padding queries (weight 0) add nothing
        gained = torch.bmm(query_weights.index_select(0, head_of_page).unsqueeze(1), probs).squeeze(1)
    pool.slot_metrics.index_add_(0, rows, gained.to(pool.slot_metrics.dtype))


def _held_pages(
    block_tables: torch.Tensor, head_lens: torch.Tensor, pages_held: torch.Tensor, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every page the heads hold, flattened: ``([N] head of each page, [N] int64 page id,
    [N, b] bool slot past its head's end)``. On CPU built in numpy: a pass is a few
    dozen small ops, and torch's ``nonzero`` and 2-D indexing there cost 10-100 us each."""
    if block_tables.device.type == "cpu":
        held = pages_held.numpy()
        head_of_page = np.repeat(np.arange(held.shape[0]), held)
        page_index = np.arange(head_of_page.shape[0]) - np.repeat(np.cumsum(held) - held, held)
        page_ids = block_tables.numpy()[head_of_page, page_index].astype(np.int64)
        slot = page_index[:, None] * block_size + np.arange(block_size)
        past_end = slot >= head_lens.numpy()[head_of_page][:, None]
        return torch.from_numpy(head_of_page), torch.from_numpy(page_ids), torch.from_numpy(past_end)
    device = block_tables.device
    held = torch.arange(block_tables.shape[1], device=device) < pages_held.unsqueeze(-1)  # [S, P]
    head_of_page, page_index = held.nonzero(as_tuple=True)
    slot = page_index.unsqueeze(-1) * block_size + torch.arange(block_size, device=device)
    past_end = slot >= head_lens.long()[head_of_page].unsqueeze(-1)
    return head_of_page, block_tables[head_of_page, page_index].long(), past_end


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


@dataclass(eq=False)
class DecodeMetrics:
    """When the decode queries of one page pool add to its metrics.

    ``queue``: the per-sequence queue (vLLM's CPU kernel); None where the attention
    backend adds them during the forward (then ``flush`` and ``drop`` have nothing to
    do). ``power``: the server policy's decode metric power (1 or 2). ``cache``: the
    pool's :class:`~kvcompress.ops.paged_cache.PerHeadPagedCache` (not imported here:
    it imports the backends, which import this module)."""

    cache: object
    pool: KVPool
    power: int
    queue: DeferredDecodeQueries | None
    # A step with prompt rows: its decode rows' queries, recorded layer by layer.
    step_queries: StepDecodeQueries | None = None

    def start_step(self) -> None:
        """A new step: nothing recorded yet."""
        self.step_queries = None

    def record_step(self, queries: StepDecodeQueries | None) -> None:
        """The decode rows' queries of a step with prompt rows (the attention backend
        records each layer's into it; :meth:`after_forward` hands them to the queue)."""
        self.step_queries = queries

    def record_kernel_step(self, step_metrics, batch_slots: np.ndarray, positions: np.ndarray) -> None:
        """A decode step on vLLM's CPU kernel: its pass (``cpu_attention.DecodeStepMetrics``,
        None: no metric row) queues its queries instead of scoring them (``batch_slots
        [B]`` the rows' sequence slots, ``positions [M]`` the metric rows' positions)."""
        if step_metrics is not None and self.queue is not None:
            step_metrics.defer(self.queue, batch_slots, positions)

    def after_forward(self, batch_slots: np.ndarray | None) -> None:
        """After a step with prompt rows ran: its decode rows' queries join the queue;
        if one of them is due, every row of the batch (``batch_slots``) with pending
        queries is scored, as a decode step does."""
        recorded, self.step_queries = self.step_queries, None
        if recorded is None or not recorded.complete or self.queue is None:
            return  # no forward ran (nothing written, nothing to score)
        if recorded.hand_to(self.queue, self.power).size and batch_slots is not None:
            self.flush(batch_slots.tolist())

    def flush(self, slots: list[int]) -> None:
        """Score the queries still pending for ``slots`` (before their metrics are read
        or their KVs evicted)."""
        queue = self.queue
        slots = [slot for slot in slots if queue is not None and slot in queue]
        if not slots:
            return
        cache = self.cache
        rows = np.asarray(slots, dtype=np.int64)
        tables, lens = decode_tables(cache.block_size, cache.tables, rows, cache.host.head_lens[rows])
        num_layers = tables.shape[0]
        queue.flush(
            self.pool, slots,
            torch.from_numpy(tables).view(num_layers, len(slots), lens.shape[2], -1), torch.from_numpy(lens),
        )

    def drop(self, slots) -> None:
        """Forget the pending queries of released ``slots``."""
        if self.queue is not None:
            self.queue.drop(slots)
