"""Head-as-sequence flattening, shared by the varlen paged-attention kernels that run
the per-head pool: vLLM's CPU kernel (:mod:`kvcompress.ops.cpu_attention`) and vLLM's
Triton ``unified_attention`` (:mod:`kvcompress.ops.unified_attention`).

Each (request, KV head) of one layer becomes one kernel sequence with ONE KV head and
``G = Hq / H`` query heads: its block-table row is that head's page ids, its length
that head's length.

- decode rows: kernel sequence ``r`` is row ``r // H``'s KV head ``r % H``; the query
  ``[B, Hq, D]`` is viewed ``[B * H, G, D]``: one kernel call;
- batches with prompt rows: one call over ``H * S`` sequences with the query regrouped
  head-major ``[H * T, G, D]`` (a copy); their starts (:func:`flat_query_starts`) are the
  same for every layer, so the runner puts them on the device once per step
  (``PagedBatch.flat_query_start_loc``): on CUDA a copy from pageable host memory at each
  layer's call would wait for the stream; or, for kernels that read the query's row
  stride (vLLM's CPU kernel) and long prompt chunks, one call per KV head over query
  column views (:func:`flat_prompt_by_head`).

A backend supplies ``attend(query, pool, out, query_start_loc, max_query_len, seq_lens,
max_seq_len, block_table, scale)``: one kernel call over sequences of one KV head
(``query`` / ``out`` ``[T, G, D]``; ``query_start_loc [R + 1]``, ``seq_lens [R]``,
``block_table [R, P]`` int32; the two maxima are host upper bounds).

The kernels return no probabilities: decode rows selected by a :class:`MetricSink` add
to the metrics through a pass of their own, the backend's (``metric_pass``: on CUDA the
project's Triton decode metric kernels, which read nothing on the host) or else
:func:`kvcompress.ops.decode_metrics.decode_metrics` (``torch``; it reads lengths and selected
rows on the host, a stream sync per layer on CUDA).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from kvcompress.ops.kv_pool import KVPool, MetricSink, PagedBatch, SlotBatch


class Attend(Protocol):
    def __call__(
        self, query: torch.Tensor, pool: KVPool, out: torch.Tensor,
        query_start_loc: torch.Tensor, max_query_len: int, seq_lens: torch.Tensor,
        max_seq_len: int, block_table: torch.Tensor, scale: float,
    ) -> None: ...


class PagedMetricPass(Protocol):
    """Decode rows of ``batch`` selected by ``metrics`` add to ``pool.slot_metrics``
    (``max_len``: a host bound on the heads' lengths)."""

    def __call__(
        self, query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
        metrics: MetricSink, max_len: int,
    ) -> None: ...


class SlotMetricPass(Protocol):
    """Rows of a slot-indexed decode selected by ``metrics`` add to ``pool.slot_metrics``."""

    def __call__(
        self, query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float, metrics: MetricSink,
    ) -> None: ...


def flat_decode(
    attend: Attend, query: torch.Tensor, pool: KVPool, tables: torch.Tensor,
    lens: torch.Tensor, max_len: int, scale: float, out: torch.Tensor,
) -> None:
    """Decode rows ``query [B, Hq, D]`` over ``tables [B, H, P]``, ``lens [B, H]`` into
    ``out [B, Hq, D]``: one call over ``B * H`` sequences. Heads with no KV (padding
    rows) are given one key (the kernels want >= 1; they read page 0) and get zeros;
    nothing is read on the host (``max_len`` is a host bound)."""
    rows, num_q_heads, head_dim = query.shape
    num_kv_heads = tables.shape[1]
    num_seqs = rows * num_kv_heads
    group = num_q_heads // num_kv_heads
    flat_lens = lens.reshape(num_seqs).to(torch.int32)
    empty = flat_lens == 0
    flat_query = query.contiguous().view(num_seqs, group, head_dim)
    flat_out = out.view(num_seqs, group, head_dim) if out.is_contiguous() else torch.empty_like(flat_query)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    block_table = tables.reshape(num_seqs, -1).to(torch.int32)
    attend(flat_query, pool, flat_out, starts, 1, flat_lens.clamp(min=1), max_len, block_table, scale)
    flat_out.masked_fill_(empty.view(num_seqs, 1, 1), 0)
    if flat_out.data_ptr() != out.data_ptr():
        out.copy_(flat_out.view(rows, num_q_heads, head_dim))


def flat_query_starts(starts: list[int], num_kv_heads: int) -> np.ndarray:
    """``[H * S + 1]`` int32 starts of the flattened sequences of a batch with prompt
    rows (:func:`flat_prompt`): sequence ``h * S + s`` owns rows
    ``h * T + starts[s] ... h * T + starts[s + 1]`` of the head-major query."""
    begins = np.asarray(starts[:-1], dtype=np.int64)
    num_rows = starts[-1]
    flat = (np.arange(num_kv_heads, dtype=np.int64)[:, None] * num_rows + begins[None, :]).reshape(-1)
    return np.append(flat, num_kv_heads * num_rows).astype(np.int32)


def flat_prompt_workspace_bytes(
    num_rows: int, num_seqs: int, num_kv_heads: int, num_q_heads: int, head_dim: int, dtype_bytes: int,
    num_pages: int,
) -> int:
    """Bytes :func:`flat_prompt` allocates for ``num_rows`` query rows of ``num_seqs``
    sequences over int32 tables of ``num_pages`` columns (the step's): the head-major
    query and its output, the flattened tables, lengths (int64 regrouped, then int32)
    and starts."""
    flat_seqs = num_kv_heads * num_seqs
    query_and_out = 2 * num_rows * num_q_heads * head_dim * dtype_bytes
    return query_and_out + flat_seqs * num_pages * 4 + flat_seqs * (8 + 4) + (flat_seqs + 1) * 4


def flat_prompt(
    attend: Attend, query: torch.Tensor, pool: KVPool, tables: torch.Tensor, lens: torch.Tensor,
    starts: list[int], max_len: int, scale: float, out: torch.Tensor,
    flat_starts: torch.Tensor | None = None, max_query_len: int | None = None,
) -> None:
    """A batch with prompt rows, ``query [T, Hq, D]`` (sequence ``s`` owns rows
    ``[starts[s], starts[s + 1])``) over ``tables [S, H, P]``, ``lens [S, H]`` into ``out``:
    one call over ``H * S`` sequences, sequence ``h * S + s`` being request ``s``'s KV
    head ``h`` with rows ``h * T + starts[s] ...`` of the query regrouped head-major
    ``[H * T, G, D]`` (one copy in, one out: a call per KV head costs more in host work
    on a GPU, 0.15-0.4 ms each, than the copies). ``flat_starts``: those sequences'
    starts on the device (:func:`flat_query_starts`), else copied here;
    ``max_query_len``: the longest chunk (``QueryLayout.longest_chunk``), else
    counted here. Allocates :func:`flat_prompt_workspace_bytes`."""
    num_rows, num_q_heads, head_dim = query.shape
    num_seqs, num_kv_heads = lens.shape
    group = num_q_heads // num_kv_heads
    by_head = query.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
    flat_query = by_head.reshape(num_kv_heads * num_rows, group, head_dim)
    flat_out = torch.empty_like(flat_query)
    if flat_starts is None:
        flat_starts = torch.from_numpy(flat_query_starts(starts, num_kv_heads)).to(query.device)
    if max_query_len is None:
        max_query_len = max(starts[s + 1] - starts[s] for s in range(num_seqs))
    attend(
        flat_query, pool, flat_out, flat_starts,
        max_query_len, lens.t().reshape(-1).to(torch.int32), max_len,
        tables.transpose(0, 1).reshape(num_kv_heads * num_seqs, -1).to(torch.int32), scale,
    )
    out.view(num_rows, num_kv_heads, group, head_dim).copy_(
        flat_out.view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1))


