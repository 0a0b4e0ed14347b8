"""One compression step: evict, compact and free pages for a batch of sequences.

:func:`compress_sequences` gathers the sequences' metrics and positions in logical
order (:func:`gather_logical`), ranks them by the policy
(:func:`~kvcompress.ops.policy_scores.policy_metrics`), schedules the evictions over
all layers and heads (:func:`~kvcompress.ops.eviction.schedule_evictions`), compacts
every shrunk head (:func:`~kvcompress.ops.move_cache.plan_moves`, then MoveCache on
the resolved backend) and frees the trailing pages. Batched tensor ops over sequences,
layers and heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.ops import dispatch
from kvcompress.ops.dispatch import KernelOps
from kvcompress.ops.eviction import protected_slots, schedule_evictions
from kvcompress.ops.kv_pool import KVPool
from kvcompress.ops.move_cache import plan_moves
from kvcompress.ops.paged_cache import PerHeadPagedCache, pages_for
from kvcompress.ops.policy_scores import policy_metrics
from kvcompress.policies import Policy


@dataclass
class CompressResult:
    """Result of :func:`compress_sequences`.

    Attributes:
        new_head_lens: ``[S, L, H]`` int64, KVs each head holds afterwards.
        evict_blocks: ``[S, L, H]`` int64, pages each head gave back.
        pages_freed: total pages returned to the allocator (``== evict_blocks.sum()``).
        kvs_evicted: total KVs evicted (``(old_lens - new_head_lens).sum()``).
        kept_unprotected_by_layer: ``[L]`` int64, KVs kept that are not protected
            (window, sinks), summed over sequences and heads: how a policy split the
            budget over layers (XKV profiles are made from it).
    """

    new_head_lens: torch.Tensor
    evict_blocks: torch.Tensor
    pages_freed: int
    kvs_evicted: int
    kept_unprotected_by_layer: torch.Tensor | None = None


def gather_logical(
    cache: PerHeadPagedCache, seq_slots: torch.Tensor, num_slots: int | None = None, pool: KVPool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head metrics and positions of some sequences in logical slot order.

    Args:
        cache: the paged cache.
        seq_slots: ``[S]`` int64 sequence slots.
        num_slots: ``K``, logical slots per head (default: the longest head's pages
            times ``block_size``; at least one page). Must be a multiple of ``b``.
        pool: the cache's pool, whose ``page_meta_row`` says where each page's metrics
            and positions are (None: row = page id).

    Returns:
        ``(metrics [S, L, H, K] float32, positions [S, L, H, K] int32, tables
        [S, L, H, K / b] int32)``; entries past a head's length are garbage.
    """
    block_size = cache.block_size
    seq_slots = seq_slots.to(cache.device, torch.int64)
    if num_slots is None:
        lens = cache.head_lens[seq_slots]
        max_pages = int(pages_for(lens, block_size).max().item()) if lens.numel() else 0
        num_slots = max(1, max_pages) * block_size
    num_pages = num_slots // block_size
    tables = cache.tables.gather(seq_slots, num_pages)  # [S, L, H, P]
    # Logical slot k lives at (tables[..., k // b], k % b).
    pages = tables.repeat_interleave(block_size, dim=-1)  # [S, L, H, K]
    rows = pages if pool is None else pool.meta_index(pages)
    offsets = torch.arange(num_slots, device=cache.device) % block_size
    return cache.slot_metrics[rows, offsets], cache.slot_positions[rows, offsets], tables


