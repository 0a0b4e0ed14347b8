"""Deferred decode metrics (kvcompress/ops/decode_metrics.py) against the metric pass
run in every step: the same slot metrics, whatever the batch of queries per pass, the
steps a sequence adds a query in, or when a compression flushes it early."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompress.ops import KVPool
from kvcompress.ops.cpu_attention import pool_views
from kvcompress.ops.decode_metrics import DeferredDecodeQueries, decode_metrics_by_head


class GrowingCache:
    """Sequences whose heads hold a random kept subset of their first ``context``
    positions (as a compression leaves them), then one new KV per head per step."""

    def __init__(self, num_seqs, num_layers, num_kv_heads, head_dim, block_size, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.shape = (num_layers, num_seqs, num_kv_heads)
        num_pages = 600
        buffer = torch.randn((2, num_pages, block_size, head_dim), generator=self.gen)
        key_cache, value_cache = pool_views(buffer)
        self.positions = torch.full((num_pages, block_size), -1, dtype=torch.int32)
        self.pool = KVPool(key_cache, value_cache, self.positions, torch.zeros((num_pages, block_size)))
        self.free = torch.randperm(num_pages - 1, generator=self.gen).add(1).tolist()  # page 0: never
        self.context = 200
        self.pages = {}  # (layer, seq, head) -> [page ids]
        self.lens = np.zeros(self.shape, np.int64)
        for key in np.ndindex(*self.shape):
            keep = int(torch.randint(1, self.context, (1,), generator=self.gen))
            kept = torch.randperm(self.context, generator=self.gen)[:keep].sort().values
            self.pages[key] = []
            for position in kept.tolist():
                self._append(key, position)

    def _append(self, key, position):
        length = int(self.lens[key])
        if length % self.block_size == 0:
            self.pages[key].append(self.free.pop())
        self.positions[self.pages[key][-1], length % self.block_size] = position
        self.lens[key] = length + 1

    def step(self, position):
        for key in np.ndindex(*self.shape):
            self._append(key, position)

    def tables(self, seqs):
        """``([L, n, H, P] page ids, [L, n, H] lengths)`` of sequences ``seqs``."""
        num_pages = max(len(self.pages[key]) for key in self.pages)
        tables = torch.zeros((self.shape[0], len(seqs), self.shape[2], num_pages), dtype=torch.int32)
        for layer, index, head in np.ndindex(self.shape[0], len(seqs), self.shape[2]):
            row = self.pages[(layer, seqs[index], head)]
            tables[layer, index, head, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return tables, torch.from_numpy(self.lens[:, seqs])


def score_now(cache, seqs, queries, scale, power=2):
    """The every-step pass: ``queries [L, M, Hq, D]`` of sequences ``seqs``."""
    tables, lens = cache.tables(seqs)
    num_layers, _, num_kv_heads, num_pages = tables.shape
    group = queries.shape[2] // num_kv_heads
    decode_metrics_by_head(
        queries.reshape(-1, group, queries.shape[3]), cache.pool, tables.reshape(-1, num_pages),
        lens.reshape(-1), scale, power,
    )


@pytest.mark.parametrize("batch", [1, 3, 4])
@pytest.mark.parametrize("group,block_size", [(1, 16), (4, 16), (8, 32)])
def test_deferred_queries_give_the_every_step_metrics(batch, group, block_size):
    num_seqs, num_layers, num_kv_heads, head_dim, scale = 3, 2, 2, 32, 0.2
    now = GrowingCache(num_seqs, num_layers, num_kv_heads, head_dim, block_size, seed=5)
    later = GrowingCache(num_seqs, num_layers, num_kv_heads, head_dim, block_size, seed=5)
    deferred = DeferredDecodeQueries(batch)
    gen = torch.Generator().manual_seed(1)
    for step in range(11):
        position = now.context + step
        now.step(position)
        later.step(position)
        # Some sequences add a query this step (a stride, rows joining and leaving).
        seqs = [s for s in range(num_seqs) if torch.rand(1, generator=gen) < 0.7]
        if not seqs:
            continue
        queries = torch.randn((num_layers, len(seqs), num_kv_heads * group, head_dim), generator=gen)
        score_now(now, seqs, queries, scale)
        full = deferred.add(np.array(seqs), np.full(len(seqs), position), queries, scale, 2)
        if full.size:
            due = [seqs[i] for i in full]
            deferred.flush(later.pool, due, *later.tables(due))
        if step == 6:  # a compression of sequence 0 flushes it whatever it holds
            deferred.flush(later.pool, [0], *later.tables([0]))
            if batch == 1:  # nothing ever waits
                torch.testing.assert_close(later.pool.slot_metrics, now.pool.slot_metrics, rtol=1e-5, atol=1e-7)
    assert (now.pool.slot_metrics > 0).sum() > 100
    if batch > 1:  # something was still pending: the metrics differ until the flush
        assert any(s in deferred for s in range(num_seqs))
    deferred.flush(later.pool, list(range(num_seqs)), *later.tables(list(range(num_seqs))))
    assert not any(s in deferred for s in range(num_seqs))
    torch.testing.assert_close(later.pool.slot_metrics, now.pool.slot_metrics, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("power", [1, 2])
def test_sequences_holding_different_counts_share_one_exact_pass(power):
    """Three sequences holding 1, 2 and 3 queries (the engine flushes every pending row
    of a step together): one pass, padded at weight 0, gives the every-step metrics."""
    now = GrowingCache(3, 2, 2, 32, 16, seed=11)
    later = GrowingCache(3, 2, 2, 32, 16, seed=11)
    deferred = DeferredDecodeQueries(4)
    gen = torch.Generator().manual_seed(6)
    for step, seqs in enumerate([[0, 1, 2], [1, 2], [2]]):  # sequence s queries from step s on
        now.step(now.context + step)
        later.step(now.context + step)
        queries = torch.randn((2, len(seqs), 8, 32), generator=gen) * 3
        score_now(now, seqs, queries, 0.2, power)
        position = now.context + step
        assert deferred.add(np.array(seqs), np.full(len(seqs), position), queries, 0.2, power).size == 0
    assert [deferred._pending[s].count for s in range(3)] == [1, 2, 3]
    deferred.flush(later.pool, [0, 1, 2], *later.tables([0, 1, 2]))
    assert deferred.passes == 1
    assert (now.pool.slot_metrics > 0).sum() > 100
    torch.testing.assert_close(later.pool.slot_metrics, now.pool.slot_metrics, rtol=1e-5, atol=1e-7)


def test_flush_of_sequence_zero_matches_its_every_step_metrics():
    """A compression reads one sequence's metrics: after flushing it alone, its slots
    equal the every-step pass's, while the others' still wait."""
    now = GrowingCache(2, 2, 2, 32, 16, seed=9)
    later = GrowingCache(2, 2, 2, 32, 16, seed=9)
    deferred = DeferredDecodeQueries(8)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        position = now.context + step
        now.step(position)
        later.step(position)
        queries = torch.randn((2, 2, 8, 32), generator=gen)
        score_now(now, [0, 1], queries, 0.18)
        assert deferred.add(np.array([0, 1]), np.array([position] * 2), queries, 0.18, 2).size == 0
    deferred.flush(later.pool, [0], *later.tables([0]))
    pages_0 = sorted({p for key, row in now.pages.items() if key[1] == 0 for p in row})
    pages_1 = sorted({p for key, row in now.pages.items() if key[1] == 1 for p in row})
    torch.testing.assert_close(later.pool.slot_metrics[pages_0], now.pool.slot_metrics[pages_0], rtol=1e-5, atol=1e-7)
    assert later.pool.slot_metrics[pages_1].abs().sum() == 0
    assert 1 in deferred and 0 not in deferred
    deferred.drop([1])
    assert 1 not in deferred


def test_a_query_does_not_see_later_kvs():
    """Without the position mask a kept query would also score KVs appended after it:
    the masked pass differs from an unmasked one over the same heads (the mask is live)."""
    cache = GrowingCache(1, 1, 1, 16, 16, seed=3)
    deferred = DeferredDecodeQueries(2)
    gen = torch.Generator().manual_seed(4)
    cache.step(cache.context)
    first = torch.randn((1, 1, 2, 16), generator=gen)
    deferred.add(np.array([0]), np.array([cache.context]), first, 0.25, 2)
    cache.step(cache.context + 1)
    second = torch.randn((1, 1, 2, 16), generator=gen)
    deferred.add(np.array([0]), np.array([cache.context + 1]), second, 0.25, 2)
    deferred.flush(cache.pool, [0], *cache.tables([0]))
    masked = cache.pool.slot_metrics.clone()
    cache.pool.slot_metrics.zero_()
    tables, lens = cache.tables([0])
    both = torch.cat([first, second], dim=2).view(1, 4, 16)
    decode_metrics_by_head(both, cache.pool, tables.view(1, -1), lens.view(-1), 0.25, 2)
    assert not torch.allclose(masked, cache.pool.slot_metrics)
    # The newest KV (position context + 1) gets attention only from the second query.
    page = cache.pages[(0, 0, 0)][-1]
    offset = (int(cache.lens[0, 0, 0]) - 1) % 16
    assert masked[page, offset] > 0
    cache.pool.slot_metrics.zero_()
    decode_metrics_by_head(second.view(1, 2, 16), cache.pool, tables.view(1, -1), lens.view(-1), 0.25, 2)
    torch.testing.assert_close(masked[page, offset], cache.pool.slot_metrics[page, offset])


def test_one_scale_and_power():
    deferred = DeferredDecodeQueries(2)
    queries = torch.zeros((1, 1, 2, 8))
    deferred.add(np.array([3]), np.array([10]), queries, 0.5, 2)
    with pytest.raises(ValueError, match="one scale and metric power"):
        deferred.add(np.array([3]), np.array([11]), queries, 0.5, 1)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        DeferredDecodeQueries(0)


def test_a_full_row_takes_every_pending_row_of_its_step_along():
    """The engine's per-step object (``DecodeStepMetrics``): rows query at different
    phases; when one row is full, every batch row holding queries is scored in the same
    pass (none left pending), and the metrics stay those of the every-step pass."""
    from kvcompress.ops.cpu_attention import DecodeStepMetrics

    num_layers, num_rows, num_kv_heads, group, head_dim, scale = 2, 3, 2, 4, 32, 0.2
    now = GrowingCache(num_rows, num_layers, num_kv_heads, head_dim, 16, seed=13)
    later = GrowingCache(num_rows, num_layers, num_kv_heads, head_dim, 16, seed=13)
    deferred = DeferredDecodeQueries(2)
    gen = torch.Generator().manual_seed(8)
    passes_with_a_row_not_full = 0
    for step in range(8):
        position = now.context + step
        now.step(position)
        later.step(position)
        metric_rows = [row for row in range(num_rows) if (step + row) % 2 == 0]  # two phases
        queries = torch.randn((num_layers, num_rows, num_kv_heads * group, head_dim), generator=gen)
        score_now(now, metric_rows, queries[:, metric_rows], scale)
        tables, lens = later.tables(list(range(num_rows)))
        # The kernel's head-major order (cpu_attention.kernel_sequence_order)
        step_metrics = DecodeStepMetrics(
            torch.tensor(metric_rows), tables.transpose(1, 2).reshape(num_layers, num_kv_heads * num_rows, -1),
            lens.transpose(1, 2).reshape(num_layers, -1), num_kv_heads, num_kv_heads * group, head_dim, torch.float32,
        )
        step_metrics.defer(deferred, np.arange(num_rows), np.full(len(metric_rows), position))
        before = {row: deferred._pending[row].count for row in range(num_rows) if row in deferred}
        for layer in range(num_layers):
            step_metrics.record(layer, queries[layer])
        passes = deferred.passes
        step_metrics.run(later.pool, scale, 2)
        if deferred.passes > passes:
            assert deferred.passes == passes + 1
            assert not any(row in deferred for row in range(num_rows))
            if any(row not in metric_rows and count for row, count in before.items()):
                passes_with_a_row_not_full += 1
    assert passes_with_a_row_not_full >= 2
    deferred.flush(later.pool, list(range(num_rows)), *later.tables(list(range(num_rows))))
    torch.testing.assert_close(later.pool.slot_metrics, now.pool.slot_metrics, rtol=1e-5, atol=1e-7)


def test_the_owner_queues_a_mixed_steps_queries_flushes_and_drops():
    """``DecodeMetrics`` over a real ``PerHeadPagedCache``: a step with prompt rows records
    its decode rows' queries layer by layer; after the forward they wait in the queue;
    ``flush`` (what a compression calls first) scores them with the cache's tables as the
    per-layer pass scores them at once; ``drop`` forgets a released sequence; without a
    queue (backends scoring during the forward) nothing waits."""
    from kvcompress.ops import PerHeadPagedCache
    from kvcompress.ops.decode_metrics import DecodeMetrics, StepDecodeQueries, decode_metrics

    layers, heads, group, dim, block, scale = 2, 2, 2, 16, 4, 0.25
    cache = PerHeadPagedCache(64, layers, heads, block, max_seqs=3, max_pages_per_head=8)
    gen = torch.Generator().manual_seed(6)
    key, value = torch.randn((2, 64, block, dim), generator=gen).unbind(0)
    pool = cache.kv_pool(key, value)
    slots = [cache.new_sequence(), cache.new_sequence()]
    lens = [10, 7]
    cache.append(torch.tensor(slots), torch.tensor(lens), torch.cat([torch.arange(n) for n in lens]))
    cache.append_one(torch.tensor(slots), torch.tensor(lens))
    query = torch.randn((layers, 2, heads * group, dim), generator=gen)

    owner = DecodeMetrics(cache, pool, 2, DeferredDecodeQueries(2))
    recorded = StepDecodeQueries(torch.tensor([0, 1]), np.array(slots), np.array(lens), layers)
    owner.record_step(recorded)
    for layer in range(layers):
        recorded.record(layer, query[layer], scale)
    owner.after_forward(np.array(slots))
    assert owner.step_queries is None and all(slot in owner.queue for slot in slots)
    assert pool.slot_metrics.abs().sum() == 0  # one query each of two: none due yet
    owner.flush([slots[0]])
    owner.drop([slots[1]])
    assert slots[0] not in owner.queue and slots[1] not in owner.queue

    expected = torch.zeros_like(pool.slot_metrics)
    oracle = KVPool(key, value, cache.slot_positions, expected)
    first = torch.tensor([slots[0]])
    for layer in range(layers):
        tables = cache.page_tables_of(first, layer=layer)
        decode_metrics(query[layer, :1], oracle, tables, cache.head_lens[first, layer], scale, 2)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(pool.slot_metrics, expected, rtol=1e-5, atol=1e-7)

    eager = DecodeMetrics(cache, pool, 2, None)
    eager.record_step(recorded)
    eager.after_forward(np.array(slots))
    eager.flush(slots)  # nothing pending: no pass
    torch.testing.assert_close(pool.slot_metrics, expected, rtol=1e-5, atol=1e-7)
