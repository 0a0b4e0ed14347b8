"""Page accounting with the KV heads split over tensor-parallel ranks, no vLLM.

Oracle: a brute-force model of T separate pools — rank r's heads are
``[r*H_r, (r+1)*H_r)`` of every layer, a head of n KVs holds ceil(n / b) pages of its
rank's pool, a request fits when every rank has the pages its heads there need — recounted
from plain per-request head lengths after every operation.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcompress.page_accounting import PageAccounting


def _rank_pages(lens: np.ndarray, ranks: int, block: int) -> np.ndarray:
    """``[L, H]`` head lengths -> ``[T]`` pages held per rank (loops, no reshape trick)."""
    layers, heads = lens.shape
    per_rank = heads // ranks
    out = np.zeros(ranks, np.int64)
    for layer in range(layers):
        for head in range(heads):
            out[head // per_rank] += -(-int(lens[layer, head]) // block)
    return out


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_per_rank_pools_match_a_brute_force_model(ranks):
    rng = np.random.default_rng(ranks)
    layers, heads, block, pool = 2, 4, 4, 60
    accounting = PageAccounting(pool, layers, heads, block, max_requests=2, num_ranks=ranks)
    lens: dict[str, np.ndarray] = {}
    logical: dict[str, int] = {}
    pending: dict[str, np.ndarray] = {}  # request -> per-rank pages charged while pending

    def held(request_id):
        return pending.get(request_id, _rank_pages(lens[request_id], ranks, block))

    def free():
        return pool - sum((held(r) for r in lens), np.zeros(ranks, np.int64))

    for step in range(600):
        op = rng.random()
        request_id = f"r{int(rng.integers(0, 4))}"  # 4 ids over 2 rows: rows grow too
        if op < 0.6:
            growth = int(rng.integers(1, 9))
            current = lens.get(request_id, np.zeros((layers, heads), np.int64))
            target = logical.get(request_id, 0) + growth
            if request_id in pending:
                # Unknown lengths: every head may need ceil(growth / b) new pages.
                need = np.full(ranks, layers * (heads // ranks) * -(-growth // block))
            else:
                need = _rank_pages(current + growth, ranks, block) - _rank_pages(current, ranks, block)
            reserve = int(rng.integers(0, 3))
            assert np.array_equal(accounting.pages_to_grow_per_rank(request_id, target), need), step
            assert accounting.shortfall(request_id, target, reserve) == int((need + reserve - free()).max())
            if (need <= free()).all():
                assert accounting.grow(request_id, target) == int(need.sum())
                lens[request_id] = current + growth
                logical[request_id] = target
                if request_id in pending:
                    pending[request_id] = pending[request_id] + need
            else:
                with pytest.raises(RuntimeError):
                    accounting.grow(request_id, target)
        elif op < 0.75 and request_id in lens and request_id not in pending:
            # A compression ordered: each rank's pool is credited its own count at once.
            charged = _rank_pages(lens[request_id], ranks, block)
            evict = np.array([int(rng.integers(0, c + 1)) for c in charged])
            accounting.mark_compressed(request_id, evict if ranks > 1 else int(evict[0]))
            pending[request_id] = charged - evict
        elif op < 0.88 and request_id in pending:
            # The workers' lengths arrive: any shrink that frees at least what was credited.
            charged = pending.pop(request_id)
            new = lens[request_id].copy()
            for _ in range(200):
                candidate = np.minimum(new, rng.integers(0, logical[request_id] + 1, new.shape))
                if (_rank_pages(candidate, ranks, block) <= charged).all():
                    new = candidate
                    break
            else:
                new = np.zeros_like(new)
            surplus = charged - _rank_pages(new, ranks, block)
            assert accounting.adopt(request_id, new) == int(surplus.sum())
            lens[request_id] = new
        elif op < 1.0 and request_id in lens:
            assert accounting.release(request_id) == int(held(request_id).sum())
            del lens[request_id], logical[request_id]
            pending.pop(request_id, None)
        assert np.array_equal(accounting.free_pages, free()), step
        assert accounting.num_free_pages == int(free().sum())
        for r in lens:
            assert accounting.pages_held(r) == int(held(r).sum())
        for rank in range(ranks):
            assert accounting.pages_held_by_request(rank) == {r: int(held(r)[rank]) for r in lens}
        accounting.check_consistent()
    assert accounting.num_used_pages == pool * ranks - int(free().sum())


def test_one_rank_short_is_enough_to_refuse():
    """Rank 1's pool is full while rank 0's has room: the request does not fit."""
    accounting = PageAccounting(8, num_layers=1, num_kv_heads=2, block_size=4, num_ranks=2)
    accounting.grow("a", 16)  # 4 pages on each rank
    accounting.mark_compressed("a", [4, 0])  # rank 0 frees all of its, rank 1 none
    accounting.adopt("a", np.array([[0, 16]]))
    assert accounting.free_pages.tolist() == [8, 4]
    assert accounting.pages_to_grow_per_rank("b", 20).tolist() == [5, 5]
    assert accounting.shortfall("b", 20) == 1  # rank 1: 5 needed, 4 free
    assert accounting.shortfall("b", 16) == 0
    with pytest.raises(RuntimeError):
        accounting.grow("b", 20)


def test_heads_must_split_evenly_and_orders_name_every_rank():
    with pytest.raises(ValueError, match="3 KV heads cannot be split evenly over 2 ranks"):
        PageAccounting(8, num_layers=1, num_kv_heads=3, block_size=4, num_ranks=2)
    accounting = PageAccounting(8, num_layers=1, num_kv_heads=2, block_size=4, num_ranks=2)
    accounting.grow("a", 8)
    with pytest.raises(ValueError, match="one page count per rank"):
        accounting.mark_compressed("a", 1)


def test_planner_orders_each_rank_its_own_pages_from_its_own_heads():
    """With 2 ranks, a compression order carries E_s,r per rank: the budget rule of
    ``kvcompress.budget`` applied to that rank's heads alone (recomputed here by hand),
    credited to that rank's pool at once; the worker of rank r reads its own count."""
    import math

    from kvcompress.compression_planner import CompressionPlanner
    from kvcompress.config import KVCompressConfig

    layers, heads, block, ranks = 2, 4, 16, 2
    accounting = PageAccounting(4096, layers, heads, block, max_requests=4, num_ranks=ranks)
    planner = CompressionPlanner(
        KVCompressConfig(enabled=True, rate=4, protected_window=8, min_cache_tokens=16), accounting
    )
    accounting.grow("a", 1000)
    # Rank 1's heads were compressed before (shorter): it has fewer pages to give.
    lens = accounting.head_lens_of("a")
    lens[:, 2:] = 400
    accounting.set_head_lens("a", lens)
    free_before = accounting.free_pages.copy()
    planner.begin_step()
    planner.compress_due([_prefilled_request("a", 1000)])
    order = planner.take_orders()["a"]
    keep = max(16, math.ceil(1000 / 4)) + 8  # tokens per head after compression
    heads_per_rank = heads // ranks
    target = math.ceil(keep * layers * heads_per_rank / block)
    expected = (
        layers * heads_per_rank * math.ceil(1000 / block) - target,
        layers * heads_per_rank * math.ceil(400 / block) - target,
    )
    assert order.evict_pages_by_rank == expected
    assert [order.evict_pages_on(rank) for rank in range(ranks)] == list(expected)
    assert order.evict_pages == sum(expected)
    assert (accounting.free_pages - free_before).tolist() == list(expected)


