"""The page groups of the blocks vLLM's prefix cache holds (worker side, no vLLM).

While a request's heads are uncompressed, column ``j`` of every (layer, KV head) holds
exactly tokens ``[j*b, (j+1)*b)``: those ``L x H`` pages ARE logical block ``j``'s KVs.
When vLLM caches a block (its hash enters the prefix cache), the cache takes one
reference on each of the block's pages (:meth:`PrefixGroups.register`); a request
that hits the block points its own columns at the same pages
(``PerHeadPagedCache.fill_prefix``, one reference more each); when vLLM evicts the
block's hash the cache lets go (:meth:`PrefixGroups.drop`). A page returns to the
free stack when its last holder lets go (``page_shares``).
"""

from __future__ import annotations

import torch

from kvcompress.ops.allocator import add_references, drop_references
from kvcompress.ops.paged_cache import PerHeadPagedCache


class PrefixGroups:
    """vLLM block id -> ``[L, H]`` page ids of the block, for every cached block."""

    def __init__(self, cache: PerHeadPagedCache) -> None:
        self.cache = cache
        self.pages: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.pages)

    def register(self, slot: int, first_column: int, block_ids: list[int]) -> None:
        """The cache takes columns ``first_column ..`` of ``slot``'s heads as the page
        groups of ``block_ids`` (one per column, in order)."""
        count = len(block_ids)
        if count == 0:
            return
        known = [block_id for block_id in block_ids if block_id in self.pages]
        if known:
            raise RuntimeError(f"prefix groups: blocks {known} are already cached")
        cache = self.cache
        end = first_column + count
        if int(cache.head_lens[slot].min()) < end * cache.block_size:
            raise RuntimeError(f"prefix groups: slot {slot} holds fewer than {end} full pages per head")
        slots = torch.tensor([slot], dtype=torch.int64, device=cache.device)
        columns = cache.tables.gather(slots, end)[0, ..., first_column:]  # [L, H, count]
        for index, block_id in enumerate(block_ids):
            self.pages[block_id] = columns[..., index].clone()
        add_references(columns, cache.page_shares)
        # Whoever hits them reads them after this slot lets go of its metadata rows.
        cache.to_identity_rows(slot, first_column, end)

    def pages_of(self, block_ids: list[int]) -> torch.Tensor:
        """``[n, L, H]`` int32 page ids of cached blocks ``block_ids``."""
        missing = [block_id for block_id in block_ids if block_id not in self.pages]
        if missing:
            raise RuntimeError(f"prefix groups: blocks {missing} are not cached")
        return torch.stack([self.pages[block_id] for block_id in block_ids])

    def drop(self, block_ids) -> int:
        """The cache lets go of ``block_ids``' groups; returns pages freed (those no
        request holds any more)."""
        groups = [self.pages.pop(block_id) for block_id in block_ids if block_id in self.pages]
        if not groups:
            return 0
        cache = self.cache
        return drop_references(torch.stack(groups), cache.page_shares, cache.allocator)
