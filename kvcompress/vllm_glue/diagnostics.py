"""What the worker RPCs read or switch for tests, benchmarks and consistency checks
(``worker_rpcs.py``): page counts, per-head lengths and kept positions, a dump of every
page reference, the opt-in record of each compression's inputs, the decode-metric queue.

Functions of a per-head runner (``runner.KVCompressRunnerMixin``), kept out of it: none of
this runs in a step unless a test switched recording on.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcompress.contract import CompressionOrder
from kvcompress.ops.decode_metrics import DeferredDecodeQueries
from kvcompress.ops.paged_cache import pages_for
from kvcompress.vllm_glue.kv_layout import page_bytes_of


def pages_used(runner) -> dict[str, int]:
    """Worker-side page counts and the worker's counters (``WorkerStats``)."""
    cache = runner.kvc_cache
    if cache is None:
        return {}
    return {
        "num_pages": cache.num_pages,
        # Pages vLLM's KV buffer holds: the pool and the pages past it.
        "buffer_pages": runner.kv_caches[0].untyped_storage().nbytes() // page_bytes_of(runner.kv_cache_config),
        "block_size": cache.block_size,
        "num_free": cache.allocator.num_free,
        "held_by_live_requests": int(cache.pages_held().sum().item()),
        "live_requests": len(runner.kvc_requests),
        "sequence_slots": cache.max_seqs,  # the padding rows' slot included
        "attention_backend": attention_backend(runner),
        **dataclasses.asdict(runner.kvc_stats),
    }


def attention_backend(runner) -> str:
    """The backend that runs the pool's attention: the dispatch's choice for the device,
    or its fallback where it does not take these pages (vLLM's CPU kernel and FP8 pages
    on hosts where vLLM's CPU backend refuses FP8 caches)."""
    ops = runner.kvc_state.ops
    if ops.kernel_page_layout and not runner.kvc_planner.plan_kernel_decode:
        return ops.backend("paged_attention").fallbacks[0]
    return ops.backends["paged_attention"]


def head_lens(runner) -> dict[str, list]:
    """``[layers, this rank's KV heads]`` KVs per head of every live request."""
    if runner.kvc_cache is None:
        return {}
    lens = runner.kvc_cache.head_lens
    return {r: lens[slot].tolist() for r, slot in runner.kvc_requests.live_slots.items()}


def head_pages(cache, slot: int) -> list[list[int]]:
    """``[L*H]`` lists of the page ids each head of ``slot`` holds, in column order."""
    held = pages_for(cache.head_lens[slot], cache.block_size).reshape(-1)
    table = cache.tables.gather(torch.tensor([slot]), cache.max_pages_per_head)[0]
    table = table.reshape(held.numel(), -1)
    return [table[head, : int(held[head])].tolist() for head in range(held.numel())]


def head_slots(cache, slot: int, per_slot: torch.Tensor) -> list[list]:
    """``per_slot`` (``[num_pages, block_size]``: slot positions or metrics) of the KVs
    each head of ``slot`` holds, in slot order: ``[L*H]`` lists."""
    lens = cache.head_lens[slot].reshape(-1).tolist()
    return [
        per_slot[torch.tensor(pages, dtype=torch.int64)].reshape(-1)[:count].tolist()
        for pages, count in zip(head_pages(cache, slot), lens)
    ]


def kept_positions(runner) -> dict[str, list[list[int]]]:
    """Token positions of the KVs every head of every live request holds, in slot order:
    request id -> ``[L*H]`` lists (which KVs survived a compression)."""
    cache = runner.kvc_cache
    if cache is None:
        return {}
    positions, _ = cache.metadata_by_page()
    return {request_id: head_slots(cache, slot, positions) for request_id, slot in runner.kvc_requests.live_slots.items()}