def _two_rank_planner():
    from kvcompress.compression_planner import CompressionPlanner
    from kvcompress.config import KVCompressConfig

    accounting = PageAccounting(512, num_layers=2, num_kv_heads=4, block_size=16, max_requests=4,
                                num_ranks=2)
    config = KVCompressConfig(enabled=True, rate=4, protected_window=8, min_cache_tokens=16)
    return CompressionPlanner(config, accounting)


def _rank_report(lens_by_request: dict, rank: int, compressed=(), pool=512, block=16):
    """What rank ``rank``'s worker holding exactly ``lens_by_request`` ([L, 4] over both
    ranks) reports: its own heads (2, 3 on rank 1) only."""
    from kvcompress.contract import WorkerReport

    own = {r: lens[:, 2 * rank:2 * rank + 2] for r, lens in lens_by_request.items()}
    held = {r: int(((lens + block - 1) // block).sum()) for r, lens in own.items()}
    return WorkerReport(pool - sum(held.values()), held, {r: own[r] for r in compressed})


def test_every_rank_report_is_adopted_into_its_heads_and_checked():
    """The scheduler takes each rank's lengths into that rank's heads and checks each
    rank's pool on its own: a page wrong on rank 1 alone is a mismatch; requests
    released while the step ran are expected per rank."""
    planner = _two_rank_planner()
    accounting = planner.accounting
    accounting.grow("a", 600)
    accounting.grow("b", 600)
    planner.begin_step()
    planner.compress_due([_prefilled_request("a", 600), _prefilled_request("b", 600)])
    orders = planner.take_orders()
    assert set(orders) == {"a", "b"}
    # The workers evicted: rank 0 kept 160 KVs per head, rank 1 unevenly.
    after = {r: accounting.head_lens_of(r) for r in "ab"}
    for r in "ab":
        after[r][:, :2] = 160
        after[r][:, 2:] = np.array([[144, 176], [160, 160]])
        assert (_rank_pages(after[r], 2, 16) <= accounting.pages_held_per_row[accounting._row_of[r]]).all()
    reports = [_rank_report(after, rank, compressed="ab") for rank in range(2)]
    planner.on_released("b", accounting.release_by_rank("b"))  # aborted during the step
    assert planner.adopt(reports) is True
    assert np.array_equal(accounting.head_lens_of("a"), after["a"])
    assert planner.stats.mismatches == 0
    accounting.check_consistent()
    # Next step: rank 1's worker holds one page nobody accounts for.
    planner.begin_step()
    planner.take_orders()
    good, bad = (_rank_report({"a": after["a"]}, rank) for rank in range(2))
    bad.pages_held["a"] += 1
    assert planner.adopt([good, bad]) is False
    assert planner.stats.mismatches == 1
    with pytest.raises(ValueError, match="1 worker reports for 2 ranks"):
        planner.adopt(good)


def _prefilled_request(request_id: str, prompt: int):
    """A request whose prompt is in the cache and whose first token was sampled."""
    from test_compression_planner import Req

    return Req(request_id, prompt, num_computed_tokens=prompt, output_tokens=1)


def _private_pages(lens: np.ndarray, shared: int, ranks: int, block: int) -> np.ndarray:
    """``[T]`` pages of heads ``lens`` past their first ``shared`` pages (loops)."""
    layers, heads = lens.shape
    out = np.zeros(ranks, np.int64)
    for layer in range(layers):
        for head in range(heads):
            out[head // (heads // ranks)] += max(-(-int(lens[layer, head]) // block) - shared, 0)
    return out


@pytest.mark.parametrize("ranks", [1, 2])
def test_prefix_cache_groups_are_counted_once(ranks):
    """Brute force: a request's first ``shared`` pages per head are the cache's page
    groups (counted once, ``L x H_r`` pages per group on every rank); free = pool - the
    requests' pages past their shared prefix - the cache's groups."""
    rng = np.random.default_rng(10 + ranks)
    layers, heads, block, pool = 2, 4, 4, 120
    per_group = layers * heads // ranks
    accounting = PageAccounting(pool, layers, heads, block, max_requests=2, num_ranks=ranks)
    lens: dict[str, np.ndarray] = {}
    shared: dict[str, int] = {}
    logical: dict[str, int] = {}
    groups = 0

    def free():
        held = sum((_private_pages(lens[r], shared[r], ranks, block) for r in lens), np.zeros(ranks, np.int64))
        return pool - held - groups * per_group

    for step in range(500):
        op = rng.random()
        request_id = f"r{int(rng.integers(0, 5))}"
        if op < 0.2 and request_id not in lens and groups:
            hits = int(rng.integers(1, groups + 1))  # admitted with hits on cached groups
            accounting.share_blocks(request_id, hits)
            target = hits * block + int(rng.integers(1, 9))
            need = _private_pages(np.full((layers, heads), target), hits, ranks, block)
            assert np.array_equal(accounting.pages_to_grow_per_rank(request_id, target), need), step
            if (need <= free()).all():
                accounting.grow(request_id, target)
                lens[request_id], shared[request_id] = np.full((layers, heads), target), hits
                logical[request_id] = target
            else:
                accounting.release(request_id)
        elif op < 0.55:
            current = lens.get(request_id, np.zeros((layers, heads), np.int64))
            s = shared.get(request_id, 0)
            growth = int(rng.integers(1, 9))
            target = logical.get(request_id, 0) + growth
            need = _private_pages(current + growth, s, ranks, block) - _private_pages(current, s, ranks, block)
            if request_id in lens:
                assert np.array_equal(accounting.pages_to_grow_per_rank(request_id, target), need), step
            if (need <= free()).all():
                accounting.grow(request_id, target)
                lens[request_id], shared[request_id], logical[request_id] = current + growth, s, target
        elif op < 0.7 and request_id in lens and (lens[request_id] == lens[request_id].max()).all():
            # The cache takes the request's full uncompressed pages past its shared ones.
            full = int(lens[request_id].max()) // block
            if full > shared[request_id]:
                new = full - shared[request_id]
                accounting.cache_groups(new)
                accounting.share_blocks(request_id, full)
                groups += new
                shared[request_id] = full
        elif op < 0.8 and request_id in lens:
            # A compression that keeps the shared prefix whole.
            floor = shared[request_id] * block
            new_lens = np.maximum(floor, lens[request_id] - rng.integers(0, 9, (layers, heads)))
            accounting.set_head_lens(request_id, new_lens)
            lens[request_id] = new_lens
        elif op < 0.9 and groups:
            count = int(rng.integers(1, groups + 1))
            accounting.uncache_groups(count)
            groups -= count
        elif request_id in lens:
            accounting.release(request_id)
            del lens[request_id], shared[request_id], logical[request_id]
        assert np.array_equal(accounting.free_pages, free()), step
        for r in lens:
            assert accounting.pages_held(r) == int(_private_pages(lens[r], shared[r], ranks, block).sum())
        accounting.check_consistent()
    with pytest.raises(RuntimeError):
        accounting.uncache_groups(groups + 1)
