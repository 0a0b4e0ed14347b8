"""vLLM's scheduler with per-(layer, KV head) page accounting and compression.

A thin adapter: the decisions (which request to compress, when, how many pages)
are ``kvcompress.compression_planner.CompressionPlanner``'s, testable without vLLM;
capacity is ``kv_manager.KVCompressKVCacheManager``'s. This module only connects them
to vLLM's hooks and carries the step's :class:`~kvcompress.contract.StepCompression`
to the worker and its :class:`~kvcompress.contract.WorkerReport` back
(``outputs.py``).
"""

from __future__ import annotations

import copy

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvcompress.compression_planner import CompressionPlanner
from kvcompress.config import KVCompressConfig
from kvcompress.contract import StepCompression
from kvcompress.page_accounting import PageAccounting, live_sequence_limit
from kvcompress.vllm_glue.kv_layout import (
    MetadataRows,
    compressible_layers,
    grant_pages_for,
    layer_windows,
    pages_in_pool,
    single_full_attention_group,
)
from kvcompress.vllm_glue.kv_manager import KVCompressKVCacheManager, logical_block_count
from kvcompress.vllm_glue.metrics import with_kvcompress_stats
from kvcompress.vllm_glue.outputs import report_of, with_step_compression
from kvcompress.vllm_glue.prefix_cache import PrefixCacheGlue

logger = init_logger(f"vllm.{__name__}")


