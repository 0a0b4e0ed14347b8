"""What the in-process side scripts share (``bench_decode_step.py``,
``bench_prefill_policies.py``, ``profile_steps.py``): their first arguments and their
workload, random token-id prompts of one model under a fixed KV memory.

Import it after ``benchmark_throughput`` (which sets ``VLLM_TARGET_DEVICE`` on CPU), as
those scripts do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from benchmarks.throughput import benchmark_throughput as bench


def side_script_parser(description: str, model: str, input_len: int = 2048) -> argparse.ArgumentParser:
    """A parser with the arguments every side script takes: ``--model`` (``tiny``,
    ``smollm2`` or a checkpoint) and ``--input-len`` (tokens per prompt)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=model)
    parser.add_argument("--input-len", type=int, default=input_len)
    return parser


@dataclass(frozen=True)
class SideWorkload:
    """One side script's model, prompts and engine arguments (:func:`side_workload`).

    Attributes:
        path: the checkpoint the engines load.
        description: the model in words (for the printed header).
        prompts: ``num_prompts`` lists of ``input_len`` token ids.
        engine_args: keyword arguments of both engines (``LLM`` and ``kvcompress.LLM``).
    """

    path: str
    description: str
    prompts: list[list[int]]
    engine_args: dict[str, Any]


def side_workload(
    model: str, num_prompts: int, input_len: int, output_len: int, kv_tokens: int, **engine_options: Any,
) -> SideWorkload:
    """``num_prompts`` random prompts (seed 0) of ``input_len`` tokens of ``model`` (its
    default dtype, else ``auto``) and the engine arguments for ``output_len`` tokens
    under ``kv_tokens`` uncompressed tokens of KV memory; ``engine_options`` go to
    :func:`benchmark_throughput.token_prompt_engine_args`."""
    path, description, default_dtype = bench.resolve_model(model)
    shape = bench.kv_shape(path)
    return SideWorkload(
        path=path,
        description=description,
        prompts=bench.synthetic_prompts(input_len, num_prompts, shape["vocab_size"], seed=0),
        engine_args=bench.token_prompt_engine_args(
            shape, default_dtype or "auto", input_len, output_len, kv_tokens, **engine_options,
        ),
    )
