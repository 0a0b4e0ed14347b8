"""Patch: kvcompress's Prometheus metrics on ``/metrics`` (``vllm serve``'s ``AsyncLLM``).

Why: kvcompress's figures are made in the engine-core process and must reach the
API-server process, which serves ``/metrics``. They ride in vLLM's ``SchedulerStats``
(``KVCompressScheduler.make_stats``, a declared field of a subclass); two things in the
front end need a hook, and only for an engine with kvcompress on and stats on:

1. a stat logger that publishes them: ``AsyncLLM``'s public ``stat_loggers`` argument
   gets the loggers ``stat_loggers_for`` names (the glue's
   :class:`~kvcompress.vllm_glue.metrics.KVCompressPrometheusLogger`; vLLM's
   ``vllm.stat_logger_plugins`` entry point would load it into every server, stock ones
   too, and turn their ``--disable-log-stats`` off);
2. a decoder that keeps the field: while ``AsyncLLM.__init__`` builds the engine-core
   client, the module-level name ``vllm.v1.engine.core_client.MsgpackDecoder`` is
   ``outputs_decoder()`` (the glue's
   :class:`~kvcompress.vllm_glue.metrics.KVCompressOutputsDecoder`), which decodes
   ``EngineCoreOutputs`` as ``KVCompressEngineCoreOutputs`` (same fields, the stats
   typed as the subclass). Every other decoder the client builds is vLLM's own.

A stock engine (no ``--kv-compress*``) gets neither: ``AsyncLLM.__init__`` runs as is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from kvcompress.patches.util import apply_once, swapped_attribute


def apply(stat_loggers_for: Callable[[Any, bool], list], outputs_decoder: Callable[[], type]) -> None:
    """``stat_loggers_for(vllm_config, log_stats)``: the loggers an ``AsyncLLM`` gets
    (none: vLLM's ``__init__`` untouched); ``outputs_decoder()``: the decoder class its
    engine-core client then uses."""
    if not apply_once("metrics"):
        return
    from vllm.v1.engine import core_client
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        bound = signature.bind(self, *args, **kwargs)
        ours = stat_loggers_for(bound.arguments["vllm_config"], bool(bound.arguments["log_stats"]))
        if not ours:
            original(self, *args, **kwargs)
            return
        bound.arguments["stat_loggers"] = [*(bound.arguments.get("stat_loggers") or ()), *ours]
        with swapped_attribute(core_client, "MsgpackDecoder", outputs_decoder()):
            original(*bound.args, **bound.kwargs)

    AsyncLLM.__init__ = __init__
