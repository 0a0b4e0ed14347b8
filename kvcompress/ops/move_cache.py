"""MoveCache (KV-Compress paper, Algorithm 1): the move plan and the reference kernel.

After :func:`~kvcompress.ops.eviction.schedule_evictions` marks the evicted KVs, each
head that loses ``e`` blocks keeps ``new_len = (ceil(len / b) - e) * b`` KVs. Its
eviction range is the logical slots ``[new_len, len)``; every KV still kept in that
range moves into an evicted slot of ``[0, new_len)``. Afterwards the head's last
``e`` pages hold only garbage and go back to the allocator. K, V, metric and token
position move together; positions stay the original token positions (RoPE and the
causal mask read them), only the physical slots change.

:func:`plan_moves` computes the moves and :func:`move_cache` (the PyTorch reference
of the CUDA / Triton kernels) copies the slots; the whole compression step around them
is :func:`kvcompress.ops.compress.compress_sequences`.
"""

from __future__ import annotations

import torch

from kvcompress.ops.kv_pool import KVPool


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
    pool: KVPool, src_pages: torch.Tensor, src_offsets: torch.Tensor,
    dst_pages: torch.Tensor, dst_offsets: torch.Tensor,
) -> None:
    """Reference MoveCache kernel: copy K, V, metric and position between slots of ``pool``.

    Args:
        pool: the page pool (K / V may be strided views).
        src_pages, src_offsets, dst_pages, dst_offsets: ``[M]`` int64; move ``i`` copies
            slot ``(src_pages[i], src_offsets[i])`` to ``(dst_pages[i], dst_offsets[i])``.
            Sources and destinations must be disjoint (each gather completes before
            its scatter, so the order of moves does not matter).

    Positions and metrics move between the pages' metadata rows (``pool.meta_index``).
    """
    if src_pages.numel() == 0:
        return
    for tensor in (pool.key_cache, pool.value_cache):
        tensor[dst_pages, dst_offsets] = tensor[src_pages, src_offsets]
    src_rows, dst_rows = pool.meta_index(src_pages), pool.meta_index(dst_pages)
    for tensor in (pool.slot_positions, pool.slot_metrics):
        tensor[dst_rows, dst_offsets] = tensor[src_rows, src_offsets]