class KVCompressScheduler(Scheduler):
    """vLLM's scheduler with per-(layer, KV head) page accounting and compression."""

    def __init__(self, vllm_config, kv_cache_config: KVCacheConfig, *args, **kwargs) -> None:
        settings = KVCompressConfig.from_additional_config(vllm_config.additional_config)
        # Pages of ONE rank's pool and the KV heads of one rank (vLLM's KV cache config
        # is per worker); with tensor parallelism every rank has such a pool.
        num_pages, num_layers, heads_per_rank = pages_in_pool(kv_cache_config)
        num_ranks = vllm_config.parallel_config.tensor_parallel_size
        num_kv_heads = heads_per_rank * num_ranks
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        max_model_len = vllm_config.model_config.max_model_len
        # The worker's slot metadata: identity pages past the pool, and compressing
        # requests' row pages counted as theirs (pool_builder.PoolShape, the same rows).
        rows = MetadataRows.of(kv_cache_config, max_model_len, vllm_config.device_config.device_type)
        logical_config = copy.deepcopy(kv_cache_config)
        logical_config.num_blocks = logical_block_count(
            num_pages, vllm_config.scheduler_config.max_num_seqs, max_model_len, block_size,
            pages_per_token_block=num_layers * heads_per_rank,  # of one rank's pool
        )
        super().__init__(vllm_config, logical_config, *args, **kwargs)
        self.kvc_settings = settings
        windows = layer_windows(vllm_config, single_full_attention_group(kv_cache_config).layer_names)
        # Sliding-window heads give back pages behind their windows, except with prefix
        # caching: the cache maps a request's columns to token blocks, which dropping
        # leading pages would shift (those pages stay until the request ends).
        self.kvc_drops_windows = any(windows) and not self.cache_config.enable_prefix_caching
        accounting = PageAccounting(
            num_pages=num_pages,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            max_requests=vllm_config.scheduler_config.max_num_seqs * 2,
            num_ranks=num_ranks,
            compressible_layers=compressible_layers(windows),
            layer_windows=windows if self.kvc_drops_windows else None,
            rows_per_page=rows.rows_per_page,
            # Never-compressing requests counted in stock's blocks (the worker's cache too).
            grant_pages=grant_pages_for(block_size, vllm_config.device_config.device_type),
        )
        # The worker's cache has sequence slots for this many (live_sequence_limit):
        # vLLM's admission bound, lowered where the pool is the smaller limit.
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        live_limit = live_sequence_limit(num_pages, num_layers * heads_per_rank, max_num_seqs)
        if live_limit < self.max_num_active_reqs:
            logger.info(
                "kvcompress: the pool gives one page per (layer, KV head) to at most %d "
                "sequences at once: at most %d run at a time (--max-num-seqs %d)",
                live_limit, live_limit, max_num_seqs,
            )
            self.max_num_active_reqs = live_limit
        if settings.enabled and accounting.compressible_layers.size == 0:
            logger.warning(
                "kvcompress: every attention layer of this model has a sliding window; such "
                "layers keep every KV, so --kv-compress-rate changes nothing for this model"
            )
        self.kvc_planner = CompressionPlanner(settings, accounting)
        if self.log_stats:  # vLLM takes stats every step (make_stats): count for them
            self.kvc_planner.enable_metrics()
        self.kvc_prefix_cache: PrefixCacheGlue | None = None
        if self.cache_config.enable_prefix_caching:
            self.kvc_prefix_cache = PrefixCacheGlue(
                self.kv_cache_manager.block_pool, accounting, block_size, self.kvc_planner
            )
        self.kv_cache_manager = KVCompressKVCacheManager(
            self.kv_cache_manager,
            accounting,
            max_model_len=max_model_len,
            watermark=self.scheduler_config.watermark,
            relieve=self._relieve if settings.enabled else None,
            compresses=lambda request: self.kvc_planner.budget(request).compresses,
            on_admission_short=self.kvc_planner.note_admission_short if settings.enabled else None,
            on_release=self.kvc_planner.on_released,
            prefix_cache=self.kvc_prefix_cache,
            in_flight_tokens=vllm_config.max_in_flight_tokens,
        )
        logger.info(
            "kvcompress scheduler: %d pages per rank x %d TP rank(s) (%d layers x %d KV "
            "heads per rank x %d token blocks), block size %d", num_pages, num_ranks,
            num_layers, heads_per_rank, kv_cache_config.num_blocks, block_size,
        )

    def _relieve(self, request, pages_short: int) -> None:
        # vLLM's schedule() walks self.running in order, allocating as it goes (a
        # preemption only removes entries): the requests after this one are those not
        # scheduled yet, which vLLM would preempt next.
        running = self.running
        after = running.index(request) + 1 if request in running else 0
        self.kvc_planner.relieve(request, running[after:], pages_short)

    # ------------------------------------------------------------------ vLLM hooks

    def schedule(self, *args, **kwargs):
        planner = self.kvc_planner
        planner.begin_step()
        if self.kvc_drops_windows:
            planner.drop_behind_windows()
        if self.kvc_settings.enabled:
            # Every running request was resolved in the step that admitted it
            # (_step_compression).
            planner.compress_due(self.running, all_resolved=True)
            if planner.admission_short:
                planner.make_room(self.running)
        output = super().schedule(*args, **kwargs)
        planner.note_batch(self.running)
        return with_step_compression(output, self._step_compression(output))

    def _step_compression(self, output) -> StepCompression:
        """Orders of this step, and the resolved compression of every request whose
        pages the worker (re)builds this step."""
        admitted_ids = [new.req_id for new in output.scheduled_new_reqs]
        admitted_ids += list(output.scheduled_cached_reqs.resumed_req_ids or ())
        planner = self.kvc_planner
        prefix_cache = self.kvc_prefix_cache
        prefix_step = None
        if prefix_cache is not None:
            for request_id in admitted_ids:
                request = self.requests[request_id]
                planner.share_prefix(request, prefix_cache.shared_prefix_tokens(request))
            prefix_step = prefix_cache.take_step()
            prefix_step.hits = {
                request_id: prefix_cache.hits[request_id]
                for request_id in admitted_ids
                if prefix_cache.hits.get(request_id)
            }
        return StepCompression(
            admitted={
                request_id: planner.state(self.requests[request_id]).compression
                for request_id in admitted_ids
            },
            orders=planner.take_orders(),
            window_drops=planner.take_window_drops(),
            report_pages_held=planner.report_pages_held(),
            prefix_cache=prefix_step,
        )

    def update_from_output(self, scheduler_output, model_runner_output):
        report = report_of(model_runner_output)
        if report is not None:
            self.kvc_planner.adopt(report)
        return super().update_from_output(scheduler_output, model_runner_output)

    def make_stats(self, *args, **kwargs):
        """vLLM's stats with kvcompress's figures since the last call (``/metrics``)."""
        stats = super().make_stats(*args, **kwargs)
        if stats is None:
            return None
        return with_kvcompress_stats(stats, self.kvc_planner.take_metrics())

    def _preempt_request(self, request, *args, **kwargs) -> None:
        self.kvc_planner.on_preempted(request.request_id)
        super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        self.kvc_planner.on_finished(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    # ------------------------------------------------------------------ utility RPCs

    def kvc_page_stats(self) -> dict:
        """Scheduler-side page counts per running request (for tests and logs)."""
        return {
            **self.kvc_planner.page_stats(),
            "running": [request.request_id for request in self.running],
            "waiting": len(self.waiting),
            "running_limit": self.max_num_active_reqs,  # admission bound (live_sequence_limit)
        }

    def kvc_reset_peaks(self) -> None:
        """Zero the max-batch counters (benchmarks measure one batch at a time)."""
        self.kvc_planner.reset_peaks()
