"""Peak bytes of tensor storage allocated by a block of torch code, on any device.

torch's CPU allocator keeps no peak statistics, and the process RSS mixes in allocator
caching and other libraries. This counts tensor storages instead: a dispatch mode sees
every operator (forward and autograd backward alike), and each output whose storage
is not one of the operator's inputs' (so not a view or an in-place result) and was not
seen before is a new allocation; a weak-reference finalizer subtracts its bytes when
the storage is freed. Storages that existed before the block (its inputs) are never
counted. What it cannot see: scratch memory a kernel allocates and frees internally
without returning it as a tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class TensorMemory(TorchDispatchMode):
    """``with TensorMemory() as m: ...`` then ``m.peak_bytes`` (and ``m.live_bytes`` still held)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tracked: set[tuple[torch.device, int]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {(s.device, s.data_ptr()) for s in _storages((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for storage in _storages(out):
            key = (storage.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in inputs or key in self._tracked:
                continue
            self._tracked.add(key)
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: tuple[torch.device, int], nbytes: int) -> None:
        self._tracked.discard(key)
        self.live_bytes -= nbytes