def flat_prompt_by_head(
    attend: Attend, query: torch.Tensor, pool: KVPool, tables: torch.Tensor, lens: torch.Tensor,
    starts: list[int], max_query_len: int, max_len: int, scale: float, out: torch.Tensor,
) -> None:
    """:func:`flat_prompt` as one call per KV head ``h`` over the ``S`` sequences' head
    ``h``, for kernels that read the query's row stride (vLLM's CPU kernel): the query
    is a column view ``[T, G, D]`` of ``query`` (no copy), each call's output a
    contiguous ``[T, G, D]`` buffer copied into ``out``'s columns. On CPU, with long
    prompt chunks, this beats the single call (2-3% for one 2040-token chunk, 28% for
    two 512-token chunks with 3 KV heads, tiny shapes, 2 cores): the query regroup
    copy is gone and the kernel's split of one call over ``H * S`` sequences is less
    even than ``H`` splits of ``S``."""
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = lens.shape[1]
    group = num_q_heads // num_kv_heads
    head_out = torch.empty((num_rows, group, head_dim), dtype=query.dtype, device=query.device)
    head_lens = lens.t().contiguous().to(torch.int32)  # [H, S]
    head_tables = tables.transpose(0, 1).contiguous().to(torch.int32)  # [H, S, P]
    query_starts = torch.tensor(starts, dtype=torch.int32, device=query.device)
    for head in range(num_kv_heads):
        columns = slice(head * group, (head + 1) * group)
        attend(query[:, columns], pool, head_out, query_starts, max_query_len,
               head_lens[head], max_len, head_tables[head], scale)
        out[:, columns].copy_(head_out)


