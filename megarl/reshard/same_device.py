"""Point-to-point messages between two sync-group ranks on one device.

A colocated actor rank and the vLLM worker it feeds share a GPU, and one NCCL communicator
cannot hold two ranks of one GPU. Their messages go through the device instead: the sender
publishes a handle to its payload under a key of the sync group's store, the receiver copies
from it into its parameter and answers on a second key, and only then does the sender let the
payload go. Keys carry the pair, the message's tag and a count of that tag's earlier messages,
so two syncs never read each other's handles. Every wait is bounded by the group's timeout.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

import torch

from megarl.platform.ipc import SharedTensor, SharingKind, copy_shared_into, export_tensor, release


class _SendWork:
    def __init__(self, store, key: str, shared: SharedTensor, payload: torch.Tensor, timeout: timedelta):
        self.store, self.key, self.shared, self.payload, self.timeout = store, key, shared, payload, timeout

    def wait(self) -> bool:
        self.store.wait([f"{self.key}/copied"], self.timeout)
        self.store.delete_key(f"{self.key}/copied")
        release(self.shared)
        self.payload = None  # the receiver is done with it
        return True


class _RecvWork:
    def __init__(self, store, key: str, target: torch.Tensor, timeout: timedelta):
        self.store, self.key, self.target, self.timeout = store, key, target, timeout

    def wait(self) -> bool:
        self.store.wait([self.key], self.timeout)
        shared = SharedTensor.from_json(self.store.get(self.key).decode())
        self.store.delete_key(self.key)
        copy_shared_into(shared, self.target)
        self.store.set(f"{self.key}/copied", "1")
        return True


class SameDeviceChannel:
    """send/recv with the ProcessGroup's shape (lists of one tensor, a work to wait on)."""

    def __init__(self, store, rank: int, kind: SharingKind, timeout_s: float):
        self.store, self.rank, self.kind = store, rank, kind
        self.timeout = timedelta(seconds=timeout_s)
        self._counts: dict[tuple[int, int, int], int] = defaultdict(int)

    def _key(self, src: int, dst: int, tag: int) -> str:
        n = self._counts[(src, dst, tag)]
        self._counts[(src, dst, tag)] = n + 1
        return f"{src}->{dst}/{tag}/{n}"

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _SendWork:
        (payload,) = tensors
        payload = payload.contiguous()
        shared = export_tensor(payload, self.kind)
        key = self._key(self.rank, dst, tag)
        self.store.set(key, shared.to_json())
        return _SendWork(self.store, key, shared, payload, self.timeout)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _RecvWork:
        (target,) = tensors
        return _RecvWork(self.store, self._key(src, self.rank, tag), target, self.timeout)
