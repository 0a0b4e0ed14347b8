"""vLLM's step outputs with kvcompress's part of the contract declared.

vLLM passes one ``SchedulerOutput`` from the scheduler to the worker and one
``ModelRunnerOutput`` back per step; neither has a field for a plugin's data. These
subclasses declare one (``kvcompress``), so nothing travels as an undeclared
attribute. The payloads are ``kvcompress.contract``'s dataclasses. Both classes are
plain dataclass subclasses that add only that field: an output is re-classed in place
(``__class__``), it pickles across the mp executor and every vLLM code path that reads
the base fields keeps working.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from kvcompress.contract import StepCompression, WorkerReport


@dataclass
class KVCompressSchedulerOutput(SchedulerOutput):
    """``SchedulerOutput`` + the step's compression orders and admissions."""

    kvcompress: StepCompression | None = None


@dataclass
class KVCompressModelRunnerOutput(ModelRunnerOutput):
    """``ModelRunnerOutput`` + the workers' page reports of the step, one per
    tensor-parallel rank in rank order (gathered to the rank whose output vLLM reads)."""

    kvcompress: tuple[WorkerReport, ...] | None = None


def with_step_compression(
    output: SchedulerOutput, step: StepCompression
) -> KVCompressSchedulerOutput:
    """``output`` itself, re-classed as a :class:`KVCompressSchedulerOutput` carrying
    ``step`` (vLLM builds a fresh output every step and keeps no other reference to it;
    re-classing costs a microsecond where copying its fields cost ~25 us per step)."""
    output.__class__ = KVCompressSchedulerOutput
    output.kvcompress = step
    return output


def step_compression_of(output: SchedulerOutput) -> StepCompression:
    """The step's compression part (empty when the scheduler sent none)."""
    step = output.kvcompress if isinstance(output, KVCompressSchedulerOutput) else None
    return step if step is not None else StepCompression()


def with_report(
    output: ModelRunnerOutput, reports: tuple[WorkerReport, ...]
) -> KVCompressModelRunnerOutput:
    """``output`` re-classed as a :class:`KVCompressModelRunnerOutput` carrying
    ``reports`` (one per TP rank); vLLM's shared empty output is copied first, never
    written to."""
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy.copy(output)
    output.__class__ = KVCompressModelRunnerOutput
    output.kvcompress = reports
    return output


def report_of(output: ModelRunnerOutput | None) -> tuple[WorkerReport, ...] | None:
    if isinstance(output, KVCompressModelRunnerOutput):
        return output.kvcompress
    return None
