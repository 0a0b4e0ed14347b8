"""vLLM general plugin entry point (``vllm.general_plugins: kvcompress``)."""

from __future__ import annotations


def register() -> None:
    """Called by vLLM in every process; checks the vLLM version and applies patches."""
    from kvcompress.patches import apply_all

    apply_all()
