"""Handing a tensor to another process on the same device, without a socket in between.

CUDA: an IPC memory handle (the receiver maps the sender's allocation and copies from it on
the device). Both processes may call the GPU by different indices (Ray narrows
CUDA_VISIBLE_DEVICES per process), so a handle names its GPU by UUID. CPU: a file in shared
memory, one copy on each side (the same-host path of the CPU tests).

What crosses between the processes is a ``SharedTensor`` as JSON text: shapes, dtype names and
the handle's bytes in base64, nothing unpickled.
"""

from __future__ import annotations

import base64
import json
import math
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from typing import Literal

import torch

# "cuda_ipc": the GPU's own IPC; "shm_file": a shared-memory file (CPU, same host)
SharingKind = Literal["cuda_ipc", "shm_file"]


@dataclass(frozen=True)
class SharedTensor:
    kind: SharingKind
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    device: str  # the GPU's UUID (cuda_ipc) or the host's name (shm_file)
    # cuda_ipc: torch's IPC fields (reductions.reduce_tensor's), bytes in base64; shm_file: the path
    fields: tuple

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SharedTensor:
        raw = json.loads(text)
        return cls(raw["kind"], raw["dtype"], tuple(raw["shape"]), raw["device"], tuple(raw["fields"]))


def device_identity(kind: SharingKind) -> str:
    """Names this process's device, the same in every process that shares it."""
    if kind == "cuda_ipc":
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return f"host:{socket.gethostname()}"


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _raw(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def export_tensor(tensor: torch.Tensor, kind: SharingKind, scratch_dir: str = "/dev/shm") -> SharedTensor:
    """A handle to ``tensor`` (contiguous) for another process on this device. The sender keeps
    ``tensor`` alive until the receiver says it has copied it; ``release`` ends a shm handle."""
    dtype = str(tensor.dtype).replace("torch.", "")
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import reduce_tensor

        # torch records an event on the current stream here; the receiver waits for it, so the
        # tensor's pending writes (a dtype conversion, say) land before it is read
        _, args = reduce_tensor(tensor.detach())
        (_cls, size, stride, offset, _storage_cls, _dtype, _device, handle, storage_bytes, storage_offset,
         _grad, ref_handle, ref_offset, event_handle, event_sync) = args
        fields = (list(size), list(stride), offset, _b64(handle), storage_bytes, storage_offset,
                  _b64(ref_handle), ref_offset, _b64(event_handle), bool(event_sync))
        return SharedTensor(kind, dtype, tuple(tensor.shape), device_identity(kind), fields)
    path = os.path.join(scratch_dir, f"megarl-sync-{uuid.uuid4().hex}")
    mapped = torch.from_file(path, shared=True, size=tensor.numel(), dtype=tensor.dtype)
    mapped.copy_(tensor.reshape(-1))
    return SharedTensor(kind, dtype, tuple(tensor.shape), device_identity(kind), (path,))


def _local_gpu(device_uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    raise RuntimeError(f"weight sync: GPU {device_uuid} is not visible to this process "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def copy_shared_into(shared: SharedTensor, target: torch.Tensor) -> None:
    """Copies the tensor ``shared`` names into ``target`` (same number of elements); returns once
    the copy is complete, so the sender may free or reuse its tensor."""
    dtype = getattr(torch, shared.dtype)
    if shared.kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        (size, stride, offset, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
         event_sync) = shared.fields
        source = rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), offset, torch.UntypedStorage,
                                     dtype, _local_gpu(shared.device), _raw(handle), storage_bytes, storage_offset,
                                     False, _raw(ref_handle), ref_offset, _raw(event_handle), event_sync)
        target.copy_(source.view(target.shape))
        torch.cuda.current_stream(target.device).synchronize()  # done before the sender hears of it
        del source
        return
    (path,) = shared.fields
    source = torch.from_file(path, shared=True, size=math.prod(shared.shape), dtype=dtype)
    target.copy_(source.view(target.shape))


def release(shared: SharedTensor) -> None:
    """Ends a handle once the receiver has copied it (CUDA: torch's IPC ref counting frees the
    sender's block when its tensor goes; shm: the file is removed)."""
    if shared.kind == "shm_file":
        try:
            os.unlink(shared.fields[0])
        except FileNotFoundError:
            pass