def page_dump(runner) -> dict:
    """Every page reference the worker holds, for brute-force recounts: ``slots``
    (request id -> ``[L*H]`` lists of the page ids its heads hold), ``groups`` (cached
    block id -> ``[L*H]`` page ids), ``row_pages`` (request id -> the pages its metadata rows
    are carved from: compressing requests on CPU), ``page_shares``, the ``free`` page ids,
    and ``group_checksums`` (block id -> float64 sum of its pages' K, V and slot positions)."""
    cache = runner.kvc_cache
    if cache is None:
        return {}
    slots = {request_id: head_pages(cache, slot) for request_id, slot in runner.kvc_requests.live_slots.items()}
    groups, checksums = {}, {}
    pool = runner.kvc_state.pool
    positions, _ = cache.metadata_by_page()
    for block_id, pages in (runner.kvc_prefix_groups.pages if runner.kvc_prefix_groups else {}).items():
        ids = pages.reshape(-1).to(torch.int64)
        groups[block_id] = ids.tolist()
        checksums[block_id] = float(
            pool.key_cache[ids].double().sum() + pool.value_cache[ids].double().sum()
            + positions[ids].double().sum()
        )
    allocator = cache.allocator
    live = runner.kvc_requests.live_slots
    held = dict(zip(live, cache.row_pages_held(list(live.values())).tolist())) if live else {}
    row_pages = {request_id: cache.row_pages[slot, : held[request_id]].tolist()
                 for request_id, slot in live.items() if held[request_id]}
    return {
        "num_pages": cache.num_pages,
        "slots": slots,
        "groups": groups,
        "row_pages": row_pages,
        "group_checksums": checksums,
        "page_shares": cache.page_shares.tolist(),
        "free": allocator.free_stack[: allocator.num_free].tolist(),
    }


def record_compressions(runner, on: bool) -> dict[str, dict]:
    """Start (``on``) or stop recording each compression's inputs (:func:`record_inputs`;
    off by default: it copies every KV's metric); returns and forgets what was recorded."""
    recorded = runner.kvc_recorded or {}
    runner.kvc_recorded = {} if on else None
    runner.kvc_scoring.record(on)  # the scoring kinds' inputs (kvzip's scores, surprisal)
    return recorded


def record_inputs(runner, request_ids: list[str], orders: dict[str, CompressionOrder]) -> None:
    """What a compression of ``request_ids`` is about to read (tests' oracles): per head
    the (position, metric) of every KV it holds, and the order."""
    cache = runner.kvc_cache
    positions_by_page, metrics_by_page = cache.metadata_by_page()
    for request_id in request_ids:
        slot = runner.kvc_requests[request_id].seq_slot
        order = orders[request_id]
        heads = [
            list(zip(positions, metrics))
            for positions, metrics in zip(
                head_slots(cache, slot, positions_by_page), head_slots(cache, slot, metrics_by_page),
            )
        ]
        budget = order.compression.budget
        record = runner.kvc_recorded[request_id] = {
            "policy": order.compression.policy.name,
            "evict_pages": order.evict_pages_on(runner.kvc_tp_rank),
            "context_len": order.context_len,
            "protected_window": budget.protected_window,
            "protected_prefix": budget.protected_prefix,
            "block_cost": runner.kvc_settings.block_cost,
            "heads": heads,
        }
        record.update(runner.kvc_scoring.recorded(request_id))


def defer_decode_metrics(runner, batch: int) -> int:
    """Score decode metric queries ``batch`` at a time from now on (1: every step, through
    the queue; 0: no queue, each step's own pass, as on other backends); between requests
    (queries still pending are dropped). Returns the metric passes the previous queue ran
    (0 after no queue); -1 where the metric pass is never deferred (not on vLLM's CPU
    kernel)."""
    planner = runner.kvc_planner
    if planner is None or not planner.plan_kernel_decode:
        return -1
    decode_metrics = planner.decode_metrics
    queue, decode_metrics.queue = decode_metrics.queue, DeferredDecodeQueries(batch) if batch > 0 else None
    return 0 if queue is None else queue.passes
