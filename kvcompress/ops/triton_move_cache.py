"""Triton MoveCache: copy K, V, metric and position between slots of the page pool.

Same call and semantics as the reference :func:`kvcompress.ops.move_cache.move_cache`.
One program copies ``MOVES`` moves; K and V rows are copied in their storage dtype
(bit exact). The pool's ``key_cache`` / ``value_cache`` may be strided views (e.g.
``pool[:, 0]`` and ``pool[:, 1]`` of a ``[N, 2, b, D]`` buffer; the engine's are the two
regions of a ``[2, N, b, D]`` one). Sources and destinations must be
disjoint, as for the reference (no program reads a slot another one writes).

Importable without triton (``HAS_TRITON`` is then False and the launcher raises).
"""

from __future__ import annotations

import torch

from kvcompress.ops.kv_pool import KVPool

try:  # pragma: no cover - exercised where triton exists
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "move_cache_triton"]


if HAS_TRITON:

    @triton.jit
    def _copy_rows(ptr, src_page, src_off, dst_page, dst_off, d, row_mask, stride_n, stride_b, stride_d):
        """Copy the ``[MOVES, HEAD_PAD]`` rows at (src_page, src_off) of one cache to
        (dst_page, dst_off), in the storage dtype."""
        rows = tl.load(ptr + src_page[:, None] * stride_n + src_off[:, None] * stride_b + d[None, :] * stride_d,
                       mask=row_mask)
        tl.store(ptr + dst_page[:, None] * stride_n + dst_off[:, None] * stride_b + d[None, :] * stride_d,
                 rows, mask=row_mask)

    @triton.jit
    def _move_cache_kernel(
        k_ptr, v_ptr, metric_ptr, pos_ptr,
        src_page_ptr, src_off_ptr, dst_page_ptr, dst_off_ptr,
        num_moves,
        stride_kn, stride_kb, stride_kd,
        stride_vn, stride_vb, stride_vd,
        stride_mn, stride_mb,
        stride_pn, stride_pb,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, MOVES: tl.constexpr,
    ):
        move = tl.program_id(0).to(tl.int64) * MOVES + tl.arange(0, MOVES)
        ok = move < num_moves
        src_page = tl.load(src_page_ptr + move, mask=ok, other=0).to(tl.int64)
        src_off = tl.load(src_off_ptr + move, mask=ok, other=0).to(tl.int64)
        dst_page = tl.load(dst_page_ptr + move, mask=ok, other=0).to(tl.int64)
        dst_off = tl.load(dst_off_ptr + move, mask=ok, other=0).to(tl.int64)
        d = tl.arange(0, HEAD_PAD)
        row_mask = ok[:, None] & (d < HEAD_DIM)[None, :]

        _copy_rows(k_ptr, src_page, src_off, dst_page, dst_off, d, row_mask, stride_kn, stride_kb, stride_kd)
        _copy_rows(v_ptr, src_page, src_off, dst_page, dst_off, d, row_mask, stride_vn, stride_vb, stride_vd)
        metric = tl.load(metric_ptr + src_page * stride_mn + src_off * stride_mb, mask=ok)
        tl.store(metric_ptr + dst_page * stride_mn + dst_off * stride_mb, metric, mask=ok)
        position = tl.load(pos_ptr + src_page * stride_pn + src_off * stride_pb, mask=ok)
        tl.store(pos_ptr + dst_page * stride_pn + dst_off * stride_pb, position, mask=ok)


def move_cache_triton(
    pool: KVPool, src_pages: torch.Tensor, src_offsets: torch.Tensor,
    dst_pages: torch.Tensor, dst_offsets: torch.Tensor, *, moves_per_program: int = 8,
) -> None:
    """Triton version of :func:`kvcompress.ops.move_cache.move_cache` (in place)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: the Triton MoveCache is unavailable")
    num_moves = src_pages.numel()
    if num_moves == 0:
        return
    if not (src_offsets.numel() == dst_pages.numel() == dst_offsets.numel() == num_moves):
        raise ValueError("src_pages, src_offsets, dst_pages and dst_offsets must have one entry per move")
    key_cache, value_cache = pool.key_cache, pool.value_cache
    if key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache shapes differ")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache dtypes differ")
    head_dim = key_cache.shape[2]
    head_pad = max(16, 1 << (head_dim - 1).bit_length())
    device = key_cache.device
    src_pages, src_offsets, dst_pages, dst_offsets = (
        t.reshape(-1).to(device) for t in (src_pages, src_offsets, dst_pages, dst_offsets)
    )
    moves = max(1, 1 << (int(moves_per_program) - 1).bit_length())
    grid = (triton.cdiv(num_moves, moves),)
    _move_cache_kernel[grid](
        key_cache, value_cache, pool.slot_metrics, pool.slot_positions,
        src_pages, src_offsets, dst_pages, dst_offsets,
        num_moves,
        *key_cache.stride(), *value_cache.stride(),
        *pool.slot_metrics.stride(), *pool.slot_positions.stride(),
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, MOVES=moves,
    )
