"""Small helpers for patching vLLM internals reversibly and idempotently."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_APPLIED: set[str] = set()


@contextlib.contextmanager
def swapped_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Temporarily replace ``owner.name`` (a module or class attribute)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def apply_once(key: str) -> bool:
    """True the first time ``key`` is seen in this process (plugins run many times)."""
    if key in _APPLIED:
        return False
    _APPLIED.add(key)
    return True
