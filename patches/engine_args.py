"""Patch: ``--kv-compress*`` flags on vLLM's engine arguments.

Why: ``EngineArgs.add_cli_args`` builds the parser of ``vllm serve`` and
``vllm bench throughput``, and ``EngineArgs.from_cli_args`` keeps only dataclass
fields, so an added flag must be carried into ``additional_config`` by hand (into the
parsed ``args`` too: the extra API-server processes of ``--api-server-count N`` build
their engine arguments from them before the plugin patches anything there).
``create_engine_config`` is wrapped so that every entry point (CLI, ``LLM(...)``,
benchmarks) validates kvcompress settings and selects the kvcompress scheduler
and worker before the engine starts (``prepare``, the glue's
``engine_setup.prepare_engine_args``, which also writes the validated section), and
refuses unsupported models after (``check``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vllm.engine.arg_utils import EngineArgs

from kvcompress.config import (
    ADDITIONAL_CONFIG_KEY,
    FLAGS,
    KVCompressConfig,
    flag_help,
    setting_type,
)
from kvcompress.patches.util import apply_once


def add_kvcompress_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the kvcompress flag group (no-op if already present)."""
    if any(a.dest == "kv_compress" for a in parser._actions):
        return
    group = parser.add_argument_group(
        "kvcompress", "KV-Compress: per-(layer, KV head) paged KV cache and its compression"
    )
    group.add_argument(
        FLAGS["enabled"], dest="kv_compress", action="store_true", default=argparse.SUPPRESS,
        help=flag_help("enabled"),
    )
    for field in FLAGS:
        if field == "enabled":
            continue
        kind, choices = setting_type(field)
        # absent = not given (SUPPRESS): vLLM's formatter then adds no "(default: None)";
        # help: the setting's docstring in kvcompress/config.py
        if kind is bool:  # --kv-compress-x / --no-kv-compress-x, as vLLM's own switches
            group.add_argument(
                FLAGS[field], dest=f"kv_compress_{field}", action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=flag_help(field),
            )
            continue
        group.add_argument(
            FLAGS[field], dest=f"kv_compress_{field}", type=kind, choices=choices,
            default=argparse.SUPPRESS, help=flag_help(field),
        )


def kvcompress_section(args: argparse.Namespace) -> dict:
    """The ``additional_config["kvcompress"]`` values given on the command line."""
    section = {}
    if getattr(args, "kv_compress", None):
        section["enabled"] = True
    for field in FLAGS:
        if field == "enabled":
            continue
        value = getattr(args, f"kv_compress_{field}", None)
        if value is not None:
            section[field] = value
    return section


def apply(prepare: Callable[[EngineArgs], KVCompressConfig],
          check: Callable[[Any, KVCompressConfig], None]) -> None:
    """``prepare(engine_args)`` before vLLM builds an engine config (validates, selects
    kvcompress's classes, writes the validated section); ``check(vllm_config,
    settings)`` after it."""
    if not apply_once("engine_args"):
        return

    original_add_cli_args = EngineArgs.add_cli_args
    original_from_cli_args = EngineArgs.from_cli_args.__func__
    original_create_engine_config = EngineArgs.create_engine_config

    def add_cli_args(parser, *args, **kwargs):
        parser = original_add_cli_args(parser, *args, **kwargs)
        add_kvcompress_arguments(parser)
        return parser

    def from_cli_args(cls, args):
        engine_args = original_from_cli_args(cls, args)
        section = kvcompress_section(args)
        if section:
            additional = dict(engine_args.additional_config or {})
            additional[ADDITIONAL_CONFIG_KEY] = {
                **(additional.get(ADDITIONAL_CONFIG_KEY) or {}), **section
            }
            engine_args.additional_config = additional
            # Also into the parsed arguments: with --api-server-count > 1 vLLM hands
            # ``args`` to API-server processes that build their engine arguments before
            # this patch is applied there; --additional-config reaches them as a field.
            args.additional_config = dict(additional)
        return engine_args

    def create_engine_config(self, *args, **kwargs):
        settings = prepare(self)
        vllm_config = original_create_engine_config(self, *args, **kwargs)
        check(vllm_config, settings)
        return vllm_config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
