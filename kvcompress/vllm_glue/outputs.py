"""vLLM's step outputs with kvcompress's part of the contract declared.

vLLM passes one ``SchedulerOutput`` from the scheduler to the worker and one
``ModelRunnerOutput`` back per step; neither has a field for a plugin's data. These
subclasses declare one (``kvcompress``), so nothing travels as an undeclared
attribute. The payloads are ``kvcompress.contract``'s dataclasses. Both classes are
plain dataclass subclasses: they pickle across the mp executor and every vLLM code
path that reads the base fields keeps working.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

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


def _fields_of(instance, base: type) -> dict:
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(base) if f.init}


def with_step_compression(
    output: SchedulerOutput, step: StepCompression
) -> KVCompressSchedulerOutput:
    """``output`` as a :class:`KVCompressSchedulerOutput` carrying ``step``."""
    return KVCompressSchedulerOutput(**_fields_of(output, SchedulerOutput), kvcompress=step)


def step_compression_of(output: SchedulerOutput) -> StepCompression:
    """The step's compression part (empty when the scheduler sent none)."""
    step = output.kvcompress if isinstance(output, KVCompressSchedulerOutput) else None
    return step if step is not None else StepCompression()


def with_report(
    output: ModelRunnerOutput, reports: tuple[WorkerReport, ...]
) -> KVCompressModelRunnerOutput:
    """A copy of ``output`` (never the shared empty output itself) carrying ``reports``
    (one per TP rank)."""
    return KVCompressModelRunnerOutput(**_fields_of(output, ModelRunnerOutput), kvcompress=reports)


def report_of(output: ModelRunnerOutput | None) -> tuple[WorkerReport, ...] | None:
    if isinstance(output, KVCompressModelRunnerOutput):
        return output.kvcompress
    return None
