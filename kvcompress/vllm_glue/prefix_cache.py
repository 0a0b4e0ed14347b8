"""vLLM's hash-based prefix cache over per-(layer, KV head) page groups (scheduler side).

vLLM's ``BlockPool`` keeps deciding what is cached, hit and evicted (hashes, reference
counts, LRU order of idle blocks). This module listens to it and keeps the page
counts and the worker in step:

- ``cache_full_blocks``: a cached block's ``L x H`` pages become a page group owned by
  the cache (``PageAccounting.cache_groups``). A compressed request caches only its
  first ``frozen`` blocks (hits, or ``--kv-compress-shared-prefix-tokens``): the rest
  of its context is compressed, so no later request may hit it.
- ``_maybe_evict_cached_block`` / ``reset_prefix_cache``: the cache lets go of groups.
- ``free_blocks``: idle cached groups in vLLM's eviction order, which
  :meth:`PrefixCacheGlue.reclaim` evicts when pages run short (vLLM's logical pool is
  virtual and large, so vLLM itself rarely needs to).

What happened is handed to the worker once per step (:class:`PrefixCacheStep`).
"""

from __future__ import annotations

from collections import OrderedDict

from vllm.logger import init_logger

from kvcompress.contract import CachedBlocks, PrefixCacheStep
from kvcompress.page_accounting import PageAccounting

logger = init_logger(f"vllm.{__name__}")


