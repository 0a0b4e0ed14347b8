"""Block eviction schedule of KV-Compress (paper section 4.2.2, figure 5), vectorised.

Every tensor here is in *logical* slot order: index ``k`` of head ``(l, h)`` of a
sequence is the ``k``-th KV that head holds (slot ``k % b`` of its page ``k // b``).
Shapes use ``S`` sequences, ``L`` layers, ``H`` KV heads, ``K`` logical slots per
head (``K = max_pages * b``, padded to the longest head) and ``b = block_size``.

The whole schedule is a handful of tensor ops batched over sequences, layers and
heads: one sort per head (``[S, L, H, K]``), one sort of the candidate blocks of each
sequence (``[S, L * H * K / b]``), and scatters back. No Python loop runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.ops.budget_split import keep_targets
from kvcompress.policies import BudgetSplit


@dataclass
class EvictionPlan:
    """Result of :func:`schedule_evictions`.

    Attributes:
        evict_blocks: ``[S, L, H]`` int64, whole blocks (pages) each head gives back.
        evicted: ``[S, L, H, K]`` bool, logical slots whose KV is evicted. Never True
            at an index ``>= head_len`` (empty slots are not KVs).
        new_head_lens: ``[S, L, H]`` int64, KVs each head keeps:
            ``(ceil(len / b) - e) * b`` when it loses ``e > 0`` blocks, else ``len``.
    """

    evict_blocks: torch.Tensor
    evicted: torch.Tensor
    new_head_lens: torch.Tensor


def _per_seq(value: torch.Tensor | int, num_seqs: int, device: torch.device) -> torch.Tensor:
    """An int or ``[S]`` tensor as an ``[S]`` int64 tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.int64).reshape(num_seqs)
    return torch.full((num_seqs,), int(value), dtype=torch.int64, device=device)


def protected_slots(
    positions: torch.Tensor,
    head_lens: torch.Tensor,
    context_lens: torch.Tensor | int,
    protected_window: torch.Tensor | int,
    sink_tokens: torch.Tensor | int,
) -> torch.Tensor:
    """Which logical slots hold a KV that may never be evicted.

    Args:
        positions: ``[S, L, H, K]`` int, token position of the KV in each logical slot
            (garbage past ``head_len``).
        head_lens: ``[S, L, H]`` int64, KVs held per head.
        context_lens: ``[S]`` int64 (or an int), tokens in each sequence's context.
        protected_window: ``[S]`` int64 (or an int), the last ``protected_window``
            token positions (``>= context_len - protected_window``) are protected.
        sink_tokens: ``[S]`` int64 (or an int), the first ``sink_tokens`` token
            positions (``< sink_tokens``, attention sinks) are protected.

    Returns:
        ``[S, L, H, K]`` bool; False at every index ``>= head_len``.
    """
    num_seqs = positions.shape[0]
    device = positions.device
    context_lens = _per_seq(context_lens, num_seqs, device).view(-1, 1, 1, 1)
    protected_window = _per_seq(protected_window, num_seqs, device).view(-1, 1, 1, 1)
    sink_tokens = _per_seq(sink_tokens, num_seqs, device).view(-1, 1, 1, 1)
    positions = positions.to(torch.int64)
    held = torch.arange(positions.shape[-1], device=device) < head_lens.unsqueeze(-1)
    return held & (
        (positions >= context_lens - protected_window) | (positions < sink_tokens)
    )


def protected_count(
    context_lens: torch.Tensor | int,
    protected_window: torch.Tensor | int,
    sink_tokens: torch.Tensor | int,
) -> torch.Tensor:
    """``[S]`` int64 protected KVs every head of a sequence holds.

    Protected KVs are never evicted, so every head holds all of them: the token
    positions ``< sink_tokens`` plus those ``>= context_len - protected_window``
    (their union, capped by ``context_len``). Feed it to :func:`evictable_blocks`.
    """
    if isinstance(context_lens, torch.Tensor):
        num_seqs, device = context_lens.numel(), context_lens.device
    else:
        num_seqs, device = 1, torch.device("cpu")
    context_lens = _per_seq(context_lens, num_seqs, device)
    window = _per_seq(protected_window, num_seqs, device).clamp(min=0)
    sinks = _per_seq(sink_tokens, num_seqs, device).clamp(min=0)
    return torch.minimum(context_lens, window + sinks)


