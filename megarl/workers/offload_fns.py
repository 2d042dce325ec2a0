"""Rank functions that move a held model's memory off its device and back (colocated placement).

When vLLM shares devices with Megatron roles, the roles step aside while vLLM generates:
their parameters, gradient buffers and optimizer state go to host memory and their
device storage is freed; before they next run, everything comes back bit for bit.

The unit is the tensor *storage*, not the tensor: megatron-core's DDP keeps parameters
and ``main_grad`` as views into contiguous buffers, and the distributed optimizer's fp32
main parameters may be views of the model's own. Freeing a storage (``resize_(0)``) and
re-growing it in place keeps every view, every ``Parameter`` object and every optimizer
reference valid, so nothing has to be rebuilt or re-registered after an onload.

On CPU the "host copy" is a second CPU buffer: the same code frees and restores the
same storages (the memory is really returned), which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megarl.platform import current_platform
from megarl.workers.megatron_model import HeldModel, held

PARTS = ("params", "grads", "optimizer")


def _ddp_buffers(chunk) -> list:
    """megatron-core DDP's contiguous param/grad buffers (none before the role first trains;
    an unwrapped module's ``buffers`` is nn.Module's method, not a list)."""
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, list):
            found += value
    return found


def _tensors(model: HeldModel, part: str) -> Iterator[torch.Tensor]:
    if part == "params":
        for chunk in model.chunks:
            yield from chunk.parameters()
            for buffer in _ddp_buffers(chunk):
                if getattr(buffer, "param_data", None) is not None:
                    yield buffer.param_data
    elif part == "grads":
        for chunk in model.chunks:
            for buffer in _ddp_buffers(chunk):
                yield buffer.grad_data
    elif part == "optimizer":
        for opt in model.optimizers():
            inner = opt.optimizer
            for group in inner.param_groups:  # fp32 main params (views of the model's when it is fp32)
                yield from group["params"]
            for state in inner.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    else:
        raise ValueError(f"unknown part {part!r}: expected one of {', '.join(PARTS)}")


def _host_copy(storage: torch.UntypedStorage) -> torch.Tensor:
    device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    pin = storage.device.type == "cuda"  # pinned host memory: the copy back runs at full bandwidth
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
    host.copy_(device_bytes)
    return host


def offload(key: str, parts: tuple[str, ...] = PARTS) -> int:
    """Frees the device storage of ``parts`` of the held model, keeping host copies; returns bytes freed.

    Idempotent: storages already offloaded are skipped, so a role can give up its
    optimizer before a weight sync and its parameters after it. Unknown parts raise.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}: expected some of {', '.join(PARTS)}")
    model = held(key)
    saved: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = model.extra.setdefault("offloaded", {})
    # A storage is shared between parts when, say, fp32 main parameters of the optimizer are
    # views of the model's weights: it stays while any part that uses it stays.
    kept = {t.untyped_storage().data_ptr() for part in PARTS if part not in parts for t in _tensors(model, part)}
    freed = 0
    for part in parts:
        for tensor in _tensors(model, part):
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in saved or storage.data_ptr() in kept:
                continue
            ptr = storage.data_ptr()
            saved[ptr] = (storage, _host_copy(storage))
            freed += storage.nbytes()
            storage.resize_(0)
    if freed:
        current_platform().release_cached_memory()
    return freed


def onload(key: str) -> int:
    """Brings every offloaded storage of the held model back, bit for bit; returns bytes restored."""
    model = held(key)
    saved = model.extra.get("offloaded", {})
    restored = 0
    # Each host copy is dropped only once its storage holds it again: a device allocation that
    # fails partway (colocated, the GPU is shared) leaves the rest offloaded, not lost, and a
    # later onload finishes the job.
    for ptr, (storage, host) in list(saved.items()):
        storage.resize_(host.numel())
        torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host)
        restored += host.numel()
        del saved[ptr]
    model.extra.pop("offloaded", None)
    return restored
