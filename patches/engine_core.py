"""Patch: a ``kvc_page_stats`` utility call on vLLM's ``EngineCore``.

Why: the scheduler lives in the engine-core process; vLLM's utility RPC
(``engine_core.call_utility(name)``) only reaches ``EngineCore`` methods. Tests and
benchmarks read the scheduler's page counters through it.
"""

from __future__ import annotations

from vllm.v1.engine.core import EngineCore

from kvcompress.patches.util import apply_once


def kvc_page_stats(self) -> dict:
    stats = getattr(self.scheduler, "kvc_page_stats", None)
    if stats is None:
        return {}
    return stats()


def kvc_reset_peaks(self) -> None:
    reset = getattr(self.scheduler, "kvc_reset_peaks", None)
    if reset is not None:
        reset()


def apply() -> None:
    if apply_once("engine_core"):
        EngineCore.kvc_page_stats = kvc_page_stats
        EngineCore.kvc_reset_peaks = kvc_reset_peaks
