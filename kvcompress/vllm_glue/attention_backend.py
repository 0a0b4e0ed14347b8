"""vLLM attention backend over the per-(layer, KV head) paged cache.

On CPU it replaces ``CPU_ATTN`` inside a kvcompress engine; on CUDA it is
vLLM's ``CUSTOM`` backend, selected for kvcompress engines (see
``patches/attention_registry.py``). The model runner (``runner.py``) plans each
step (pages allocated, where every new KV goes) and publishes it with
``set_current_step``; the metadata builder hands that plan to every layer, and
the impl writes the layer's new KVs and runs ``kvcompress.ops.paged_attention``.
vLLM's own ``kv_cache`` views and ``slot_mapping`` are not used: the whole KV
buffer is one pool of pages, reached through ``WorkerCacheState``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvcompress.config import SUPPORTED_BLOCK_SIZES
from kvcompress.ops import AppendPlan, PerHeadPagedCache, write_kv
from kvcompress.ops.decode_by_slot import graph_partition_size
from kvcompress.ops.dispatch import decode_by_slot_capturable, paged_attention, paged_decode_by_slot
from kvcompress.ops.metrics import accumulate_metrics, attention_metrics, pool_metrics
from kvcompress.policies import MetricSpec

SUPPORTED_HEAD_SIZES = (64, 128, 256)


@dataclass
class DecodeBuffers:
    """Fixed-address inputs of decode-only steps, so a CUDA graph can replay them.

    The runner refills them before each decode-only step; the attention of such a
    step reads only these, the cache's own per-slot tensors and fixed integers
    (``kvcompress.ops.decode_by_slot``). Rows past the batch (vLLM pads a graph's
    batch) point at ``pad_slot``, whose heads are empty, and write their KVs into
    ``scratch_page``, which is never allocated.

    Attributes:
        seq_slots: ``[max_rows]`` int32 sequence slot of each query row.
        query_positions: ``[max_rows]`` int64 token position of each query row.
        write_pages, write_offsets: ``[num_layers, max_rows, num_kv_heads]`` int64
            slot of each row's new KV.
        metric_slots: ``[num_slots]`` int8, slots whose decode query adds to the
            eviction metrics this step.
        row_index: ``[max_rows]`` int32 ``arange`` (kernel row -> query row).
        pad_slot, scratch_page: see above.
        max_head_len: fixed bound of every head length (tokens), sizes the grid.
        partition_size: keys per decode partition (tokens).
        metric_power: decode metric power of the server policy (1 or 2).
    """

    seq_slots: torch.Tensor
    query_positions: torch.Tensor
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    metric_slots: torch.Tensor
    row_index: torch.Tensor
    pad_slot: int
    scratch_page: int
    max_head_len: int
    partition_size: int
    metric_power: int

    @classmethod
    def allocate(
        cls, *, num_layers: int, num_kv_heads: int, max_rows: int, num_slots: int,
        pad_slot: int, scratch_page: int, max_head_len: int, block_size: int,
        metric_power: int, device: torch.device,
    ) -> "DecodeBuffers":
        shape = (num_layers, max_rows, num_kv_heads)
        buffers = cls(
            seq_slots=torch.empty(max_rows, dtype=torch.int32, device=device),
            query_positions=torch.empty(max_rows, dtype=torch.int64, device=device),
            write_pages=torch.empty(shape, dtype=torch.int64, device=device),
            write_offsets=torch.empty(shape, dtype=torch.int64, device=device),
            metric_slots=torch.zeros(num_slots, dtype=torch.int8, device=device),
            row_index=torch.arange(max_rows, dtype=torch.int32, device=device),
            pad_slot=pad_slot,
            scratch_page=scratch_page,
            max_head_len=max_head_len,
            partition_size=graph_partition_size(max_head_len, block_size),
            metric_power=metric_power,
        )
        buffers.fill(0)
        return buffers

    @property
    def max_rows(self) -> int:
        return self.seq_slots.shape[0]

    def fill(
        self,
        num_rows: int,
        seq_slots: torch.Tensor | None = None,
        query_positions: torch.Tensor | None = None,
        write_pages: torch.Tensor | None = None,
        write_offsets: torch.Tensor | None = None,
        metric_slot_ids: torch.Tensor | None = None,
    ) -> None:
        """Rows ``[0, num_rows)`` from the step (``seq_slots [n]``, ``query_positions
        [n]``, ``write_pages / write_offsets [L, n, H]``); the rest padding.
        ``metric_slot_ids``: slots whose queries add to the metrics (None: none)."""
        if num_rows > self.max_rows:
            raise RuntimeError(
                f"kvcompress: a decode step of {num_rows} rows exceeds the {self.max_rows} "
                "rows of the decode buffers"
            )
        if num_rows:
            self.seq_slots[:num_rows].copy_(seq_slots)
            self.query_positions[:num_rows].copy_(query_positions)
            self.write_pages[:, :num_rows].copy_(write_pages)
            self.write_offsets[:, :num_rows].copy_(write_offsets)
        self.seq_slots[num_rows:].fill_(self.pad_slot)
        self.query_positions[num_rows:].fill_(0)
        self.write_pages[:, num_rows:].fill_(self.scratch_page)
        self.write_offsets[:, num_rows:].fill_(0)
        self.metric_slots.zero_()
        if metric_slot_ids is not None and metric_slot_ids.numel():
            self.metric_slots[metric_slot_ids] = 1


@dataclass
class WorkerCacheState:
    """The worker's page pool and tables.

    Attributes:
        cache: page tables / head lengths / slot positions / allocator.
        key_cache, value_cache: ``[num_buffer_pages, block_size, head_dim]`` views of
            the pool (the allocator's pages plus the scratch page).
        layer_index: attention layer name -> layer index in the page tables.
        decode_buffers: fixed-address inputs of decode-only steps.
    """

    cache: PerHeadPagedCache
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    layer_index: dict[str, int]
    decode_buffers: DecodeBuffers | None = None


@dataclass
class PromptMetricRows:
    """Prompt queries of one sequence that score its keys this step.

    Attributes:
        seq_index: the sequence's index in the batch.
        row_start, row_end: query rows ``[row_start, row_end)`` (window or full mode).
        prompt_done: this chunk ends the prompt, so the prompt metrics are final and
            get pooled.
        spec: the request's policy metric (power, skip_nearest, pooling).
    """

    seq_index: int
    row_start: int
    row_end: int
    prompt_done: bool
    spec: MetricSpec


@dataclass
class MetricQueries:
    """Queries of one step that add to the eviction metrics.

    Attributes:
        prompt_rows: per sequence whose prompt queries score keys this step.
        decode_seqs: ``[num_reqs]`` bool, sequences whose decode query adds its
            attention to the metrics (continual compression), or None.
        power: decode metric power, 2 (L2, squared attention) or 1 (L1).
    """

    prompt_rows: list[PromptMetricRows]
    decode_seqs: torch.Tensor | None
    power: int


@dataclass
class PerHeadStep:
    """One forward step, planned by the runner.

    Attributes:
        num_reqs: sequences in the batch (batch order).
        num_tokens: new tokens in the batch.
        query_start_loc: ``num_reqs + 1`` Python ints.
        query_positions: ``[num_tokens]`` int64 token positions.
        block_tables: ``[num_reqs, num_layers, num_kv_heads, max_pages]`` int64
            (None for a decode-only step).
        head_lens: ``[num_reqs, num_layers, num_kv_heads]`` int64 (after this step's
            KVs; None for a decode-only step).
        max_head_len: ``head_lens.max()`` on the host (sizes GPU decode grids without a sync).
        plan: where each new KV is written.
        metrics: which queries add to the eviction metrics (None: none).
        decode_only: every row is one generated token: attention reads the
            ``DecodeBuffers`` (filled by the runner) instead of the fields above.
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: list[int]
    query_positions: torch.Tensor
    block_tables: torch.Tensor | None
    head_lens: torch.Tensor | None
    max_head_len: int
    plan: AppendPlan
    metrics: MetricQueries | None = None
    decode_only: bool = False


_worker_state: WorkerCacheState | None = None
_current_step: PerHeadStep | None = None


def set_worker_state(state: WorkerCacheState | None) -> None:
    global _worker_state
    _worker_state = state


def get_worker_state() -> WorkerCacheState | None:
    return _worker_state


def set_current_step(step: PerHeadStep | None) -> None:
    global _current_step
    _current_step = step


def current_step() -> PerHeadStep | None:
    return _current_step


@dataclass
class PerHeadAttentionMetadata:
    """``step`` is None for warm-up and profiling runs (nothing is read or written).
    ``decode_only``: attend over the ``DecodeBuffers`` (a decode-only step, or the
    capture of a decode CUDA graph, whose buffers then hold only padding rows)."""

    num_actual_tokens: int
    step: PerHeadStep | None
    decode_only: bool = False


def cudagraph_support(platform) -> AttentionCGSupport:
    """Full CUDA graphs for decode-only batches where the slot-indexed decode is a
    capturable kernel (Triton on CUDA); otherwise none (vLLM keeps piecewise graphs,
    attention running eagerly between them)."""
    if platform.is_cuda() and decode_by_slot_capturable("cuda"):
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    return AttentionCGSupport.NEVER


class PerHeadAttentionMetadataBuilder(AttentionMetadataBuilder[PerHeadAttentionMetadata]):
    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # Decode-only steps read fixed-address buffers (DecodeBuffers); mixed steps
        # plan tables per step, so they run attention eagerly (piecewise graphs).
        from vllm.platforms import current_platform

        return cudagraph_support(current_platform)

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PerHeadAttentionMetadata:
        step = _current_step
        if step is not None and step.num_reqs != common_attn_metadata.num_reqs:
            raise RuntimeError(
                f"kvcompress step plan covers {step.num_reqs} requests but vLLM "
                f"built a batch of {common_attn_metadata.num_reqs}"
            )
        return PerHeadAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            step=step,
            decode_only=step is not None and step.decode_only,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> PerHeadAttentionMetadata:
        # The graph records the decode-buffer path; the runner reset the buffers to
        # padding rows, so warm-up runs of the capture read and write nothing real.
        state = _worker_state
        return PerHeadAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            step=None,
            decode_only=state is not None and state.decode_buffers is not None,
        )


class PerHeadAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None:
            unsupported.append("sliding-window attention")
        if logits_soft_cap:
            unsupported.append("logit soft-capping")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("cross-layer KV sharing")
        if sinks is not None:
            unsupported.append("attention sinks")
        if kv_cache_dtype not in ("auto",):
            unsupported.append(f"kv_cache_dtype={kv_cache_dtype}")
        if unsupported:
            raise ValueError(
                "--kv-compress: this model uses " + ", ".join(unsupported)
                + ", which the per-head paged cache does not support"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.sliding_window = None
        self.logits_soft_cap = None
        self.alibi_slopes = None
        self.sinks = None

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PerHeadAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, num_heads, D]``, key/value ``[T, num_kv_heads, D]``;
        output ``[T, num_heads * D]`` (written in place)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:
            return output
        if attn_metadata.decode_only:
            return self._decode_from_buffers(layer, query, key, value, output)
        if attn_metadata.step is None:
            return output
        step = attn_metadata.step
        state = _worker_state
        assert state is not None, "kvcompress worker state not initialised"
        layer_index = state.layer_index[layer.layer_name]
        num_tokens = step.num_tokens
        self._store_kvs(
            state, key, value, num_tokens,
            step.plan.write_pages[layer_index], step.plan.write_offsets[layer_index],
        )
        query = query[:num_tokens].view(num_tokens, self.num_heads, self.head_size)
        metrics = step.metrics
        block_tables = step.block_tables[:, layer_index]
        head_lens = step.head_lens[:, layer_index]
        paged_attention(
            query,
            state.key_cache,
            state.value_cache,
            state.cache.slot_positions,
            block_tables,
            head_lens,
            step.query_start_loc,
            step.query_positions,
            self.scale,
            out=output[:num_tokens].view(num_tokens, self.num_heads, self.head_size),
            slot_metrics=state.cache.slot_metrics if metrics is not None else None,
            metric_seqs=metrics.decode_seqs if metrics is not None else None,
            metric_power=metrics.power if metrics is not None else 2,
            max_head_len=step.max_head_len,
        )
        if metrics is not None:
            self._prompt_metrics(state, step, metrics, query, block_tables, head_lens)
        return output

    def _store_kvs(self, state, key, value, num_rows, write_pages, write_offsets) -> None:
        """Write the first ``num_rows`` new K/V rows (``[T, num_kv_heads * D]`` or
        ``[T, num_kv_heads, D]``) at their ``[num_rows, num_kv_heads]`` slots."""
        write_kv(
            state.key_cache,
            state.value_cache,
            key[:num_rows].view(num_rows, self.num_kv_heads, self.head_size),
            value[:num_rows].view(num_rows, self.num_kv_heads, self.head_size),
            write_pages,
            write_offsets,
        )

    def _decode_from_buffers(self, layer, query, key, value, output) -> torch.Tensor:
        """A decode-only step over ``DecodeBuffers``: no host reads, fixed launch
        shapes for a given row count (vLLM's padded batch: ``query.shape[0]`` rows)."""
        state = _worker_state
        assert state is not None and state.decode_buffers is not None, (
            "kvcompress decode buffers not initialised"
        )
        buffers = state.decode_buffers
        layer_index = state.layer_index[layer.layer_name]
        rows = query.shape[0]
        if rows > buffers.max_rows:
            raise RuntimeError(
                f"kvcompress: a decode batch of {rows} rows exceeds the {buffers.max_rows} "
                "rows of the decode buffers (max_num_seqs / the largest CUDA-graph size)"
            )
        cache = state.cache
        self._store_kvs(
            state, key, value, rows,
            buffers.write_pages[layer_index, :rows], buffers.write_offsets[layer_index, :rows],
        )
        paged_decode_by_slot(
            query[:rows].view(rows, self.num_heads, self.head_size),
            state.key_cache,
            state.value_cache,
            cache.slot_positions,
            cache.page_tables[:, layer_index],
            cache.head_lens[:, layer_index],
            buffers.seq_slots[:rows],
            buffers.query_positions[:rows],
            self.scale,
            out=output[:rows].view(rows, self.num_heads, self.head_size),
            slot_metrics=cache.slot_metrics,
            metric_slots=buffers.metric_slots,
            metric_power=buffers.metric_power,
            max_head_len=buffers.max_head_len,
            partition_size=buffers.partition_size,
            row_index=buffers.row_index[:rows],
        )
        return output

    def _prompt_metrics(self, state, step, metrics, query, block_tables, head_lens) -> None:
        """Score this layer's keys with the prompt queries chosen by the runner."""
        cache = state.cache
        for rows in metrics.prompt_rows:
            tables = block_tables[rows.seq_index]
            lens = head_lens[rows.seq_index]
            spec = rows.spec
            scored = attention_metrics(
                query[rows.row_start:rows.row_end],
                step.query_positions[rows.row_start:rows.row_end],
                state.key_cache,
                cache.slot_positions,
                tables,
                lens,
                self.scale,
                power=spec.power,
                skip_nearest=spec.skip_nearest if spec.queries == "full" else 0,
            )
            accumulate_metrics(cache.slot_metrics, tables, lens, scored)
            if rows.prompt_done:
                pool_metrics(cache.slot_metrics, tables, lens, spec.pool_kernel, spec.pool)


class PerHeadAttentionBackend(AttentionBackend):
    """Attention over per-(layer, KV head) pages (ops picked by ``kvcompress.ops.dispatch``:
    CUDA extension, Triton or the PyTorch reference)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # The pool is re-viewed page by page; any layout of the backing buffer works,
        # but the CPU platform only resolves LBHNC.
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        # vLLM maps backend names back to its enum: this class is registered as the
        # override of CPU_ATTN on CPU and as CUSTOM on CUDA (patches/attention_registry.py).
        from vllm.platforms import current_platform

        return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[PerHeadAttentionImpl]:
        return PerHeadAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PerHeadAttentionMetadataBuilder]:
        return PerHeadAttentionMetadataBuilder
