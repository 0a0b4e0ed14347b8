"""A torch function mode that records the calls which read device values on the host.

On CUDA each such call waits for the stream: inside a layer's attention it stops the host
from queueing the next layers while the GPU works. On CPU the same calls are harmless, so
tests on CPU catch them by name (boolean-mask indexing included, which reads the mask's
count)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset({
    "__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu",
    "nonzero", "masked_select", "unique", "tensor",
})


def _bool_index(name: str, args: tuple) -> bool:
    if name not in ("__getitem__", "__setitem__") or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in index)


class HostReadWatch(TorchFunctionMode):
    """``with HostReadWatch() as watch: ...`` then ``watch.reads``: the names of the torch
    calls made that read device values on the host, except while ``watch.paused``."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused and (name in HOST_READS or _bool_index(name, args)):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))
