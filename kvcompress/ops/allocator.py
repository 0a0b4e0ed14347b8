"""On-device parallel page allocator for the per-(layer, KV head) cache.

One pool of ``num_pages`` physical pages; each page holds ``block_size`` tokens of
ONE (layer, KV head). Free pages sit on a stack (a tensor); allocation pops a
contiguous slice of it and hands pages out to many (sequence, layer, head)
requesters at once with a prefix sum over their demands, so no per-page Python
loop runs no matter how many pages move.
"""

from __future__ import annotations

import torch


class OutOfPagesError(RuntimeError):
    """Raised when more pages are requested than the pool has free."""


class PageAllocator:
    """Free-page stack over page ids ``[0, num_pages)``.

    Attributes:
        free_stack: ``[num_pages]`` int64; entries ``[0, num_free)`` are free page ids.
        num_free: number of free pages (kept as a Python int: the scheduler-side
            accounting mirrors it, and reading it must not sync a device).
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu") -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self.device = torch.device(device)
        # Reversed so that low page ids are handed out first (easier to read in dumps).
        self.free_stack = torch.arange(
            num_pages - 1, -1, -1, dtype=torch.int64, device=self.device
        )
        self.num_free = num_pages

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, count: int) -> torch.Tensor:
        """Pop ``count`` pages. Returns ``[count]`` int64 page ids."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > self.num_free:
            raise OutOfPagesError(
                f"requested {count} pages but only {self.num_free} of "
                f"{self.num_pages} are free"
            )
        start = self.num_free - count
        pages = self.free_stack[start : self.num_free]
        # Ascending ids: a requester given several pages (a head's prompt pages) gets
        # them as contiguous as the popped set allows, which the attention kernels read
        # faster than scattered pages (benchmarks/kernels/bench_cpu_page_size.py --orders).
        pages = pages.sort().values if count > 1 else pages.clone()
        self.num_free = start
        return pages

    def allocate_for(self, demand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate ``demand[i]`` pages for each requester ``i`` in one pop.

        Args:
            demand: ``[R]`` int64, pages wanted per requester.

        Returns:
            ``(pages [sum(demand)], offsets [R + 1])``: requester ``i`` owns
            ``pages[offsets[i]:offsets[i + 1]]`` (exclusive prefix sum of demand).
        """
        offsets = torch.zeros(demand.numel() + 1, dtype=torch.int64, device=demand.device)
        torch.cumsum(demand.reshape(-1), dim=0, out=offsets[1:])
        total = int(offsets[-1].item())
        return self.allocate(total), offsets

    def free(self, pages: torch.Tensor) -> None:
        """Push pages back. ``pages``: any-shape int64 tensor of page ids in use."""
        pages = pages.reshape(-1).to(device=self.device, dtype=torch.int64)
        count = pages.numel()
        if self.num_free + count > self.num_pages:
            raise RuntimeError(
                f"freeing {count} pages would exceed the pool size {self.num_pages} "
                f"({self.num_free} already free): double free"
            )
        self.free_stack[self.num_free : self.num_free + count] = pages
        self.num_free += count


def add_references(ids: torch.Tensor, shares: torch.Tensor) -> None:
    """One more holder for each entry of ``ids`` (page or chunk ids; ``shares`` as in
    :func:`drop_references`)."""
    ids = ids.reshape(-1).to(device=shares.device, dtype=torch.int64)
    shares.index_add_(0, ids, torch.ones(ids.numel(), dtype=shares.dtype, device=shares.device))


def drop_references(ids: torch.Tensor, shares: torch.Tensor, allocator: PageAllocator) -> int:
    """Let go of one reference per entry of ``ids`` (page or chunk ids, repeats allowed:
    one per holder letting go) and free the ids nobody holds any more.

    ``shares``: ``[num_ids]`` int32, holders of each id beyond the first (0 for an id with
    one holder, as every freshly allocated id). Returns how many ids were freed. An id
    let go of more often than it has holders is a double free (``RuntimeError``).
    """
    ids = ids.reshape(-1).to(device=shares.device, dtype=torch.int64)
    if ids.numel() == 0:
        return 0
    if not bool((shares[ids] > 0).any()):  # nothing shared: every id's only holder lets go
        allocator.free(ids)
        return ids.numel()
    unique, counts = torch.unique(ids, return_counts=True)
    holders_left = shares[unique].to(torch.int64) + 1 - counts
    if bool((holders_left < 0).any()):
        raise RuntimeError("dropping more references than an id has holders: double free")
    freed = unique[holders_left == 0]
    shares[unique] = (holders_left - 1).clamp(min=0).to(shares.dtype)
    allocator.free(freed)
    return freed.numel()
