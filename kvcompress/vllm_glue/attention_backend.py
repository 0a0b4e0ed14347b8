"""vLLM attention backend over the per-(layer, KV head) paged cache.

On CPU it replaces ``CPU_ATTN`` inside a kvcompress engine; on CUDA it is
vLLM's ``CUSTOM`` backend, selected for kvcompress engines (see
``patches/attention_registry.py``). The model runner (``runner.py``) plans each
step (pages allocated, where every new KV goes) and publishes it with
``set_current_step``; the metadata builder hands that plan to every layer, and
the impl writes the layer's new KVs and runs ``kvcompress.ops.reference_attention``.
vLLM's own ``kv_cache`` views and ``slot_mapping`` are not used: the whole KV
buffer is one pool of pages, reached through ``WorkerCacheState`` (its ``pool``, and
its ``ops``: the kernels' backends, resolved once for the engine).
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
from kvcompress.ops import MetricSink, PagedBatch, SlotBatch
from kvcompress.ops.cpu_attention import KERNEL_HEAD_SIZES
from kvcompress.ops.dispatch import decode_by_slot_capturable
from kvcompress.ops.metrics import accumulate_metrics, attention_metrics, pool_metrics
from kvcompress.ops.reconstruction import reconstruction_attention
from kvcompress.vllm_glue import step as step_state
from kvcompress.vllm_glue.kv_layout import FP8_CACHE_DTYPES, kv_cache_dtype_problem
from kvcompress.vllm_glue.step import PerHeadStep, PromptScored, ReconstructionStep

# CUDA: the Triton kernels pad any head size to a power of two (the CUDA op takes
# 64 / 128 / 256 and hands the others to Triton); CPU: vLLM 0.32's CPU attention kernel.
CUDA_HEAD_SIZES = (64, 80, 96, 112, 128, 160, 192, 224, 256)
CPU_HEAD_SIZES = KERNEL_HEAD_SIZES


def supported_head_sizes(platform=None) -> tuple[int, ...]:
    """Head sizes the per-head attention runs on a kernel for, on ``platform``
    (default: vLLM's current platform)."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    return CPU_HEAD_SIZES if platform.is_cpu() else CUDA_HEAD_SIZES


@dataclass
class KVCompressAttentionMetadata:
    """``step`` is None for warm-up and profiling runs (nothing is read or written).
    ``decode_only``: attend over the ``DecodeBuffers`` (a decode-only step, or the
    capture of a decode CUDA graph, whose buffers then hold only padding rows). A
    ``ReconstructionStep`` marks the runner's kvzip reconstruction pass."""

    num_actual_tokens: int
    step: PerHeadStep | ReconstructionStep | None
    decode_only: bool = False


def cudagraph_support(platform) -> AttentionCGSupport:
    """Full CUDA graphs for decode-only batches where the slot-indexed decode is a
    capturable kernel (Triton on CUDA); otherwise none (vLLM keeps piecewise graphs,
    attention running eagerly between them)."""
    if platform.is_cuda() and decode_by_slot_capturable("cuda"):
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    return AttentionCGSupport.NEVER


def batch_matches_step(step: PerHeadStep, num_reqs: int) -> bool:
    """Whether vLLM's batch of ``num_reqs`` rows is the one the runner planned. Under full
    CUDA graphs vLLM pads a decode-only batch to a captured size (its cudagraph
    dispatcher sets the row count from the padded token count); a decode step over the
    ``DecodeBuffers`` takes that: rows past the step point at the padding slot and write
    into the scratch page. Every other step must match row for row."""
    if step.num_reqs == num_reqs:
        return True
    return step.decode_only and step.kernel_decode is None and num_reqs > step.num_reqs


def warms_up_decode(common_attn_metadata: CommonAttentionMetadata) -> bool:
    """Whether a batch with no step plan (a warm-up run) should run the decode path over
    the ``DecodeBuffers``' padding rows: one token per row, rows within the buffers, and
    a graph-capturable decode (CUDA) whose kernels must compile before capture."""
    state = step_state.get_worker_state()
    if state is None or state.decode_buffers is None or not state.ops.decode_by_slot_capturable:
        return False
    rows = state.decode_buffers.max_rows
    return (
        common_attn_metadata.max_query_len == 1
        and common_attn_metadata.num_reqs <= rows
        and common_attn_metadata.num_actual_tokens <= rows
    )


class KVCompressAttentionMetadataBuilder(AttentionMetadataBuilder[KVCompressAttentionMetadata]):
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
    ) -> KVCompressAttentionMetadata:
        step = step_state.current_step()
        if step is not None and not batch_matches_step(step, common_attn_metadata.num_reqs):
            raise RuntimeError(
                f"kvcompress step plan covers {step.num_reqs} requests but vLLM "
                f"built a batch of {common_attn_metadata.num_reqs}"
            )
        if step is None:
            # Warm-up and profiling runs: nothing real is read or written; a uniform
            # single-token batch runs the graph-captured decode over padding rows, so
            # its kernels compile here rather than inside the graph capture.
            return KVCompressAttentionMetadata(
                num_actual_tokens=common_attn_metadata.num_actual_tokens,
                step=None,
                decode_only=warms_up_decode(common_attn_metadata),
            )
        return KVCompressAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            step=step,
            decode_only=step.decode_only,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> KVCompressAttentionMetadata:
        # The graph records the decode-buffer path; the runner reset the buffers to
        # padding rows, so warm-up runs of the capture read and write nothing real.
        state = step_state.get_worker_state()
        return KVCompressAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            step=None,
            decode_only=state is not None and state.decode_buffers is not None,
        )


