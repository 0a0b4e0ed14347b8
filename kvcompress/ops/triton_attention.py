"""Triton attention over the per-(layer, KV head) paged cache.

Same call and semantics as the PyTorch reference
:func:`kvcompress.ops.reference_attention.reference_paged_attention` (the oracle), taking the
:mod:`kvcompress.ops.kv_pool` arguments: one layer of a mixed batch, block tables
``[S, H_kv, P]``, per-head lengths ``[S, H_kv]``, a key is
visible to a query iff its slot index is ``< head_len`` and its stored token position
is ``<=`` the query's position; query head ``j`` reads KV head ``j // G``.

Kernels:

- decode (sequences with one query): grid ``(decode seq, KV head, partition)``; each
  program reads the pages of one partition of one head once for all ``G`` query heads
  of that KV head (the group is padded to 16 rows for ``tl.dot``), online softmax in
  float32. With more than one partition each program stores its max, exp-sum and
  normalised partial output, and a reduce kernel combines them (vLLM paged attention
  v2). With one partition the output is written directly (v1).
- decode metrics (continual compression): a second pass over the same grid, only
  for sequences selected by the ``MetricSink``; it recomputes the scores, normalises them
  with the global max / sum from the stats and atomically adds
  ``sum_over_group(prob ** metric_power)`` into ``slot_metrics`` at the visible slots
  it reads (sparse: nothing else in the pool is touched).
- varlen (sequences with more than one query: prefill and chunked-prefill
  continuations): grid ``(query block, KV head)``; a query block holds
  ``BLOCK_M // G`` query tokens x ``G`` heads as ``BLOCK_M`` rows and iterates over all
  of its head's pages with online softmax, causal by stored position (positions are
  not monotonic in slot order after compaction, so no tile is skipped).

Each tensor's strides reach a kernel as one tuple (``q_strides``, ``k_strides``, ...,
in the tensor's dimension order), which the JIT specialises element by element as it
does scalar arguments (a stride of 1 becomes a constant).

Importable without triton (``HAS_TRITON`` is then False and the launchers raise).
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests); there bf16
``tl.dot`` is emulated (operands rounded to bf16, multiplied in float32) because the
interpreter's bf16 matmul is wrong.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from kvcompress.ops.decode_by_slot import MAX_GRAPH_PARTITIONS
from kvcompress.ops.kv_pool import FP8_PAGE_DTYPES, KVPool, MetricSink, PagedBatch, SlotBatch, host_to_device

try:  # pragma: no cover - exercised where triton exists
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken triton install
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "interpreter_active",
    "decode_metrics_triton",
    "decode_workspace_bytes",
    "paged_attention_triton",
    "paged_decode_by_slot_triton",
]

DEFAULT_PARTITION_SIZE = 512


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# The window of full attention in the kernels (tokens): every stored position is above
# ``qpos - NO_WINDOW`` (positions are int32 and never negative).
NO_WINDOW = 1 << 30


def _window_arg(window: int | None) -> int:
    """A layer's sliding window as the kernels take it (``NO_WINDOW``: full attention)."""
    if window is None:
        return NO_WINDOW
    if not 1 <= int(window) < NO_WINDOW:
        raise ValueError(f"sliding window must be in [1, {NO_WINDOW}), got {window}")
    return int(window)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if HAS_TRITON:
    # NO_WINDOW where a kernel body needs it (a jit body reads globals only as constexpr).
    _NO_WINDOW = tl.constexpr(NO_WINDOW)

    @triton.jit
    def _dot(a, b, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """``a @ b`` with float32 accumulation, operands in ``DOT_DTYPE``."""
        a = a.to(DOT_DTYPE)
        b = b.to(DOT_DTYPE)
        if EMULATE:  # interpreter: bf16 operands, float32 product
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _offset2(strides, i, j):
        """Element offset of index ``(i, j)`` of a 2-D tensor with ``strides`` (the
        indices broadcast)."""
        return i * strides[0] + j * strides[1]

    @triton.jit
    def _offset3(strides, i, j, k):
        """Element offset of index ``(i, j, k)`` of a 3-D tensor with ``strides``."""
        return i * strides[0] + j * strides[1] + k * strides[2]

    @triton.jit
    def _decode_program(dec_seq_ptr, dec_tok_ptr, lens_ptr, len_strides):
        """This decode program's ``(row, KV head, partition, sequence, query token, head
        length)``: grid axes 0-2, the row's sequence and token, the head's KVs."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        part = tl.program_id(2)
        seq = tl.load(dec_seq_ptr + b).to(tl.int64)
        tok = tl.load(dec_tok_ptr + b).to(tl.int64)
        head_len = tl.load(lens_ptr + _offset2(len_strides, seq, h)).to(tl.int64)
        return b, h, part, seq, tok, head_len

    @triton.jit
    def _page_ids(bt_base, chunk_ptr, slot, held, stride_bp, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
        """Page ids of logical slots ``slot`` of a head whose table starts at ``bt_base``:
        one level (``CHUNK == 0``) or two (chunk ids, then ``[num_chunks, CHUNK]`` pages)."""
        column = slot // BLOCK_SIZE
        if CHUNK == 0:
            page = tl.load(bt_base + column * stride_bp, mask=held, other=0)
        else:
            chunk = tl.load(bt_base + (column // CHUNK) * stride_bp, mask=held, other=0).to(tl.int64)
            page = tl.load(chunk_ptr + chunk * CHUNK + column % CHUNK, mask=held, other=0)
        return page.to(tl.int64)

    @triton.jit
    def _online_softmax(s, m_i, l_i):
        """One tile of online softmax over masked scores ``s [rows, TILE]`` (-inf: not
        visible), given the running row maxima ``m_i`` and exp-sums ``l_i``: ``(p, alpha,
        l_i, m_new)`` with ``p = exp(s - m_new)`` and ``alpha`` rescaling the old state."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        return p, alpha, l_i * alpha + tl.sum(p, 1), m_new

    @triton.jit
    def _load_group_query(q_ptr, tok, qh, row_ok, d, d_ok, q_strides):
        """Query token ``tok``'s heads ``qh`` (the group of one KV head) ``[GROUP_PAD, HEAD_PAD]``."""
        return tl.load(
            q_ptr + _offset3(q_strides, tok, qh[:, None], d[None, :]),
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )

    @triton.jit
    def _score_tile(
        q, k_ptr, pos_ptr, bt_base, chunk_ptr, start, end, qpos, window, d, d_ok, scale,
        k_strides, pos_strides, stride_bp,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr,
        DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Scores of the query rows ``q [rows, HEAD_PAD]`` against the keys of a head's
        logical slots ``[start, start + TILE)`` (those below ``end`` held; the head's table
        row at ``bt_base``): ``(page, offset, held [TILE], visible to queries at qpos,
        scale * q @ k^T [rows, TILE])``; ``qpos`` a scalar (visible ``[TILE]``) or a
        column ``[rows, 1]`` (visible ``[rows, TILE]``). Visible: stored position in
        ``(qpos - window, qpos]`` (``NO_WINDOW``: any at or before ``qpos``)."""
        slot = start + tl.arange(0, TILE)
        held = slot < end
        page = _page_ids(bt_base, chunk_ptr, slot, held, stride_bp, BLOCK_SIZE, CHUNK)
        off = slot % BLOCK_SIZE
        kpos = tl.load(pos_ptr + _offset2(pos_strides, page, off), mask=held, other=0)
        visible = held & (kpos <= qpos) & (kpos > qpos - window)
        k = tl.load(
            k_ptr + _offset3(k_strides, page[:, None], off[:, None], d[None, :]),
            mask=held[:, None] & d_ok[None, :], other=0.0,
        )
        return page, off, held, visible, _dot(q, tl.trans(k), DOT_DTYPE, EMULATE, PRECISION) * scale

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, bt_ptr, chunk_ptr, lens_ptr, qpos_ptr,
        dec_seq_ptr, dec_tok_ptr,
        out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
        scale, window,
        q_strides, k_strides, v_strides, pos_strides, table_strides, len_strides, out_strides,
        num_q_heads, num_parts,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PART_TOKENS: tl.constexpr,
        SINGLE_PARTITION: tl.constexpr, WRITE_STATS: tl.constexpr, WRITE_OUT: tl.constexpr,
        DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        b, h, part, seq, tok, head_len = _decode_program(dec_seq_ptr, dec_tok_ptr, lens_ptr, len_strides)
        part_start = part.to(tl.int64) * PART_TOKENS
        if (part > 0) & (part_start >= head_len):
            return  # a partition past the head (most of a fixed grid): no loads at all
        part_end = tl.minimum(head_len, part_start + PART_TOKENS)

        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        qh = h * GROUP + rows
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        q = _load_group_query(q_ptr, tok, qh, row_ok, d, d_ok, q_strides)
        qpos = tl.load(qpos_ptr + tok)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        bt_base = bt_ptr + _offset2(table_strides, seq, h)
        for start in range(part_start, part_end, TILE):
            page, off, held, visible, s = _score_tile(
                q, k_ptr, pos_ptr, bt_base, chunk_ptr, start, part_end, qpos, window, d, d_ok, scale, k_strides,
                pos_strides, table_strides[2], BLOCK_SIZE, TILE, CHUNK, DOT_DTYPE, EMULATE, PRECISION,
            )
            kv_mask = held[:, None] & d_ok[None, :]
            p, alpha, l_i, m_new = _online_softmax(tl.where(visible[None, :], s, float("-inf")), m_i, l_i)
            if WRITE_OUT:  # a metric pass needs only the maxima and sums: no V read
                v = tl.load(
                    v_ptr + _offset3(v_strides, page[:, None], off[:, None], d[None, :]),
                    mask=kv_mask, other=0.0,
                )
                acc = acc * alpha[:, None] + _dot(p, v, DOT_DTYPE, EMULATE, PRECISION)
            m_i = m_new

        denom = tl.where(l_i > 0.0, l_i, 1.0)
        result = acc / denom[:, None]
        if WRITE_OUT:
            if SINGLE_PARTITION:
                tl.store(
                    out_ptr + _offset3(out_strides, tok, qh[:, None], d[None, :]),
                    result.to(out_ptr.dtype.element_ty),
                    mask=row_ok[:, None] & d_ok[None, :],
                )
        # (a vector compare: the interpreter mishandles vector & scalar-bool masks)
        part_ok = (tl.zeros([GROUP_PAD], tl.int64) + part_start) < head_len
        stat = (b.to(tl.int64) * num_q_heads + qh) * num_parts + part
        if WRITE_STATS:
            tl.store(part_max_ptr + stat, m_i, mask=row_ok & part_ok)
            tl.store(part_sum_ptr + stat, l_i, mask=row_ok & part_ok)
        if WRITE_OUT:
            if not SINGLE_PARTITION:
                tl.store(
                    part_out_ptr + stat[:, None] * HEAD_PAD + d[None, :],
                    result,
                    mask=(row_ok & part_ok)[:, None] & d_ok[None, :],
                )

    @triton.jit
    def _decode_reduce_kernel(
        lens_ptr, dec_seq_ptr, dec_tok_ptr,
        out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
        len_strides, out_strides,
        num_q_heads, num_parts,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        PART_TOKENS: tl.constexpr, PART_BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        qh = tl.program_id(1)
        seq = tl.load(dec_seq_ptr + b).to(tl.int64)
        tok = tl.load(dec_tok_ptr + b).to(tl.int64)
        head_len = tl.load(lens_ptr + _offset2(len_strides, seq, qh // GROUP)).to(tl.int64)
        used = (head_len + PART_TOKENS - 1) // PART_TOKENS
        base = (b.to(tl.int64) * num_q_heads + qh) * num_parts
        parts = tl.arange(0, PART_BLOCK)
        big_m = tl.full([PART_BLOCK], float("-inf"), tl.float32)
        for first in range(0, used, PART_BLOCK):
            pm = tl.load(part_max_ptr + base + first + parts, mask=first + parts < used, other=float("-inf"))
            big_m = tl.maximum(big_m, pm)
        m_all = tl.max(big_m, 0)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        total = tl.zeros([PART_BLOCK], tl.float32)
        acc = tl.zeros([HEAD_PAD], tl.float32)
        for first in range(0, used, PART_BLOCK):
            ok = first + parts < used
            pm = tl.load(part_max_ptr + base + first + parts, mask=ok, other=float("-inf"))
            ps = tl.load(part_sum_ptr + base + first + parts, mask=ok, other=0.0)
            w = ps * tl.exp(pm - m_safe)
            w = tl.where(ok, w, 0.0)
            po = tl.load(
                part_out_ptr + (base + first + parts)[:, None] * HEAD_PAD + d[None, :],
                mask=ok[:, None] & d_ok[None, :], other=0.0,
            )
            total += w
            acc += tl.sum(w[:, None] * po, 0)
        norm = tl.sum(total, 0)
        result = acc / tl.where(norm > 0.0, norm, 1.0)
        tl.store(
            out_ptr + _offset3(out_strides, tok, qh, d),
            result.to(out_ptr.dtype.element_ty),
            mask=d_ok,
        )

    @triton.jit
    def _decode_metric_kernel(
        q_ptr, k_ptr, pos_ptr, bt_ptr, chunk_ptr, lens_ptr, qpos_ptr,
        dec_seq_ptr, dec_tok_ptr, flag_ptr,
        part_max_ptr, part_sum_ptr, metric_ptr,
        scale, power,
        q_strides, k_strides, pos_strides, table_strides, len_strides, metric_strides,
        num_q_heads, num_parts,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PART_TOKENS: tl.constexpr,
        PART_BLOCK: tl.constexpr, INT_POWER: tl.constexpr,
        DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        b, h, part, seq, tok, head_len = _decode_program(dec_seq_ptr, dec_tok_ptr, lens_ptr, len_strides)
        flag = tl.load(flag_ptr + seq)
        part_start = part.to(tl.int64) * PART_TOKENS
        if (flag == 0) | (part_start >= head_len):
            return  # unflagged row or a partition past the head: no work, no loads
        part_end = tl.minimum(head_len, part_start + PART_TOKENS)
        used = (head_len + PART_TOKENS - 1) // PART_TOKENS

        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        qh = h * GROUP + rows
        # Global max and exp-sum of every query row over all partitions.
        stat = (b.to(tl.int64) * num_q_heads + qh) * num_parts  # [GROUP_PAD]
        # Tiles accumulate elementwise and are reduced after each loop: a reduction
        # inside the loop trips an assertion in Triton 3.6's OptimizeThreadLocality pass
        # once PART_BLOCK reaches 64 (seen on an H200, 32K-token heads).
        parts = tl.arange(0, PART_BLOCK)
        m_tile = tl.full([GROUP_PAD, PART_BLOCK], float("-inf"), tl.float32)
        for first in range(0, used, PART_BLOCK):
            ok = row_ok[:, None] & (first + parts < used)[None, :]
            pm = tl.load(part_max_ptr + stat[:, None] + first + parts[None, :], mask=ok, other=float("-inf"))
            m_tile = tl.maximum(m_tile, pm)
        big_m = tl.max(m_tile, 1)
        m_safe = tl.where(big_m == float("-inf"), 0.0, big_m)
        norm_tile = tl.zeros([GROUP_PAD, PART_BLOCK], tl.float32)
        for first in range(0, used, PART_BLOCK):
            ok = row_ok[:, None] & (first + parts < used)[None, :]
            pm = tl.load(part_max_ptr + stat[:, None] + first + parts[None, :], mask=ok, other=float("-inf"))
            ps = tl.load(part_sum_ptr + stat[:, None] + first + parts[None, :], mask=ok, other=0.0)
            norm_tile += tl.where(ok, ps * tl.exp(pm - m_safe[:, None]), 0.0)
        norm = tl.sum(norm_tile, 1)
        inv_norm = tl.where(norm > 0.0, 1.0 / tl.where(norm > 0.0, norm, 1.0), 0.0)

        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        q = _load_group_query(q_ptr, tok, qh, row_ok, d, d_ok, q_strides)
        qpos = tl.load(qpos_ptr + tok)
        bt_base = bt_ptr + _offset2(table_strides, seq, h)
        for start in range(part_start, part_end, TILE):
            page, off, held, visible, s = _score_tile(
                # a metric pass is never windowed (a sliding-window layer is never compressed)
                q, k_ptr, pos_ptr, bt_base, chunk_ptr, start, part_end, qpos, _NO_WINDOW, d, d_ok, scale, k_strides,
                pos_strides, table_strides[2], BLOCK_SIZE, TILE, CHUNK, DOT_DTYPE, EMULATE, PRECISION,
            )
            prob = tl.exp(s - m_safe[:, None]) * inv_norm[:, None]
            prob = tl.where(row_ok[:, None] & visible[None, :], prob, 0.0)
            if INT_POWER > 0:
                gained = prob
                for _ in tl.static_range(INT_POWER - 1):
                    gained = gained * prob
            else:
                gained = tl.where(prob > 0.0, tl.exp2(power * tl.log2(tl.where(prob > 0.0, prob, 1.0))), 0.0)
            tl.atomic_add(
                metric_ptr + _offset2(metric_strides, page, off),
                tl.sum(gained, 0),
                mask=visible,
            )

    @triton.jit
    def _varlen_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, bt_ptr, lens_ptr, qpos_ptr,
        blk_seq_ptr, blk_start_ptr, blk_end_ptr,
        out_ptr,
        scale, window,
        q_strides, k_strides, v_strides, pos_strides, table_strides, len_strides, out_strides,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        blk = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(blk_seq_ptr + blk).to(tl.int64)
        q_start = tl.load(blk_start_ptr + blk).to(tl.int64)
        q_end = tl.load(blk_end_ptr + blk).to(tl.int64)
        head_len = tl.load(lens_ptr + _offset2(len_strides, seq, h)).to(tl.int64)

        rows = tl.arange(0, BLOCK_M)
        tok = q_start + rows // GROUP
        qh = h * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_end)
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + _offset3(q_strides, tok[:, None], qh[:, None], d[None, :]),
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        qpos = tl.load(qpos_ptr + tok, mask=row_ok, other=0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        bt_base = bt_ptr + _offset2(table_strides, seq, h)
        for start in range(0, head_len, TILE):
            page, off, held, visible, s = _score_tile(
                q, k_ptr, pos_ptr, bt_base, bt_ptr, start, head_len, qpos[:, None], window, d, d_ok, scale, k_strides,
                pos_strides, table_strides[2], BLOCK_SIZE, TILE, 0, DOT_DTYPE, EMULATE, PRECISION,
            )
            visible = visible & row_ok[:, None]
            kv_mask = held[:, None] & d_ok[None, :]
            p, alpha, l_i, m_new = _online_softmax(tl.where(visible, s, float("-inf")), m_i, l_i)
            v = tl.load(
                v_ptr + _offset3(v_strides, page[:, None], off[:, None], d[None, :]),
                mask=kv_mask, other=0.0,
            )
            acc = acc * alpha[:, None] + _dot(p, v, DOT_DTYPE, EMULATE, PRECISION)
            m_i = m_new

        result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + _offset3(out_strides, tok[:, None], qh[:, None], d[None, :]),
            result.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


_TRITON_DTYPES = {}
if HAS_TRITON:
    _TRITON_DTYPES = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
    }

# (query_start_loc tuple, block_q, device) -> (decode seq/token rows, varlen blocks)
_PLAN_CACHE: dict = {}
_PLAN_CACHE_SIZE = 16


def _batch_plan(query_start_loc: list[int], block_q: int, device: torch.device):
    """Decode rows and varlen query blocks of a batch (cached: every layer of a
    step passes the same ``query_start_loc``).

    Returns ``(decode [2, B] int32 (seq, token) or None, blocks [3, N] int64
    (seq, first token, end token) or None)``.
    """
    device = _plan_device(device)
    key = (tuple(query_start_loc), block_q, device)
    hit = _PLAN_CACHE.get(key)
    if hit is not None:
        return hit
    blk_seq, blk_start, blk_end = [], [], []
    for s in range(len(query_start_loc) - 1):
        first, end = query_start_loc[s], query_start_loc[s + 1]
        if end - first > 1:
            for start in range(first, end, block_q):
                blk_seq.append(s)
                blk_start.append(start)
                blk_end.append(end)
    decode = _decode_rows(query_start_loc, device)
    blocks = (
        host_to_device(torch.tensor([blk_seq, blk_start, blk_end], dtype=torch.int64), device)
        if blk_seq
        else None
    )
    if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
        _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
    _PLAN_CACHE[key] = (decode, blocks)
    return decode, blocks


def _decode_rows(query_start_loc: list[int], device: torch.device) -> torch.Tensor | None:
    """``[2, B]`` int32 (sequence, first token) of the batch's decode rows (one query),
    or None; cached as :func:`_batch_plan` is, so only a step's first layer copies."""
    device = _plan_device(device)
    key = ("decode rows", tuple(query_start_loc), device)
    if key not in _PLAN_CACHE:
        rows = [(s, first) for s, (first, end) in enumerate(zip(query_start_loc, query_start_loc[1:])) if end - first == 1]
        if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
            _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
        _PLAN_CACHE[key] = (
            host_to_device(torch.tensor(rows, dtype=torch.int32).t().contiguous(), device) if rows else None
        )
    return _PLAN_CACHE[key]


def _plan_device(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` as one cache key (callers pass either)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _dot_config(query: torch.Tensor, key_cache: torch.Tensor):
    """(dot operand dtype, emulate bf16 in the interpreter, input precision)."""
    same_or_fp8 = query.dtype == key_cache.dtype or key_cache.dtype in FP8_PAGE_DTYPES
    if same_or_fp8 and query.dtype in (torch.float16, torch.bfloat16):
        dot_dtype = _TRITON_DTYPES[query.dtype]  # FP8 pages convert to it exactly
    else:
        dot_dtype = tl.float32  # float32 caches, or mixed dtypes: upcast
    emulate = interpreter_active() and dot_dtype == tl.bfloat16
    # float32 operands: full-precision products (the reference is float32, not tf32);
    # fp16 / bf16 operands: the target's default.
    return dot_dtype, emulate, ("ieee" if dot_dtype == tl.float32 else None)


def _attention_strides(query, pool: KVPool, block_tables, head_lens, out) -> tuple[tuple[int, ...], ...]:
    """The strides of query, K, V, positions, tables, lengths and output: the
    ``*_strides`` arguments of the decode and varlen kernels, in their order."""
    tensors = (query, pool.key_cache, pool.value_cache, pool.slot_positions, block_tables, head_lens, out)
    return tuple(t.stride() for t in tensors)


def paged_attention_triton(
    query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None, *,
    partition_size: int = DEFAULT_PARTITION_SIZE, block_m: int | None = None, varlen_tile: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kvcompress.ops.reference_attention.reference_paged_attention`.

    Same arguments and result (no ``max_query_chunk``: the kernels tile queries
    themselves). ``batch.max_head_len``, when given, sizes the decode partition grid
    without a device sync (default: read ``head_lens``).

    Extra keyword-only knobs:
        partition_size: decode keys per partition (rounded up to whole pages); heads
            longer than that are split and reduced (v2).
        block_m: rows (query tokens x group) of one varlen program (default 64,
            32 for head sizes > 128).
        varlen_tile: keys per varlen iteration (default 64, 32 for float32 operands
            of head sizes > 128).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: the Triton paged attention is unavailable")
    key_cache, value_cache = pool.key_cache, pool.value_cache
    block_tables, head_lens, query_positions = batch.block_tables, batch.head_lens, batch.query_positions
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs, num_kv_heads, _ = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if key_cache.shape[2] != head_dim or value_cache.shape[2] != head_dim:
        raise ValueError("query, key_cache and value_cache head sizes differ")
    if query.dtype not in _TRITON_DTYPES:
        raise TypeError(f"query dtype {query.dtype} is not supported (float32, float16, bfloat16)")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in _TRITON_DTYPES and t.dtype not in FP8_PAGE_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} is not supported (float32, float16, bfloat16, "
                            "float8_e4m3fn, float8_e5m2)")
    if out is None:
        out = torch.empty_like(query)
    query_start_loc = batch.query_start_loc
    if len(query_start_loc) != num_seqs + 1:
        raise ValueError(f"query_start_loc has {len(query_start_loc)} entries for {num_seqs} sequences")
    if num_tokens == 0 or num_seqs == 0:
        return out

    device = query.device
    head_pad = max(16, _next_pow2(head_dim))
    dot_dtype, emulate, precision = _dot_config(query, key_cache)
    # Rows over 512 bytes (float32 operands, head size > 128): smaller key tiles.
    wide = head_pad * (4 if dot_dtype == tl.float32 else 2) > 512
    block_m = max(int(block_m or (32 if head_pad >= 256 else 64)), _next_pow2(group), 16)
    block_q = block_m // group
    decode, blocks = _batch_plan(query_start_loc, block_q, device)

    if blocks is not None:
        tile = max(16, _next_pow2(varlen_tile or (32 if wide else 64)))
        grid = (blocks.shape[1], num_kv_heads)
        _varlen_kernel[grid](
            query, key_cache, value_cache, pool.slot_positions, block_tables, head_lens, query_positions,
            blocks[0], blocks[1], blocks[2],
            out,
            float(scale), _window_arg(batch.sliding_window),
            *_attention_strides(query, pool, block_tables, head_lens, out),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
            HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size, TILE=tile,
            DOT_DTYPE=dot_dtype, EMULATE=emulate, PRECISION=precision,
            num_warps=8 if block_m * head_pad >= 8192 else 4,
        )

    if decode is None:
        return out
    dec_seq, dec_tok = decode[0], decode[1]
    max_head_len = batch.max_head_len
    if max_head_len is None:
        max_head_len = int(head_lens[dec_seq.long()].max().item())
    flags = None if metrics is None else metrics.selected.to(device=device, dtype=torch.int8)
    _launch_decode(
        query, pool, block_tables, head_lens, query_positions, (dec_seq, dec_tok), out, scale,
        max_head_len, partition_size, flags, 2 if metrics is None else metrics.power,
        window=batch.sliding_window,
    )
    return out


def decode_metrics_triton(
    query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float, metrics: MetricSink, *,
    max_head_len: int | None = None, partition_size: int = DEFAULT_PARTITION_SIZE,
) -> None:
    """The decode rows of ``batch`` selected by ``metrics`` add to ``pool.slot_metrics``
    exactly as :func:`paged_attention_triton` adds them, and nothing else is computed
    for the prompt rows: the metric pass of attention kernels that return no
    probabilities (vLLM's ``unified_attention``, :mod:`kvcompress.ops.flattened`).

    The decode kernel runs over the selected rows (``metrics.rows``; without them over
    every decode row) for its partition maxima and sums only, which normalise the
    metric kernel's scores (no output, no V read). No host reads: the rows were made
    on the host (the sink's, or the batch's decode rows, copied once per step by
    :func:`_decode_rows`) and the launch shapes come from ``max_head_len`` (default: the
    tables' width), so on CUDA the pass never waits for the stream, as ``torch``
    gathers with ``nonzero`` would.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: the Triton decode metrics are unavailable")
    rows = metrics.rows if metrics.rows is not None else _decode_rows(batch.query_start_loc, query.device)
    if rows is None or rows.shape[1] == 0:
        return
    if max_head_len is None:
        max_head_len = batch.block_tables.shape[2] * pool.block_size
    flags = metrics.selected.to(device=query.device, dtype=torch.int8)
    _launch_decode(
        query, pool, batch.block_tables, batch.head_lens, batch.query_positions, (rows[0], rows[1]),
        None, scale, max_head_len, partition_size, flags, metrics.power,
    )


DECODE_WORKSPACE_BYTES = 128 << 20
"""Bound of a decode launch's float32 split-softmax workspace (``[rows, Hq, parts]``
maxima and sums, ``[rows, Hq, parts, D_pad]`` partial outputs), whatever the rows and
the context: launches over many rows take fewer, longer partitions (the rows fill the
GPU). It is outside vLLM's profile run (``kvcompress.vllm_glue.memory``). At 128 MiB a
batch of 256 rows x 32 query heads x head 128 keeps up to 31 partitions (2048-key ones
up to 62K-token heads), 1,024 rows up to 7; before, 64 at any row count (1 GiB per layer
call at 1,023 rows)."""

F32_BYTES = 4


def _decode_partitions(
    num_rows: int, num_q_heads: int, head_pad: int, max_head_len: int, partition_size: int,
    block_size: int, tile_pages: int,
) -> tuple[int, int]:
    """``(pages per partition, partitions)`` of a decode launch over ``num_rows`` rows
    and heads of up to ``max_head_len`` keys: ``partition_size`` keys (whole pages) or
    a power of two times longer, so that there are at most ``MAX_GRAPH_PARTITIONS`` and
    the workspace of :func:`decode_workspace_bytes` holds (longer partitions in whole
    tiles of ``tile_pages`` pages)."""
    per_partition = num_rows * num_q_heads * (head_pad + 2) * F32_BYTES
    max_parts = max(1, min(MAX_GRAPH_PARTITIONS, DECODE_WORKSPACE_BYTES // max(1, per_partition)))
    fewest_keys = -(-max_head_len // max_parts)  # per partition, for at most max_parts
    fewest_pages = -(-fewest_keys // block_size)
    needed = max(-(-fewest_pages // tile_pages) * tile_pages, 1)
    base = max(-(-int(partition_size) // block_size), 1)
    # Longer partitions in powers of two of the base: PART_TOKENS is a kernel constexpr,
    # so every length would compile a variant (after vLLM's JIT monitor is armed).
    pages_per_part = base if needed <= base else base * _next_pow2(-(-needed // base))
    return pages_per_part, -(-max_head_len // (pages_per_part * block_size))


def decode_workspace_bytes(num_rows: int, num_q_heads: int, head_dim: int) -> int:
    """Upper bound of the bytes a decode launch over ``num_rows`` rows allocates
    (:func:`_launch_decode`, with or without output and metrics, any context): the
    split-softmax workspace, at most ``MAX_GRAPH_PARTITIONS`` partitions and at most
    ``DECODE_WORKSPACE_BYTES`` over several; one partition keeps only the maxima and
    sums of the metric kernel."""
    head_pad = max(16, _next_pow2(head_dim))
    several = num_rows * num_q_heads * MAX_GRAPH_PARTITIONS * (head_pad + 2) * F32_BYTES
    one = num_rows * num_q_heads * 2 * F32_BYTES
    return max(min(several, DECODE_WORKSPACE_BYTES), one)


@dataclass(frozen=True)
class _DecodeShape:
    """Sizes and kernel constants of one decode launch (:func:`_decode_shape`).

    Attributes:
        num_rows: decode rows ``B``; num_q_heads / num_kv_heads: ``Hq`` / ``H``;
            group: ``G = Hq / H``; group_pad: ``G`` padded for ``tl.dot`` (>= 16).
        head_dim: ``D``; head_pad: ``D`` padded to a power of two (>= 16).
        block_size: slots per page; tile: keys per loop step; part_tokens: keys per
            partition; num_parts: partitions of the longest head.
        dot: ``(operand dtype, emulate bf16, input precision)`` (:func:`_dot_config`).
        chunk: pages per chunk of two-level tables (0: one level).
    """

    num_rows: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    group_pad: int
    head_dim: int
    head_pad: int
    block_size: int
    tile: int
    part_tokens: int
    num_parts: int
    dot: tuple
    chunk: int

    @property
    def single(self) -> bool:
        """One partition: the decode kernel writes the output itself (no reduce)."""
        return self.num_parts == 1

    @property
    def part_block(self) -> int:
        """Partitions the reduce and metric kernels read per step."""
        return min(64, max(16, _next_pow2(self.num_parts)))


def _decode_shape(
    query: torch.Tensor, pool: KVPool, block_tables: torch.Tensor, num_rows: int, max_head_len: int,
    partition_size: int, chunks: torch.Tensor | None,
) -> _DecodeShape:
    """The :class:`_DecodeShape` of a decode launch over ``num_rows`` rows and heads of
    up to ``max_head_len`` keys (partitions from :func:`_decode_partitions`)."""
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = block_tables.shape[1]
    block_size = pool.key_cache.shape[1]
    head_pad = max(16, _next_pow2(head_dim))
    dot = _dot_config(query, pool.key_cache)
    wide = head_pad * (4 if dot[0] == tl.float32 else 2) > 512
    tile_pages = max(1, (32 if wide else 64) // block_size)
    pages_per_part, num_parts = _decode_partitions(
        num_rows, num_q_heads, head_pad, max(1, int(max_head_len)), partition_size, block_size, tile_pages,
    )
    return _DecodeShape(
        num_rows=num_rows, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        group=num_q_heads // num_kv_heads, group_pad=max(16, _next_pow2(num_q_heads // num_kv_heads)),
        head_dim=head_dim, head_pad=head_pad, block_size=block_size,
        tile=block_size * math.gcd(pages_per_part, tile_pages), part_tokens=pages_per_part * block_size,
        num_parts=num_parts, dot=dot, chunk=0 if chunks is None else chunks.shape[1],
    )


def _launch_decode(
    query, pool, block_tables, head_lens, query_positions, rows, out, scale, max_head_len, partition_size,
    metric_flags, metric_power, chunks=None, window: int | None = None,
) -> None:
    """Decode, reduce and metric kernels for rows ``rows = (dec_seq, dec_tok)``;
    ``out`` None: the metrics only (no output, no reduce, no V read).

    ``chunks``: the second level of two-level tables (``block_tables`` then holds chunk
    ids; :class:`kvcompress.ops.page_tables.ChunkedPageTables`), or None. ``window``: the
    layer's sliding window (None: full attention; no metrics then, as the reference).

    ``dec_seq[b]`` indexes ``block_tables`` / ``head_lens`` / ``metric_flags`` (int8, or
    None for no metrics: then ``pool.slot_metrics`` is not touched); ``dec_tok[b]``
    indexes ``query`` / ``query_positions`` / ``out``. Launch shapes depend only on the
    row count and ``max_head_len`` (no host reads). The float32 split-softmax workspace
    is at most :func:`decode_workspace_bytes` (:func:`_decode_partitions`).
    """
    dec_seq, dec_tok = rows
    want_metrics = metric_flags is not None
    write_out = out is not None
    if not (write_out or want_metrics):
        raise ValueError("a decode launch needs an output or metric flags")
    if want_metrics and window is not None:
        raise ValueError("a sliding-window layer takes no decode metrics (it is never compressed)")
    if chunks is not None and not chunks.is_contiguous():
        raise ValueError("the page-table chunks must be contiguous")
    shape = _decode_shape(query, pool, block_tables, dec_seq.shape[0], max_head_len, partition_size, chunks)
    if out is None:
        out = query  # never written (WRITE_OUT off): its strides fill the kernels' arguments
    write_stats = want_metrics or not shape.single
    f32, device = torch.float32, query.device
    stats_shape = (shape.num_rows, shape.num_q_heads, shape.num_parts)
    if write_stats:
        part_max = torch.empty(stats_shape, dtype=f32, device=device)
        part_sum = torch.empty(stats_shape, dtype=f32, device=device)
    else:
        part_max = part_sum = out  # unused
    if shape.single or not write_out:
        part_out = out  # unused
    else:
        part_out = torch.empty((*stats_shape, shape.head_pad), dtype=f32, device=device)

    chunk_ptr = block_tables if chunks is None else chunks
    dot_dtype, emulate, precision = shape.dot
    _decode_kernel[(shape.num_rows, shape.num_kv_heads, shape.num_parts)](
        query, pool.key_cache, pool.value_cache, pool.slot_positions, block_tables, chunk_ptr, head_lens,
        query_positions, dec_seq, dec_tok,
        out, part_out, part_max, part_sum,
        float(scale), _window_arg(window),
        *_attention_strides(query, pool, block_tables, head_lens, out),
        shape.num_q_heads, shape.num_parts,
        GROUP=shape.group, GROUP_PAD=shape.group_pad,
        HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad,
        BLOCK_SIZE=shape.block_size, TILE=shape.tile, PART_TOKENS=shape.part_tokens,
        SINGLE_PARTITION=shape.single, WRITE_STATS=write_stats, WRITE_OUT=write_out,
        DOT_DTYPE=dot_dtype, EMULATE=emulate, PRECISION=precision, CHUNK=shape.chunk,
        num_warps=8 if shape.head_pad >= 256 else 4,
    )
    if write_out and not shape.single:
        _decode_reduce_kernel[(shape.num_rows, shape.num_q_heads)](
            head_lens, dec_seq, dec_tok,
            out, part_out, part_max, part_sum,
            head_lens.stride(), out.stride(),
            shape.num_q_heads, shape.num_parts,
            GROUP=shape.group, HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad,
            PART_TOKENS=shape.part_tokens, PART_BLOCK=shape.part_block,
        )
    if want_metrics:
        _launch_decode_metrics(
            query, pool, block_tables, chunk_ptr, head_lens, query_positions, rows, metric_flags,
            (part_max, part_sum), scale, metric_power, shape,
        )


def _launch_decode_metrics(
    query, pool, block_tables, chunk_ptr, head_lens, query_positions, rows, metric_flags, stats,
    scale, metric_power, shape: _DecodeShape,
) -> None:
    """The metric kernel of a decode launch (:func:`_launch_decode`): the flagged rows
    add ``sum_over_group(prob ** metric_power)`` to ``pool.slot_metrics``, normalised by
    the decode kernel's per-partition maxima and sums ``stats = (part_max, part_sum)``
    ``[B, Hq, parts]``."""
    slot_metrics, slot_positions = pool.slot_metrics, pool.slot_positions
    if slot_metrics.dtype != torch.float32:
        raise TypeError("slot_metrics must be float32")
    power = float(metric_power)
    if power <= 0:
        raise ValueError(f"metric_power must be positive, got {metric_power}")
    int_power = int(power) if power.is_integer() and power <= 8 else 0
    dec_seq, dec_tok = rows
    dot_dtype, emulate, precision = shape.dot
    _decode_metric_kernel[(shape.num_rows, shape.num_kv_heads, shape.num_parts)](
        query, pool.key_cache, slot_positions, block_tables, chunk_ptr, head_lens, query_positions,
        dec_seq, dec_tok, metric_flags,
        *stats, slot_metrics,
        float(scale), power,
        query.stride(), pool.key_cache.stride(), slot_positions.stride(), block_tables.stride(),
        head_lens.stride(), slot_metrics.stride(),
        shape.num_q_heads, shape.num_parts,
        GROUP=shape.group, GROUP_PAD=shape.group_pad,
        HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad,
        BLOCK_SIZE=shape.block_size, TILE=shape.tile, PART_TOKENS=shape.part_tokens,
        PART_BLOCK=shape.part_block, INT_POWER=int_power,
        DOT_DTYPE=dot_dtype, EMULATE=emulate, PRECISION=precision, CHUNK=shape.chunk,
        num_warps=4,
    )


def paged_decode_by_slot_triton(
    query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None, *,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> torch.Tensor:
    """Triton version of
    :func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference` (same
    arguments; ``batch.max_head_len`` defaults to the tables' width ``P * block_size``).

    No host reads and launch shapes fixed by ``B`` and ``max_head_len``: capturable in
    a CUDA graph when ``batch``'s tensors (``seq_slots``, ``query_positions``,
    ``row_index``: ``[B]`` int32 ``arange``, made per call when None), the metric flags
    and the pool keep their addresses. ``seq_slots`` should be int32 and the metric
    flags int8 (others are converted, which allocates).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: the Triton paged attention is unavailable")
    block_tables = batch.block_tables
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = block_tables.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    block_size = pool.block_size
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if out is None:
        out = torch.empty_like(query)
    if num_rows == 0:
        return out
    max_head_len = batch.max_head_len
    if max_head_len is None:
        max_head_len = batch.max_pages * block_size
    seq_slots = batch.seq_slots
    if seq_slots.dtype != torch.int32:
        seq_slots = seq_slots.to(torch.int32)
    row_index = batch.row_index
    if row_index is None:
        row_index = torch.arange(num_rows, dtype=torch.int32, device=query.device)
    flags = None
    if metrics is not None:
        flags = metrics.selected if metrics.selected.dtype == torch.int8 else metrics.selected.to(torch.int8)
    _launch_decode(
        query, pool, block_tables, batch.head_lens, batch.query_positions, (seq_slots, row_index), out,
        scale, max_head_len, partition_size, flags, 2 if metrics is None else metrics.power,
        chunks=batch.chunks, window=batch.sliding_window,
    )
    return out