class PrefixCacheGlue:
    """Listens to vLLM's ``BlockPool`` (its methods are wrapped on the instance)."""

    def __init__(self, block_pool, accounting: PageAccounting, block_size: int, planner) -> None:
        if getattr(block_pool, "hash_block_size", block_size) != block_size:
            raise ValueError(
                f"kvcompress: prefix caching needs hash blocks of the page size {block_size} "
                f"(vLLM hashes {block_pool.hash_block_size}-token blocks)"
            )
        self.block_pool = block_pool
        self.accounting = accounting
        self.block_size = block_size
        self.planner = planner
        # Cached block id -> vLLM block; idle ones (ref_cnt 0) in vLLM's eviction order.
        self.groups: OrderedDict[int, object] = OrderedDict()
        # Admitted request -> its hit blocks (reset at each (re)admission).
        self.hits: dict[str, tuple[int, ...]] = {}
        self.step = PrefixCacheStep()
        self._cache_full_blocks = block_pool.cache_full_blocks
        self._maybe_evict = block_pool._maybe_evict_cached_block
        self._free_blocks = block_pool.free_blocks
        self._reset = block_pool.reset_prefix_cache
        block_pool.cache_full_blocks = self.cache_full_blocks
        block_pool._maybe_evict_cached_block = self.maybe_evict_cached_block
        block_pool.free_blocks = self.free_blocks
        block_pool.reset_prefix_cache = self.reset_prefix_cache

    # ------------------------------------------------------------------ requests

    def frozen_blocks(self, request) -> int | None:
        """Leading blocks of ``request`` that may be cached (None: all full blocks, as
        stock vLLM: the request is never compressed)."""
        budget = self.planner.budget(request)
        if not budget.compresses:
            return None
        hits = len(self.hits.get(request.request_id, ()))
        prefix = min(budget.cache_prefix_tokens, request.num_prompt_tokens) // self.block_size
        return max(hits, prefix)

    def shared_prefix_tokens(self, request) -> int:
        """Tokens of ``request`` kept whole as prefix-cache page groups."""
        frozen = self.frozen_blocks(request)
        return 0 if frozen is None else frozen * self.block_size

    def admit(self, request, new_computed_blocks, num_new_computed_tokens: int) -> None:
        """vLLM is about to allocate for a waiting or preempted request that hits
        ``num_new_computed_tokens`` cached tokens."""
        hits = ()
        if num_new_computed_tokens and new_computed_blocks is not None:
            count = num_new_computed_tokens // self.block_size
            hits = tuple(block.block_id for block in new_computed_blocks.blocks[0][:count])
        self.hits[request.request_id] = hits
        self.accounting.share_blocks(request.request_id, len(hits))

    def protected_hits(self, request_id: str) -> set[int]:
        return set(self.hits.get(request_id, ()))

    def on_freed(self, request_id: str) -> None:
        """The request's blocks went back to vLLM (finished or preempted). Blocks it
        cached this step were never computed if it was preempted before its forward:
        they leave the cache now."""
        self.hits.pop(request_id, None)
        step = self.step
        stale = [record for record in step.cached if record.request_id == request_id]
        if not stale:
            return
        step.cached = [record for record in step.cached if record.request_id != request_id]
        for record in stale:
            for block_id in record.block_ids:
                block = self.groups.get(block_id)
                if block is not None:
                    # The group was never filled: nothing to tell the worker.
                    self._maybe_evict(block)
                    del self.groups[block_id]
                    self.accounting.uncache_groups(1)

    # ------------------------------------------------------------------ BlockPool hooks

    def cache_full_blocks(
        self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
        block_mask=None,
    ) -> None:
        frozen = self.frozen_blocks(request)
        if frozen is not None and num_full_blocks > frozen:
            if block_mask is not None:
                block_mask = block_mask[: max(0, frozen - num_cached_blocks)]
            num_full_blocks = frozen
        if num_full_blocks <= num_cached_blocks:
            return
        self._cache_full_blocks(
            request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
            block_mask,
        )
        new_ids = []
        for block in blocks[num_cached_blocks:num_full_blocks]:
            if block.is_null or block.block_hash is None or block.block_id in self.groups:
                raise RuntimeError(f"kvcompress: block {block.block_id} was cached unexpectedly")
            self.groups[block.block_id] = block
            new_ids.append(block.block_id)
        self.step.cached.append(CachedBlocks(request.request_id, num_cached_blocks, tuple(new_ids)))
        self.accounting.cache_groups(len(new_ids))
        self.accounting.share_blocks(request.request_id, num_full_blocks)

    def maybe_evict_cached_block(self, block) -> bool:
        evicted = self._maybe_evict(block)
        if evicted and self.groups.pop(block.block_id, None) is not None:
            if block.ref_cnt:
                # Only KV connectors evict held blocks; kvcompress refuses them.
                raise RuntimeError(f"kvcompress: vLLM evicted block {block.block_id} while held")
            self.step.uncached.append(block.block_id)
            self.accounting.uncache_groups(1)
        return evicted

    def free_blocks(self, ordered_blocks) -> None:
        ordered_blocks = list(ordered_blocks)
        self._free_blocks(ordered_blocks)
        groups = self.groups
        for block in ordered_blocks:
            if block.ref_cnt == 0 and block.block_id in groups:
                groups.move_to_end(block.block_id)  # vLLM appends idle cached blocks last

    def reset_prefix_cache(self) -> bool:
        reset = self._reset()
        if reset and self.groups:
            self.step.uncached.extend(self.groups)
            self.accounting.uncache_groups(len(self.groups))
            self.groups.clear()
        return reset

    # ------------------------------------------------------------------ capacity

    def reclaim(self, pages_short: int, keep: set[int] = frozenset()) -> int:
        """Evict idle cached groups (vLLM's eviction order) until ``pages_short`` pages
        are free on every rank, sparing block ids ``keep``; returns groups evicted."""
        per_group = self.accounting.pages_per_token_block_per_rank
        wanted = -(-pages_short // per_group)
        victims = []
        for block_id, block in self.groups.items():
            if len(victims) >= wanted:
                break
            if block.ref_cnt == 0 and block_id not in keep:
                victims.append(block)
        for block in victims:
            self.block_pool._maybe_evict_cached_block(block)
        return len(victims)

    def take_step(self) -> PrefixCacheStep:
        """What the worker applies this step; recording starts again."""
        step, self.step = self.step, PrefixCacheStep()
        return step
