"""The allocator's page-table scatter, PyTorch reference (the CUDA op is
``torch.ops.kvcompress.allocate_pages``; :mod:`kvcompress.ops.dispatch` picks).

Its own module so that both :mod:`kvcompress.ops.paged_cache` (the caller) and
:mod:`kvcompress.ops.dispatch` (the backend choice) import it without importing each
other both ways.
"""

from __future__ import annotations

import torch


def fill_page_tables(
    page_tables: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
    first_column: torch.Tensor, rows: torch.Tensor,
) -> None:
    """Hand freshly allocated pages to their requesters' page tables (reference).

    Args:
        page_tables: contiguous int64 ``[..., P]``, addressed as ``[num_rows, P]``
            (the cache's ``[max_seqs, L, H, P]``: ``row = seq_slot * L * H + layer * H + head``).
        pages: ``[offsets[-1]]`` int64 page ids, requester ``r`` owns
            ``pages[offsets[r]:offsets[r + 1]]``.
        offsets: ``[R + 1]`` int64 exclusive prefix sum of the demands.
        first_column: ``[R]`` int64 first new column of each requester (its old page count).
        rows: ``[R]`` int64 page-table row of each requester.

    Requester ``r`` gets ``page_tables[rows[r], first_column[r] + j] = pages[offsets[r] + j]``.
    """
    demand = offsets[1:] - offsets[:-1]
    requester = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), demand)
    within = torch.arange(pages.numel(), device=pages.device) - offsets[requester]
    table = page_tables.view(-1, page_tables.shape[-1])
    table[rows[requester], first_column[requester] + within] = pages