def compress_sequences(
    cache: PerHeadPagedCache,
    pool: KVPool,
    seq_slots: torch.Tensor,
    evict_blocks_per_seq: torch.Tensor,
    context_lens: torch.Tensor | int,
    protected_window: torch.Tensor | int,
    sink_tokens: torch.Tensor | int,
    *,
    block_cost: str = "max",
    policy: Policy | None = None,
    generator: torch.Generator | None = None,
    ops: KernelOps | None = None,
    layers: torch.Tensor | None = None,
) -> CompressResult:
    """Evict, compact and free pages for a batch of sequences (one compression step).

    Gathers each sequence's per-head metrics and positions in logical order through
    ``cache.tables`` (padded to the longest head among them), schedules the
    evictions over all layers and heads of each sequence
    (:func:`~kvcompress.ops.eviction.schedule_evictions`), moves the kept KVs of each
    head's eviction range into its evicted slots (:func:`plan_moves`, then MoveCache
    on ``ops``), frees the trailing pages of every shrunk head with one
    ``cache.allocator.free`` call and sets ``cache.head_lens``.

    Args:
        cache: the paged cache (its ``slot_metrics`` hold the metrics).
        pool: the page pool of all layers (``cache.kv_pool(key_cache, value_cache)``:
            its slot positions and metrics are the cache's).
        seq_slots: ``[S]`` int64 distinct sequence slots.
        evict_blocks_per_seq: ``[S]`` int64 ``E_s``, pages to free per sequence
            (fewer are freed when fewer are evictable).
        context_lens: ``[S]`` int64 tokens in each sequence's context.
        protected_window: ``[S]`` int64, the last this-many token positions are kept.
        sink_tokens: ``[S]`` int64, the first this-many token positions are kept.
        block_cost: ``"max"`` (paper) or ``"sum"``, see ``schedule_evictions``.
        policy: eviction policy (None: ``kvc``). Its metric source replaces the stored
            metrics for ``position`` (oldest first) and ``random``; its budget split
            orders the pages freed (``kvcompress.ops.budget_split``).
        generator: random source of the ``random`` policy (on ``cache.device``).
        ops: the engine's resolved ops (:func:`kvcompress.ops.dispatch.resolve_ops`);
            None: MoveCache on the backend selected now.
        layers: ``[L']`` int64 ascending, the layers it may compress (None: all). The
            others (sliding-window layers) keep every KV; the schedule, the policy's
            budget split and ``evict_blocks_per_seq`` see only these layers, as if the
            model had no others.

    Returns:
        The :class:`CompressResult`. Afterwards every kept KV sits at a logical slot
        ``< new_head_len`` of its head with K, V, metric and position unchanged.
    """
    if (pool.slot_positions is not cache.slot_positions or pool.slot_metrics is not cache.slot_metrics
            or pool.page_meta_row is not cache.page_meta_row):
        raise ValueError("compress_sequences: pool must hold the cache's slot_positions / slot_metrics / "
                         "page_meta_row (build it with cache.kv_pool(key_cache, value_cache))")
    if cache.page_meta_row is not None and not cache.compresses(seq_slots.tolist()).all():
        # Their pages read shared identity rows: moving KVs would move those rows' contents.
        raise ValueError("compress_sequences: a sequence slot was opened with compresses=False")
    device = cache.device
    block_size = cache.block_size
    seq_slots = seq_slots.to(device, torch.int64)
    num_seqs = seq_slots.numel()
    head_lens = cache.head_lens[seq_slots]  # [S, L, H]
    if num_seqs == 0 or int(head_lens.max().item()) == 0:
        zeros = torch.zeros_like(head_lens)
        return CompressResult(head_lens.clone(), zeros, 0, 0)

    metrics, positions, tables = gather_logical(cache, seq_slots, pool=pool)
    if layers is not None:
        layers = layers.to(device, torch.int64)
        if layers.numel() == 0:
            zeros = torch.zeros_like(head_lens)
            return CompressResult(head_lens.clone(), zeros, 0, 0, zeros.sum(dim=(0, 2)))
    chosen = _layers_of(layers)
    lens = chosen(head_lens)
    metrics = policy_metrics(policy, chosen(metrics), chosen(positions), generator)
    protected = protected_slots(chosen(positions), lens, context_lens, protected_window, sink_tokens)
    plan = schedule_evictions(
        metrics, lens, protected, evict_blocks_per_seq, block_size, block_cost,
        split=policy.split if policy is not None else None,
    )

    num_slots = metrics.shape[-1]
    flat_tables = chosen(tables).reshape(-1, tables.shape[-1])  # [R, P]
    row, src_index, dst_index = plan_moves(
        plan.evicted.reshape(-1, num_slots), lens.reshape(-1), plan.new_head_lens.reshape(-1)
    )
    move_cache = ops.move_cache if ops is not None else dispatch.move_cache
    move_cache(
        pool,
        flat_tables[row, src_index // block_size],
        src_index % block_size,
        flat_tables[row, dst_index // block_size],
        dst_index % block_size,
    )

    # Free pages [ceil(new_len / b), ceil(len / b)) of every head.
    new_head_lens = _all_layers(layers, head_lens, plan.new_head_lens)
    pages_freed = cache.free_tail_pages(seq_slots, tables, new_head_lens)
    # protected_slots() marks held KVs only, and the schedule never evicts them.
    kept_unprotected = (plan.new_head_lens - protected.sum(dim=-1)).clamp(min=0).sum(dim=(0, 2))
    return CompressResult(
        new_head_lens=new_head_lens,
        evict_blocks=_all_layers(layers, torch.zeros_like(head_lens), plan.evict_blocks),
        pages_freed=pages_freed,
        kvs_evicted=int((head_lens - new_head_lens).sum().item()),
        kept_unprotected_by_layer=_all_layers(layers, torch.zeros_like(head_lens[0, :, 0]), kept_unprotected, dim=0),
    )


def _layers_of(layers: torch.Tensor | None):
    """``[S, L, ...] -> [S, L', ...]``: the chosen layers of a per-layer tensor."""
    if layers is None:
        return lambda tensor: tensor
    return lambda tensor: tensor.index_select(1, layers)


def _all_layers(layers: torch.Tensor | None, base: torch.Tensor, chosen: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``chosen`` (the layers ``layers``) written over ``base`` (every layer)."""
    if layers is None:
        return chosen
    return base.clone().index_copy_(dim, layers, chosen.to(base.dtype))
