"""The PyTorch reference backend: every op, on any device (the end of every fallback chain).

Its ops are :class:`kvcompress.ops.backend.KernelBackend`'s defaults.
"""

from __future__ import annotations

from kvcompress.ops.backend import KernelBackend


class ReferenceBackend(KernelBackend):
    """The PyTorch ops (:mod:`kvcompress.ops.reference_attention`, ``decode_by_slot``,
    ``move_cache``, ``page_tables``)."""

    name = "reference"
    sliding_window = True


BACKEND = ReferenceBackend()
