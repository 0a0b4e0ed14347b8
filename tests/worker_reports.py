"""The report of a worker whose heads are exactly the scheduler's, for tests of the
scheduler's side (``compression_planner.py``)."""

from __future__ import annotations

import numpy as np

from kvcompress.contract import WorkerReport
from kvcompress.page_accounting import PageAccounting


def report_of_scheduler_heads(accounting: PageAccounting, shrink: dict[str, np.ndarray], records=(),
                              evict_mismatches: int = 0) -> WorkerReport:
    """What a worker holding exactly ``accounting``'s heads, after ``shrink`` (request id
    -> ``[layers, kv_heads]`` head lengths of the compressed requests), reports: each
    request's pages counted by hand (``ceil(len / block_size)`` per head), the rest of
    the pool free."""
    block = accounting.block_size
    held = {}
    for request_id in accounting.request_ids():
        lens = shrink.get(request_id, accounting.head_lens_of(request_id))
        held[request_id] = int(((lens + block - 1) // block).sum())
    return WorkerReport(
        free_pages=accounting.num_pages - sum(held.values()), pages_held=held, head_lens=shrink,
        compressions=list(records), evict_mismatches=evict_mismatches,
    )
