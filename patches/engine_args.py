"""Patch: ``--kv-compress*`` flags on vLLM's engine arguments.

Why: ``EngineArgs.add_cli_args`` builds the parser of ``vllm serve`` and
``vllm bench throughput``, and ``EngineArgs.from_cli_args`` keeps only dataclass
fields, so an added flag must be carried into ``additional_config`` by hand.
``create_engine_config`` is wrapped so that every entry point (CLI, ``LLM(...)``,
benchmarks) validates kvcompress settings and selects the kvcompress scheduler
and worker before the engine starts.
"""

from __future__ import annotations

import argparse
import types
import typing

from vllm.engine.arg_utils import EngineArgs

from kvcompress.config import ADDITIONAL_CONFIG_KEY, FLAGS, KVCompressConfig
from kvcompress.policies import policy_defaults

POLICY_DEFAULT_FIELDS = set(policy_defaults("kvc"))
from kvcompress.patches.util import apply_once

def _flag_help(field: str) -> str:
    """The field's docstring in config.py, without the trailing flag reference."""
    import ast
    import inspect

    import kvcompress.config as config_module

    tree = ast.parse(inspect.getsource(config_module.KVCompressConfig))
    body = tree.body[0].body
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and getattr(node.target, "id", None) == field
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            text = " ".join(after.value.value.split())
            return text.split(" (``--kv-compress")[0].rstrip(".") + "."
    return field


def _value_parser(field: str):
    """(type, choices) of a field for argparse; ``X | None`` parses as X."""
    annotation = KVCompressConfig.model_fields[field].annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
    if choices:
        return str, list(choices)
    if annotation is float:
        return float, None
    if annotation is str:
        return str, None
    return int, None


def _default_text(field: str, defaults: KVCompressConfig) -> str:
    value = getattr(defaults, field)
    if value is None and field in POLICY_DEFAULT_FIELDS:
        return ""  # the help text names each policy's default
    return f" (default: {'none' if value is None else value})"


def add_kvcompress_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the kvcompress flag group (no-op if already present)."""
    if any(a.dest == "kv_compress" for a in parser._actions):
        return
    group = parser.add_argument_group(
        "kvcompress", "KV-Compress: per-(layer, KV head) paged KV cache and its compression"
    )
    defaults = KVCompressConfig()
    group.add_argument(
        FLAGS["enabled"], dest="kv_compress", action="store_true", default=argparse.SUPPRESS,
        help="Keep the KV cache in pages that each hold one (layer, KV head), so heads can be "
        "compressed at their own rates and freed pages return to the scheduler. Implied by "
        "any other --kv-compress-* flag.",
    )
    for field in FLAGS:
        if field == "enabled":
            continue
        kind, choices = _value_parser(field)
        group.add_argument(
            FLAGS[field], dest=f"kv_compress_{field}", type=kind, choices=choices,
            default=argparse.SUPPRESS,  # absent = not given; vLLM's formatter then adds no "(default: None)"
            help=f"{_flag_help(field)}{_default_text(field, defaults)}",
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


def apply() -> None:
    if not apply_once("engine_args"):
        return
    from kvcompress.vllm_glue.engine_setup import check_model_supported, prepare_engine_args

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
        return engine_args

    def create_engine_config(self, *args, **kwargs):
        settings = prepare_engine_args(self)
        vllm_config = original_create_engine_config(self, *args, **kwargs)
        check_model_supported(vllm_config, settings)
        return vllm_config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