def evictable_blocks(
    head_lens: torch.Tensor, protected_count: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Blocks the schedule can evict per sequence (closed form).

    Assumes every head of sequence ``s`` holds ``protected_count[s]`` protected KVs.
    A head of length ``n`` with ``a = ceil(n / b) * b - n`` empty slots in its last
    page can give back ``floor((a + n - p) / b)`` blocks (clamped at 0).

    Args:
        head_lens: ``[S, L, H]`` int64.
        protected_count: ``[S]`` int64 protected KVs per head.
        block_size: ``b``, KVs per page.

    Returns:
        ``[S]`` int64, the sum over the sequence's heads; equal to what
        :func:`schedule_evictions` evicts when asked for more than that.
    """
    head_lens = head_lens.to(torch.int64)
    padded = (head_lens + block_size - 1) // block_size * block_size  # a + n
    per_head = (padded - protected_count.to(head_lens).view(-1, 1, 1)).clamp(min=0)
    return (per_head // block_size).sum(dim=(1, 2))


def schedule_evictions(
    metrics: torch.Tensor,
    head_lens: torch.Tensor,
    protected: torch.Tensor,
    evict_blocks_per_seq: torch.Tensor,
    block_size: int,
    block_cost: str = "max",
    split: BudgetSplit | None = None,
) -> EvictionPlan:
    """Choose which KVs to evict so that each sequence frees ``E_s`` whole blocks.

    Per head, slots are sorted by a key: the empty slots of the partial last page
    (index in ``[len, ceil(len / b) * b)``) first (they must go before a page frees),
    then the KVs by metric ascending, protected KVs and slots beyond the head's
    pages last (``+inf``). Candidate block ``k`` (1-based) of a head = its ``k * b``
    lowest entries, i.e. row ``k - 1`` of the sorted slots reshaped ``[K / b, b]``;
    its cost is

    - ``"max"`` (the paper's rule): the largest metric in the row;
    - ``"sum"``: the sum of the metrics in the row (empty slots count 0), the
      marginal metric lost by evicting the ``k``-th block.

    A candidate containing a protected KV or a slot beyond the head's pages costs
    ``+inf`` and is not evictable. Candidates of all layers and heads of a sequence
    are sorted by cost (stable: ties go by ``(layer, head, k)``), and the first
    ``min(E_s, evictable)`` are evicted. Costs never decrease with ``k`` within a
    head, so each head loses a prefix ``1..e`` of its candidates, i.e. its
    ``e * b - a`` lowest-metric KVs (``a`` = its empty slots).

    Optimality (over all ways of taking ``T = min(E_s, evictable)`` blocks, head
    ``h`` giving ``e_h`` blocks = its ``e_h * b - a_h`` lowest evictable KVs):

    - ``"sum"`` minimises the total evicted metric exactly: a head's successive
      block sums are non-decreasing (convex total), so picking the ``T`` smallest
      marginal costs across heads is optimal.
    - ``"max"`` gives the lexicographic minimax optimum: the sorted (descending)
      multiset of evicted block costs is lexicographically smallest; in particular
      the largest metric of any evicted block is as small as possible.

    Args:
        metrics: ``[S, L, H, K]`` float, metric of the KV in each logical slot
            (``>= 0``; NaN counts as 0; ignored at index ``>= head_len``).
            ``K`` must be a multiple of ``block_size``.
        head_lens: ``[S, L, H]`` int64, KVs held per head (``<= K``).
        protected: ``[S, L, H, K]`` bool, KVs that may never be evicted.
        evict_blocks_per_seq: ``[S]`` int64 ``E_s``, blocks wanted per sequence.
        block_size: ``b``, KVs per page.
        block_cost: ``"max"`` or ``"sum"``.
        split: a policy's budget split; None or a global one (``split.is_global``) =
            the paper's global order above. Otherwise the same candidates (same
            evictability, same KVs per block) are taken in a different order: whole
            pages from the heads most above their targets
            (``kvcompress.ops.budget_split``), so the sequence still frees
            ``min(E_s, evictable)`` pages.

    Returns:
        The :class:`EvictionPlan`.
    """
    if block_cost not in ("max", "sum"):
        raise ValueError(f"block_cost must be 'max' or 'sum', got {block_cost!r}")
    num_seqs, num_layers, num_heads, num_slots = metrics.shape
    if num_slots % block_size:
        raise ValueError(
            f"logical slots per head ({num_slots}) must be a multiple of block_size ({block_size})"
        )
    device = metrics.device
    num_rows = num_slots // block_size
    head_lens = head_lens.to(device=device, dtype=torch.int64)
    wanted = _per_seq(evict_blocks_per_seq, num_seqs, device).clamp(min=0)

    value_dtype = torch.float64 if metrics.dtype == torch.float64 else torch.float32
    values = metrics.to(value_dtype)
    # NaN counts as 0; negative metrics (not expected) are clamped so empties stay first.
    values = torch.where(torch.isnan(values), torch.zeros_like(values), values).clamp(min=0)
    slot = torch.arange(num_slots, device=device)
    lens = head_lens.unsqueeze(-1)  # [S, L, H, 1]
    padded_lens = (lens + block_size - 1) // block_size * block_size
    held = slot < lens
    empty = (slot >= lens) & (slot < padded_lens)  # empty slots of the partial last page
    blocked = ~held & ~empty | (protected & held)  # never evictable: +inf
    inf = torch.tensor(float("inf"), dtype=value_dtype, device=device)
    # Sort key: empties first (-inf), then metrics, then +inf.
    sort_key = torch.where(blocked, inf, torch.where(empty, -inf, values))
    sorted_key, order = torch.sort(sort_key, dim=-1, stable=True)  # [S, L, H, K]
    sorted_empty = torch.gather(empty, -1, order)

    # Cost of each candidate block (row of the sorted slots); empties count 0.
    rows = torch.where(sorted_empty, torch.zeros_like(sorted_key), sorted_key)
    rows = rows.view(num_seqs, num_layers, num_heads, num_rows, block_size)
    if block_cost == "max":
        cost = rows[..., -1]  # sorted: the last column is the row's max
    else:
        cost = rows.sum(dim=-1)  # +inf if any entry is +inf
    evictable = torch.isfinite(cost).sum(dim=(1, 2, 3))  # [S]
    take = torch.minimum(wanted, evictable)  # [S]
    if split is not None and not split.is_global:
        # Order candidates by how far their head is above its target before losing them.
        held_pages = padded_lens.squeeze(-1) // block_size  # [S, L, H]
        kept_slots = (held_pages.sum(dim=(1, 2)) - take) * block_size
        targets = keep_targets(split, values, held, protected, kept_slots)
        pages_left = held_pages.unsqueeze(-1) - torch.arange(num_rows, device=device)
        excess = pages_left.to(torch.float64) * block_size - targets.unsqueeze(-1)
        cost = torch.where(torch.isfinite(cost), -excess, torch.tensor(float("inf"), dtype=torch.float64, device=device))
    # [S, L * H * R], flattened in (layer, head, k) order for the stable tie-break.
    cost = cost.reshape(num_seqs, -1)
    _, block_order = torch.sort(cost, dim=-1, stable=True)
    chosen_sorted = torch.arange(cost.shape[-1], device=device) < take.unsqueeze(-1)
    chosen = torch.zeros_like(chosen_sorted).scatter_(-1, block_order, chosen_sorted)
    evict_blocks = chosen.view(num_seqs, num_layers, num_heads, num_rows).sum(dim=-1)

    # A head losing e blocks evicts its e * b lowest sorted entries, minus the empties.
    evicted_sorted = (slot < evict_blocks.unsqueeze(-1) * block_size) & ~sorted_empty
    evicted = torch.zeros_like(evicted_sorted).scatter_(-1, order, evicted_sorted)
    new_head_lens = torch.where(
        evict_blocks > 0,
        padded_lens.squeeze(-1) - evict_blocks * block_size,
        head_lens,
    )
    return EvictionPlan(
        evict_blocks=evict_blocks, evicted=evicted, new_head_lens=new_head_lens
    )