def paged_attention_flat(
    attend: Attend, query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None,
    metric_pass: PagedMetricPass | None = None, by_head_from: int | None = None,
) -> torch.Tensor:
    """:func:`kvcompress.ops.reference_attention.reference_paged_attention` through ``attend``; the
    decode queries selected by ``metrics`` add to ``pool.slot_metrics`` through
    ``metric_pass`` (default :func:`torch_decode_metrics`). ``by_head_from``: batches
    with a prompt chunk of at least this many rows run :func:`flat_prompt_by_head`
    (None: never; ``attend`` must read the query's row stride)."""
    if out is None:
        out = torch.empty_like(query)
    if batch.block_tables.shape[0] == 0:
        return out
    starts = batch.query_start_loc
    num_rows = starts[-1]
    max_len = batch.max_head_len if batch.max_head_len is not None else int(batch.head_lens.max())
    tables = batch.block_tables[:, :, : max(1, -(-max_len // pool.block_size))]
    # The step's layout: no layer scans the rows (kvcompress.ops.kv_pool.QueryLayout).
    longest_chunk = batch.layout.longest_chunk
    if batch.decode_only():
        flat_decode(attend, query[:num_rows], pool, tables, batch.head_lens, max_len, scale, out[:num_rows])
    elif by_head_from is not None and longest_chunk >= by_head_from:
        flat_prompt_by_head(attend, query[:num_rows], pool, tables, batch.head_lens, starts, longest_chunk,
                            max_len, scale, out[:num_rows])
    else:
        flat_prompt(attend, query[:num_rows], pool, tables, batch.head_lens, starts, max_len, scale,
                    out[:num_rows], flat_starts=batch.flat_query_start_loc, max_query_len=longest_chunk)
    if metrics is not None:
        (metric_pass or torch_decode_metrics)(query, pool, batch, scale, metrics, max_len)
    return out


def torch_decode_metrics(
    query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float, metrics: MetricSink,
    max_len: int,
) -> None:
    """:class:`PagedMetricPass` in ``torch`` (:func:`kvcompress.ops.decode_metrics.decode_metrics`
    over the selected decode rows; their indices are read on the host)."""
    from kvcompress.ops.decode_metrics import decode_metrics

    starts = batch.query_start_loc
    first_rows = torch.tensor(starts, dtype=torch.int64, device=query.device)
    decoding = first_rows.diff() == 1
    seqs = (decoding & metrics.selected.to(torch.bool)).nonzero().squeeze(1)
    if seqs.numel():
        tables = batch.block_tables[:, :, : max(1, -(-max_len // pool.block_size))]
        decode_metrics(
            query[first_rows[seqs]], pool, tables[seqs], batch.head_lens[seqs], scale, metrics.power,
        )


def decode_by_slot_flat(
    attend: Attend, query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None,
    metric_pass: SlotMetricPass | None = None,
) -> torch.Tensor:
    """:func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference` through
    ``attend``: the rows' tables are gathered from the slot tables (only the pages some
    row holds; one host read of the longest head), then one flattened call and the
    metric pass over the selected rows (``metric_pass``, else ``torch`` over the
    gathered tables)."""
    from kvcompress.ops.decode_metrics import decode_metrics

    out = torch.empty_like(query) if out is None else out
    num_rows = batch.seq_slots.numel()
    if num_rows == 0:
        return out
    gathered = batch.gathered(pool.block_size)
    tables, lens = gathered.block_tables, gathered.head_lens
    max_len = tables.shape[2] * pool.block_size  # the gathered pages' bound
    flat_decode(attend, query[:num_rows], pool, tables, lens, max_len, scale, out[:num_rows])
    if metrics is not None and metric_pass is not None:
        metric_pass(query[:num_rows], pool, batch, scale, metrics)
    elif metrics is not None:
        selected = metrics.selected[batch.seq_slots.to(torch.int64)].to(torch.bool)
        if bool(selected.any()):
            decode_metrics(
                query[:num_rows][selected], pool, tables[selected], lens[selected], scale,
                metrics.power,
            )
    return out