def require_unit_kv_scales(layer: AttentionLayer, cache_dtype: str) -> None:
    """FP8 pages hold K and V as they are (vLLM's default scales, 1.0): a checkpoint's or a
    calculated scale would have to travel with every op that reads the pages, which
    kvcompress's kernels do not do yet."""
    scales = (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
    if scales != (1.0, 1.0) or getattr(layer, "calculate_kv_scales", False):
        raise ValueError(
            f"--kv-compress with --kv-cache-dtype {cache_dtype} takes unit K / V scales only "
            f"(layer {getattr(layer, 'layer_name', '?')} has k_scale {scales[0]:g}, v_scale {scales[1]:g}"
            + (", --calculate-kv-scales" if getattr(layer, "calculate_kv_scales", False) else "")
            + "): serve without the checkpoint's KV scales or with --kv-cache-dtype auto"
        )


class KVCompressAttentionImpl(AttentionImpl):
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
        if logits_soft_cap:
            unsupported.append("logit soft-capping")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("cross-layer KV sharing")
        if sinks is not None:
            unsupported.append("attention sinks")
        if kv_cache_dtype_problem(kv_cache_dtype):
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
        # FP8 pages hold the values as they are (unit scales): checked at the first call.
        self._scales_unchecked = kv_cache_dtype != "auto"
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        # This layer's window (tokens) or None; a windowed layer is never compressed
        # (kv_layout.compressible_layers), so it scores no metrics.
        self.sliding_window = sliding_window
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
        attn_metadata: KVCompressAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, num_heads, D]``, key/value ``[T, num_kv_heads, D]``;
        output ``[T, num_heads, D]`` (written in place; vLLM's ``Attention.forward``
        gives these views)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling run: defined output, as vLLM's backends give
            return output.fill_(0)
        if self._scales_unchecked:
            require_unit_kv_scales(layer, self.kv_cache_dtype)
            self._scales_unchecked = False
        if isinstance(attn_metadata.step, ReconstructionStep):
            return self._reconstruct(layer, query, key, value, output, attn_metadata.step)
        if attn_metadata.decode_only:
            step = attn_metadata.step
            if step is not None and step.kernel_decode is not None:
                return self._decode_planned(layer, query, key, value, output, step)
            return self._decode_from_buffers(layer, query, key, value, output)
        if attn_metadata.step is None:
            return output.fill_(0)
        step = attn_metadata.step
        state = step_state.get_worker_state()
        assert state is not None, "kvcompress worker state not initialised"
        layer_index = state.layer_index[layer.layer_name]
        num_tokens = step.num_tokens
        self._store_kvs(
            state, key, value, num_tokens,
            step.plan.write_pages[layer_index], step.plan.write_offsets[layer_index],
        )
        query = query[:num_tokens].view(num_tokens, self.num_heads, self.head_size)
        metrics = step.metrics
        batch = PagedBatch(
            step.tables.layer(layer_index), step.head_lens[:, layer_index],
            step.query_start_loc, step.query_positions, max_head_len=step.max_head_len,
            flat_query_start_loc=step.flat_query_start_loc, layout=step.query_layout,
            sliding_window=self.sliding_window,
        )
        if metrics is not None and metrics.decode_queries is not None:
            metrics.decode_queries.record(layer_index, query, self.scale)
        windowed = self.sliding_window is not None
        state.ops.paged_attention(
            query, state.pool, batch, self.scale,
            out=output[:num_tokens].view(num_tokens, self.num_heads, self.head_size),
            metrics=None if windowed else step.decode_metric_sink,
        )
        if metrics is not None and not windowed:
            self._prompt_metrics(state, step, metrics, query, batch)
        return output

    def _store_kvs(self, state, key, value, num_rows, write_pages, write_offsets) -> None:
        """Write the first ``num_rows`` new K/V rows (``[T, num_kv_heads * D]`` or
        ``[T, num_kv_heads, D]``) at their ``[num_rows, num_kv_heads]`` slots."""
        state.ops.write_kv(
            state.pool,
            key[:num_rows].view(num_rows, self.num_kv_heads, self.head_size),
            value[:num_rows].view(num_rows, self.num_kv_heads, self.head_size),
            write_pages,
            write_offsets,
        )

    def _decode_planned(self, layer, query, key, value, output, step: PerHeadStep) -> torch.Tensor:
        """A decode-only step on vLLM's CPU kernel with the tables and write slots the
        runner built for every layer once this step (``step.kernel_decode``; no CUDA
        graph on CPU, so they are read instead of the ``DecodeBuffers``)."""
        state = step_state.get_worker_state()
        layer_index = state.layer_index[layer.layer_name]
        rows = step.num_reqs
        out = output
        if query.shape[0] != rows:  # padded rows (vLLM's views are [T, heads, D] already)
            query, key, value, out = query[:rows], key[:rows], value[:rows], output[:rows]
        # Every layer records its metric queries (the shared pass runs after the last
        # one); a windowed layer's metrics are never read (it is never compressed).
        state.ops.decode_planned(
            query, state.pool, step.kernel_decode[layer_index], self.scale, out,
            metric_power=step.decode_metric_power, key=key, value=value,
            sliding_window=self.sliding_window,
        )
        return output

    def _decode_from_buffers(self, layer, query, key, value, output) -> torch.Tensor:
        """A decode-only step over ``DecodeBuffers``: no host reads, fixed launch
        shapes for a given row count (vLLM's padded batch: ``query.shape[0]`` rows)."""
        state = step_state.get_worker_state()
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
        batch = SlotBatch(
            cache.tables.chunk_tables[:, layer_index], cache.head_lens[:, layer_index],
            buffers.seq_slots[:rows], buffers.query_positions[:rows],
            max_head_len=buffers.max_head_len, row_index=buffers.row_index[:rows],
            chunks=cache.tables.chunks, sliding_window=self.sliding_window,
        )
        windowed = self.sliding_window is not None
        state.ops.paged_decode_by_slot(
            query[:rows].view(rows, self.num_heads, self.head_size), state.pool, batch, self.scale,
            out=output[:rows].view(rows, self.num_heads, self.head_size),
            metrics=None if windowed else MetricSink(buffers.metric_slots, buffers.metric_power),
            partition_size=buffers.partition_size_for(rows, self.num_kv_heads),
        )
        return output

    def _reconstruct(self, layer, query, key, value, output, step: ReconstructionStep) -> torch.Tensor:
        """A reconstruction chunk: attend over the request's KVs and the scoring tokens,
        raise this layer's scores; the cache is not written."""
        state = step_state.get_worker_state()
        layer_index = state.layer_index[layer.layer_name]
        num_tokens = query.shape[0]
        scores = reconstruction_attention(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            state.pool, step.tables.layer(layer_index)[0], step.head_lens[layer_index], self.scale,
            out=output.view(num_tokens, self.num_heads, self.head_size),
        )
        torch.maximum(step.scores[layer_index], scores, out=step.scores[layer_index])
        return output

    def _prompt_metrics(self, state, step, metrics, query, batch: PagedBatch) -> None:
        """Score this layer's keys with the prompt queries chosen by the runner."""
        pool = state.pool
        for rows in metrics.prompt_rows:
            tables = batch.block_tables[rows.seq_index]
            meta_tables = pool.meta_tables(tables)  # where the pages' positions and metrics are
            lens = batch.head_lens[rows.seq_index]
            spec = rows.spec
            scored = attention_metrics(
                query[rows.row_start:rows.row_end],
                step.query_positions[rows.row_start:rows.row_end],
                pool.key_cache,
                pool.slot_positions,
                tables,
                lens,
                self.scale,
                power=spec.power,
                skip_nearest=spec.skip_nearest if spec.queries == "full" else 0,
                position_tables=meta_tables,
            )
            if metrics.prompt_weight != 1.0:
                scored = scored * metrics.prompt_weight
            accumulate_metrics(pool.slot_metrics, meta_tables, lens, scored)
            if rows.prompt_done:
                pool_metrics(pool.slot_metrics, meta_tables, lens, spec.pool_kernel, spec.pool, rows.word_starts)
                if rows.at_prompt_end is not None:  # the scoring kind's hook (kvc-ea re-ranks)
                    rows.at_prompt_end(PromptScored(
                        state, rows, query[rows.row_start:rows.row_end],
                        step.query_positions[rows.row_start:rows.row_end], tables, lens, self.scale,
                    ))


class KVCompressAttentionBackend(AttentionBackend):
    """Attention over per-(layer, KV head) pages (ops picked by ``kvcompress.ops.dispatch``:
    CUDA extension, Triton or the PyTorch reference)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_CACHE_DTYPES]

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        """auto and FP8 pages (``kv_layout.kv_cache_dtype_problem``; ``engine_setup``
        refuses the others first, naming the flag)."""
        if kv_cache_dtype is not None and kv_cache_dtype_problem(kv_cache_dtype) is not None:
            return False
        return super().supports_kv_cache_dtype(kv_cache_dtype)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(supported_head_sizes())

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

    @classmethod
    def supports_sliding_window(cls) -> bool:
        # vLLM's CPU kernel, the reference and the Triton kernels apply windows; on CUDA
        # only on opt-in so far (kv_layout.sliding_windows_allowed).
        from kvcompress.vllm_glue.kv_layout import sliding_windows_allowed

        return sliding_windows_allowed()

    @staticmethod
    def get_impl_cls() -> type[KVCompressAttentionImpl]:
        return KVCompressAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVCompressAttentionMetadataBuilder]:
        return KVCompressAttentionMetadataBuilder
