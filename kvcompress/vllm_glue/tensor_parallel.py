"""The worker's tensor-parallel rank and the gather of every rank's step report to the
rank whose output vLLM's executors read (TP rank 0 of the last pipeline stage)."""

from __future__ import annotations

import torch

from kvcompress.contract import WorkerReport


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 without a TP group)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


def gather_reports(report: WorkerReport) -> tuple[WorkerReport, ...] | None:
    """Every TP rank's report, in rank order, on TP rank 0 (the rank whose output
    vLLM's executors read); None on the other ranks. Every rank calls it at the same
    point of the same step (their steps are the scheduler's same output)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return (report,)
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return (report,)
    gathered = [None] * group.world_size if group.rank_in_group == 0 else None
    torch.distributed.gather_object(report, gathered, dst=group.ranks[0], group=group.cpu_group)
    return tuple(gathered) if gathered is not None else None
