"""MoveCache (KV-Compress paper, Algorithm 1) and the whole compression step.

After :func:`~kvcompress.ops.eviction.schedule_evictions` marks the evicted KVs, each
head that loses ``e`` blocks keeps ``new_len = (ceil(len / b) - e) * b`` KVs. Its
eviction range is the logical slots ``[new_len, len)``; every KV still kept in that
range moves into an evicted slot of ``[0, new_len)``. Afterwards the head's last
``e`` pages hold only garbage and go back to the allocator. K, V, metric and token
position move together; positions stay the original token positions (RoPE and the
causal mask read them), only the physical slots change.

Everything is batched tensor ops over sequences, layers and heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.ops.eviction import protected_slots, schedule_evictions
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


def plan_moves(
    evicted: torch.Tensor, head_lens: torch.Tensor, new_head_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logical moves that compact each head so its evicted KVs are the trailing slots.

    Per row (one head): walk the eviction range ``[new_len, len)`` backwards; each
    KEPT KV found there moves into the next EVICTED slot of ``[0, new_len)``, taken
    in ascending order. The two counts are equal whenever exactly ``len - new_len``
    KVs are evicted.

    Args:
        evicted: ``[R, K]`` bool, evicted logical slots per head (False at ``>= len``).
        head_lens: ``[R]`` int64, KVs held before.
        new_head_lens: ``[R]`` int64, KVs kept.

    Returns:
        ``(row, src_index, dst_index)``, each ``[M]`` int64: move the KV at logical
        slot ``src_index`` of head ``row`` to its logical slot ``dst_index``. Rows
        ascend; within a row, destinations ascend and sources descend.
    """
    num_slots = evicted.shape[-1]
    slot = torch.arange(num_slots, device=evicted.device)
    new_lens = new_head_lens.to(evicted.device, torch.int64).unsqueeze(-1)
    lens = head_lens.to(evicted.device, torch.int64).unsqueeze(-1)
    holes = evicted & (slot < new_lens)  # [R, K] evicted slots that stay
    movers = ~evicted & (slot >= new_lens) & (slot < lens)  # kept KVs in the range
    hole_row, dst_index = holes.nonzero(as_tuple=True)  # row-major: dst ascending
    # Flipping the slot axis lists each row's movers from the last slot backwards.
    mover_row, flipped = movers.flip(-1).nonzero(as_tuple=True)
    if hole_row.shape != mover_row.shape:
        raise ValueError(
            f"{hole_row.numel()} evicted slots below new_head_lens but "
            f"{mover_row.numel()} kept KVs above it: evicted does not match new_head_lens"
        )
    src_index = num_slots - 1 - flipped
    return hole_row, src_index, dst_index


def move_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_metrics: torch.Tensor,
    slot_positions: torch.Tensor,
    src_pages: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_pages: torch.Tensor,
    dst_offsets: torch.Tensor,
) -> None:
    """Reference MoveCache kernel: copy K, V, metric and position between slots.

    Args:
        key_cache, value_cache: ``[num_pages, block_size, head_dim]`` (may be strided views).
        slot_metrics: ``[num_pages, block_size]`` float32.
        slot_positions: ``[num_pages, block_size]`` int32.
        src_pages, src_offsets, dst_pages, dst_offsets: ``[M]`` int64; move ``i`` copies
            slot ``(src_pages[i], src_offsets[i])`` to ``(dst_pages[i], dst_offsets[i])``.
            Sources and destinations must be disjoint (each gather completes before
            its scatter, so the order of moves does not matter).
    """
    if src_pages.numel() == 0:
        return
    key_cache[dst_pages, dst_offsets] = key_cache[src_pages, src_offsets]
    value_cache[dst_pages, dst_offsets] = value_cache[src_pages, src_offsets]
    slot_metrics[dst_pages, dst_offsets] = slot_metrics[src_pages, src_offsets]
    slot_positions[dst_pages, dst_offsets] = slot_positions[src_pages, src_offsets]


