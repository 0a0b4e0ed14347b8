"""vLLM's KV-cache manager with capacity decided in per-(layer, KV head) pages.

vLLM's ``KVCacheManager`` keeps handing out *logical* token blocks (the worker's
block table and vLLM's bookkeeping still want them), but over a virtual pool
large enough never to be the binding limit. Whether a request may be admitted
or extended is decided by ``PageAccounting``: the pages its heads would hold,
``sum over (layer, head) of ceil(head_len / block_size)``, against the pages of
the real pool.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheManager

from kvcompress.page_accounting import PageAccounting

logger = init_logger(f"vllm.{__name__}")


class _AllocateArgs(NamedTuple):
    """The arguments of ``KVCacheManager.allocate_slots`` that decide capacity."""

    num_new_tokens: int
    num_new_computed_tokens: int
    new_computed_blocks: object
    num_lookahead_tokens: int
    num_external_computed_tokens: int
    full_sequence_must_fit: bool
    reserved_blocks: int
    has_scheduled_reqs: bool


def _allocate_args(
    request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
    num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
    num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
    has_scheduled_reqs=True, skip_zeroing_group_ids=(),
) -> _AllocateArgs:
    # Binds like vLLM's signature (checked at import) at Python call speed; inspect's
    # Signature.bind cost tens of microseconds per call, twice per request per step.
    return _AllocateArgs(
        num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
        num_external_computed_tokens, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
    )


def _check_allocate_signature() -> None:
    ours = list(inspect.signature(_allocate_args).parameters.values())
    theirs = list(inspect.signature(KVCacheManager.allocate_slots).parameters.values())[1:]
    if [(p.name, p.default) for p in ours] != [(p.name, p.default) for p in theirs]:
        raise ImportError(
            "kvcompress: vLLM's KVCacheManager.allocate_slots signature changed "
            f"({[p.name for p in theirs]}); kvcompress supports vLLM 0.32.0"
        )


_check_allocate_signature()


# Methods of vLLM's KVCacheManager its scheduler calls every step (vLLM 0.32).
_BOUND_ONCE = frozenset({
    "new_step_starts", "take_new_block_ids", "take_events", "take_kv_cache_block_copies",
    "take_boundary_state_offloads", "make_prefix_cache_stats", "record_prefix_cache_stats",
    "get_blocks", "get_block_ids", "remove_skipped_blocks",
    "get_block_ids_for_computed_tokens", "finalize_partial_tail_offloads",
})


class KVCompressKVCacheManager:
    """Wraps vLLM's ``KVCacheManager``; capacity is decided in per-head pages.

    Every attribute not defined here is the inner manager's.
    """

    def __init__(
        self,
        inner: KVCacheManager,
        accounting: PageAccounting,
        max_model_len: int,
        watermark: float,
        relieve=None,
        on_admission_short=None,
        on_release=None,
        prefix_cache=None,
        compresses=None,
        in_flight_tokens: int = 0,
    ) -> None:
        self._inner = inner
        self._inner_allocate = inner.allocate_slots
        self.accounting = accounting
        self._capacity = accounting.capacity  # the fast path's bound, request id -> tokens
        self._deferred = accounting.deferred_growth  # the fast path's grants (grow_in_room)
        self.max_model_len = max_model_len
        # Pages kept free when admitting a request that never compresses / compresses.
        self.watermark_pages = (watermark_pages(watermark, accounting, False), watermark_pages(watermark, accounting, True))
        # relieve(request, pages_short) compresses other requests instead of preempting.
        self.relieve = relieve
        # on_admission_short(pages_short) hears that a waiting request was refused pages.
        self.on_admission_short = on_admission_short
        # on_release(request_id, pages) hears of every request whose pages go back
        # (``[num_ranks]`` pages per rank's pool).
        self.on_release = on_release
        # PrefixCacheGlue with --enable-prefix-caching: idle cached page groups are
        # evicted before any request is compressed or preempted for pages.
        self.prefix_cache = prefix_cache
        # compresses(request): whether the request ever compresses (its metadata pages
        # count only then: PageAccounting.note_compresses); None: never.
        self.compresses = compresses
        # vLLM's max_in_flight_tokens: what the admission gate lets a sliding-window head
        # hold past its window (PageAccounting.whole_sequence_shortfall).
        self.in_flight_tokens = in_flight_tokens
        self._refusal_logged = False

    def __getattr__(self, name: str):
        value = getattr(self._inner, name)
        if name in _BOUND_ONCE:
            # vLLM calls these once or more every step: bind them here (an instance
            # attribute), sparing the failed lookup that reaches __getattr__ each time.
            setattr(self, name, value)
        return value

    @property
    def usage(self) -> float:
        return self.accounting.num_used_pages / max(1, self.accounting.total_pages)

    def allocate_slots(self, request, num_new_tokens, *args, num_lookahead_tokens=None, **kwargs):
        if num_lookahead_tokens is not None and not args and not kwargs:
            # vLLM's call for a running request: (request, num_new_tokens,
            # num_lookahead_tokens=...). Rows whose heads take the tokens in pages they
            # hold (most decode rows) need no page count, only vLLM's logical blocks:
            # two dict reads and a dict write here.
            request_id = request.request_id
            capacity = self._capacity.get(request_id)
            if capacity is not None:
                target_tokens = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
                if target_tokens > self.max_model_len:
                    target_tokens = self.max_model_len
                if target_tokens <= capacity:
                    blocks = self._inner_allocate(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
                    if blocks is None:
                        return self._refused(request)
                    # PageAccounting.grow_in_room, inlined (a call per running request).
                    deferred = self._deferred
                    if target_tokens > deferred.get(request_id, 0):
                        deferred[request_id] = target_tokens
                    return blocks
        if num_lookahead_tokens is not None:
            kwargs["num_lookahead_tokens"] = num_lookahead_tokens
        return self._allocate_counted(request, num_new_tokens, *args, **kwargs)

    def _allocate_counted(self, request, *args, **kwargs):
        """``allocate_slots`` when pages may be needed: counted, reserved, relieved."""
        blocks = self._allocate_counted_or_none(request, *args, **kwargs)
        if blocks is None and self.prefix_cache is not None:
            request_id = request.request_id
            if self.accounting.logical_len(request_id) == 0:
                self.accounting.release(request_id)  # refused before it held a page: no row
        return blocks

    def _allocate_counted_or_none(self, request, *args, **kwargs):
        arg = _allocate_args(request, *args, **kwargs)
        accounting = self.accounting
        request_id = request.request_id
        target_tokens = min(
            request.num_computed_tokens
            + arg.num_new_computed_tokens
            + arg.num_external_computed_tokens
            + arg.num_new_tokens
            + arg.num_lookahead_tokens,
            self.max_model_len,
        )
        # Pages left free on every rank (each TP rank's pool is its own resource).
        reserve = arg.reserved_blocks * accounting.pages_per_token_block_per_rank
        admitting = request.status.name in ("WAITING", "PREEMPTED")
        if admitting and self.compresses is not None and not accounting.holds(request_id):
            accounting.note_compresses(request_id, self.compresses(request))
        if arg.has_scheduled_reqs and admitting:
            reserve += self.watermark_pages[accounting.compresses_of(request_id)]
        prefix_cache = self.prefix_cache
        if prefix_cache is not None and admitting:
            # Hit blocks are the cache's page groups: only the rest is counted.
            prefix_cache.admit(request, arg.new_computed_blocks, arg.num_new_computed_tokens)
        if arg.full_sequence_must_fit:
            full_tokens = max(min(request.num_tokens, self.max_model_len), target_tokens)
            short = self._shortfall(request_id, full_tokens, reserve, whole_sequence=True)
            if short > 0:
                return self._admission_refused(short) if admitting else None
        short = self._shortfall(request_id, target_tokens, reserve)
        if short > 0 and self.relieve is not None and request.status.name == "RUNNING":
            self.relieve(request, short)
            short = accounting.shortfall(request_id, target_tokens, reserve)
        if short > 0:
            return self._admission_refused(short) if admitting else None
        blocks = self._inner.allocate_slots(request, *args, **kwargs)
        if blocks is None:
            return self._refused(request)
        accounting.grow(request_id, target_tokens)
        return blocks

    def _admission_refused(self, pages_short: int) -> None:
        if self.on_admission_short is not None:
            self.on_admission_short(pages_short)
        return None

    def _shortfall(self, request_id: str, target_tokens: int, reserve: int, whole_sequence: bool = False) -> int:
        """``PageAccounting.shortfall`` (``whole_sequence``: vLLM's admission gate,
        ``whole_sequence_shortfall``) after evicting idle cached page groups for it."""
        short = self._count_shortfall(request_id, target_tokens, reserve, whole_sequence)
        if short > 0 and self.prefix_cache is not None:
            if self.prefix_cache.reclaim(short, keep=self.prefix_cache.protected_hits(request_id)):
                short = self._count_shortfall(request_id, target_tokens, reserve, whole_sequence)
        return short

    def _count_shortfall(self, request_id: str, target_tokens: int, reserve: int, whole_sequence: bool) -> int:
        if whole_sequence:
            return self.accounting.whole_sequence_shortfall(request_id, target_tokens, self.in_flight_tokens, reserve)
        return self.accounting.shortfall(request_id, target_tokens, reserve)

    def _refused(self, request) -> None:
        """vLLM's logical block pool refused a request the pages allow: the running
        sequences hold more than ``LOGICAL_OVERCOMMIT`` times the tokens the pool holds
        uncompressed (vLLM then preempts or waits, as with a full pool)."""
        if not self._refusal_logged:
            self._refusal_logged = True
            logger.warning(
                "kvcompress: vLLM's logical block pool (sized for %dx the tokens the page "
                "pool holds uncompressed) refused request %s although %d pages are free; "
                "requests wait or are preempted until blocks return (logged once)",
                LOGICAL_OVERCOMMIT, request.request_id, self.accounting.num_free_pages,
            )

    def _release(self, request_id: str) -> None:
        shared = self.accounting.shared_blocks_of(request_id)
        pages = self.accounting.release_by_rank(request_id)
        if self.prefix_cache is not None:
            self.prefix_cache.on_freed(request_id)
        if self.on_release is not None:
            self.on_release(request_id, pages, shared)

    def free(self, request) -> None:
        self._release(request.request_id)
        self._inner.free(request)

    def pop_blocks_for_free(self, request):
        self._release(request.request_id)
        return self._inner.pop_blocks_for_free(request)


# vLLM's logical blocks cover at most this many times the tokens the pool holds
# uncompressed: each is a Python object (a 50 GB pool of Llama-3.1-8B pages would
# otherwise make ~6M of them: ~10 s and ~0.8 GiB of host memory at startup).
LOGICAL_OVERCOMMIT = 64


def logical_block_count(
    num_pages: int, max_num_seqs: int, max_model_len: int, block_size: int,
    pages_per_token_block: int = 1,
) -> int:
    """Size of the virtual logical-block pool (+1 for vLLM's null block): every running
    request at full length, but no more than ``LOGICAL_OVERCOMMIT`` times the token
    blocks the pool holds uncompressed (``num_pages / pages_per_token_block``, the
    latter ``L * H``), and never fewer than one request at full length. Past that
    (sequences compressed more than 64x on average) vLLM's pool refuses and vLLM
    preempts, as it does when stock vLLM's pool is full."""
    per_request = -(-max_model_len // block_size)
    uncompressed = num_pages // max(1, pages_per_token_block)
    overcommitted = max(per_request, LOGICAL_OVERCOMMIT * uncompressed)
    return min(num_pages, max_num_seqs * per_request, overcommitted) + 1


def watermark_pages(watermark: float, accounting: PageAccounting, compresses: bool) -> int:
    """vLLM's ``--watermark`` (a fraction of the pool kept free when admitting) in pages of
    one rank's pool for admitting a request that ``compresses`` (``int(watermark x
    pages)``) or not: then whole as stock vLLM's, ``int(watermark x blocks)`` of the blocks
    such a request is counted in (``grant_pages`` pages per head)."""
    if compresses:
        return int(watermark * accounting.num_pages)
    group = accounting.grant_pages * accounting.pages_per_token_block_per_rank
    return int(watermark * (accounting.num_pages // group)) * group
