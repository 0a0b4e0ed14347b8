"""Patch: validate per-request kvcompress fields where vLLM validates requests.

Why: ``SamplingParams.extra_args`` (the OpenAI field ``vllm_xargs``) is free-form;
vLLM passes it through unchecked. ``InputProcessor._validate_params`` runs in the
front-end process before a request reaches the engine, and the OpenAI server
answers its ``VLLMValidationError`` with HTTP 400, so a bad ``kv_compress_rate``
is refused there, naming the field, and the server keeps serving.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

from kvcompress.budget import RequestFieldError, request_budget
from kvcompress.config import KVCompressConfig
from kvcompress.patches.util import apply_once


def check_request_fields(vllm_config, params) -> None:
    """Raise ``VLLMValidationError`` naming the first invalid kvcompress field."""
    if not isinstance(params, SamplingParams) or not params.extra_args:
        return
    if not any(str(key).startswith("kv_compress") for key in params.extra_args):
        return
    settings = KVCompressConfig.from_additional_config(vllm_config.additional_config)
    try:
        request_budget(settings, params.extra_args)
    except RequestFieldError as error:
        raise VLLMValidationError(
            f"invalid kvcompress request field {error}",
            parameter=error.field,
            value=params.extra_args.get(error.field),
        ) from None


def apply() -> None:
    if not apply_once("input_processor"):
        return
    original = InputProcessor._validate_params

    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        check_request_fields(self.vllm_config, params)
        return result

    InputProcessor._validate_params = _validate_params