def gather_logical(
    cache: PerHeadPagedCache, seq_slots: torch.Tensor, num_slots: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head metrics and positions of some sequences in logical slot order.

    Args:
        cache: the paged cache.
        seq_slots: ``[S]`` int64 sequence slots.
        num_slots: ``K``, logical slots per head (default: the longest head's pages
            times ``block_size``; at least one page). Must be a multiple of ``b``.

    Returns:
        ``(metrics [S, L, H, K] float32, positions [S, L, H, K] int32, tables
        [S, L, H, K / b] int64)``; entries past a head's length are garbage.
    """
    block_size = cache.block_size
    seq_slots = seq_slots.to(cache.device, torch.int64)
    if num_slots is None:
        lens = cache.head_lens[seq_slots]
        max_pages = int(pages_for(lens, block_size).max().item()) if lens.numel() else 0
        num_slots = max(1, max_pages) * block_size
    num_pages = num_slots // block_size
    tables = cache.page_tables[seq_slots][..., :num_pages]  # [S, L, H, P]
    # Logical slot k lives at (tables[..., k // b], k % b).
    pages = tables.repeat_interleave(block_size, dim=-1)  # [S, L, H, K]
    offsets = torch.arange(num_slots, device=cache.device) % block_size
    return cache.slot_metrics[pages, offsets], cache.slot_positions[pages, offsets], tables


def compress_sequences(
    cache: PerHeadPagedCache,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_slots: torch.Tensor,
    evict_blocks_per_seq: torch.Tensor,
    context_lens: torch.Tensor | int,
    protected_window: torch.Tensor | int,
    sink_tokens: torch.Tensor | int,
    block_cost: str = "max",
    policy: Policy | None = None,
    generator: torch.Generator | None = None,
) -> CompressResult:
    """Evict, compact and free pages for a batch of sequences (one compression step).

    Gathers each sequence's per-head metrics and positions in logical order through
    ``cache.page_tables`` (padded to the longest head among them), schedules the
    evictions over all layers and heads of each sequence
    (:func:`~kvcompress.ops.eviction.schedule_evictions`), moves the kept KVs of each
    head's eviction range into its evicted slots (:func:`plan_moves`,
    :func:`move_cache`), frees the trailing pages of every shrunk head with one
    ``cache.allocator.free`` call and sets ``cache.head_lens``.

    Args:
        cache: the paged cache (its ``slot_metrics`` hold the metrics).
        key_cache, value_cache: ``[num_pages, block_size, head_dim]`` pools of all
            layers (may be strided views).
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

    Returns:
        The :class:`CompressResult`. Afterwards every kept KV sits at a logical slot
        ``< new_head_len`` of its head with K, V, metric and position unchanged.
    """
    device = cache.device
    block_size = cache.block_size
    seq_slots = seq_slots.to(device, torch.int64)
    num_seqs = seq_slots.numel()
    head_lens = cache.head_lens[seq_slots]  # [S, L, H]
    if num_seqs == 0 or int(head_lens.max().item()) == 0:
        zeros = torch.zeros_like(head_lens)
        return CompressResult(head_lens.clone(), zeros, 0, 0)

    metrics, positions, tables = gather_logical(cache, seq_slots)
    metrics = policy_metrics(policy, metrics, positions, generator)
    protected = protected_slots(positions, head_lens, context_lens, protected_window, sink_tokens)
    plan = schedule_evictions(
        metrics, head_lens, protected, evict_blocks_per_seq, block_size, block_cost,
        split=policy.split if policy is not None else None,
    )

    num_slots = metrics.shape[-1]
    flat_tables = tables.reshape(-1, tables.shape[-1])  # [R, P]
    row, src_index, dst_index = plan_moves(
        plan.evicted.reshape(-1, num_slots), head_lens.reshape(-1), plan.new_head_lens.reshape(-1)
    )
    # CUDA extension / Triton / this module's reference, by device (dispatch imports
    # this module, hence the local import).
    from kvcompress.ops.dispatch import move_cache as dispatched_move_cache

    dispatched_move_cache(
        key_cache,
        value_cache,
        cache.slot_metrics,
        cache.slot_positions,
        flat_tables[row, src_index // block_size],
        src_index % block_size,
        flat_tables[row, dst_index // block_size],
        dst_index % block_size,
    )

    # Free pages [ceil(new_len / b), ceil(len / b)) of every head.
    page_index = torch.arange(tables.shape[-1], device=device)
    freed = (page_index >= pages_for(plan.new_head_lens, block_size).unsqueeze(-1)) & (
        page_index < pages_for(head_lens, block_size).unsqueeze(-1)
    )
    freed_pages = tables[freed]
    cache.allocator.free(freed_pages)
    cache.head_lens[seq_slots] = plan.new_head_lens
    # protected_slots() marks held KVs only, and the schedule never evicts them.
    kept_unprotected = plan.new_head_lens - protected.sum(dim=-1)
    return CompressResult(
        new_head_lens=plan.new_head_lens,
        evict_blocks=plan.evict_blocks,
        pages_freed=int(freed_pages.numel()),
        kvs_evicted=int((head_lens - plan.new_head_lens).sum().item()),
        kept_unprotected_by_layer=kept_unprotected.clamp(min=0).sum(dim=(0, 2)),
    )
