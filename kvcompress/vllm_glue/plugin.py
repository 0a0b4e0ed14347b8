"""vLLM general plugin entry point (``vllm.general_plugins: kvcompress``): applies the
patches (``kvcompress.patches``) with the glue functions they call (``GlueHooks``)."""

from __future__ import annotations


def _stat_loggers_for(vllm_config, log_stats: bool) -> list:
    # Imported when an AsyncLLM is built, not in every process that loads the plugin.
    from kvcompress.vllm_glue.metrics import stat_loggers_for

    return stat_loggers_for(vllm_config, log_stats)


def _outputs_decoder() -> type:
    from kvcompress.vllm_glue.metrics import KVCompressOutputsDecoder

    return KVCompressOutputsDecoder


def register() -> None:
    """Called by vLLM in every process; checks the vLLM version and applies patches."""
    from kvcompress.patches import GlueHooks, apply_all
    from kvcompress.vllm_glue.engine_setup import check_model_supported, prepare_engine_args

    apply_all(GlueHooks(
        prepare_engine_args=prepare_engine_args,
        check_model_supported=check_model_supported,
        stat_loggers_for=_stat_loggers_for,
        outputs_decoder=_outputs_decoder,
    ))
