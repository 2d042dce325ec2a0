"""A process group between the actor's ranks and the rollout engine's workers.

It is made outside torch.distributed's global state (its own TCPStore and
backend object), so it can span processes that already belong to other groups:
the actor's Megatron world on one side, vLLM's own TP world on the other.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from megarl.platform import current_platform
from megarl.platform.ipc import device_identity
from megarl.reshard.same_device import SameDeviceChannel


def node_ip() -> str:
    """An address of this machine that the other side can reach."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


# How pairs of ranks on one device exchange messages: "auto" is the platform's own way (CUDA IPC
# on GPU; none on CPU, where every pair goes through the group), "shm" shared-memory files
# between the ranks of one host (CPU), "off" the group for every pair.
SameDevice = Literal["auto", "shm", "off"]


class SyncGroup:
    """The sync group: each peer reached through the torch.distributed backend or, when it shares
    this rank's device, through the same-device channel (``peers_on_this_device``)."""

    def __init__(self, backend_group, rank: int, world_size: int, same_device: SameDeviceChannel | None = None,
                 peers_on_this_device: frozenset[int] = frozenset()):
        self.backend = backend_group
        self.rank = rank
        self.world_size = world_size
        self.same_device = same_device
        self.peers_on_this_device = peers_on_this_device

    def _route(self, peer: int):
        return self.same_device if peer in self.peers_on_this_device else self.backend

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        return self._route(dst).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int):
        return self._route(src).recv(tensors, src, tag)

    def close(self) -> None:
        try:
            self.backend.shutdown()
        except (AttributeError, RuntimeError):
            pass


def open_sync_group(host: str, port: int, rank: int, world_size: int, backend: str,
                    timeout_s: float = 300.0, same_device: SameDevice = "auto") -> SyncGroup:
    """Joins (rank 0: hosts) the sync group; every member must call this concurrently.

    No collective runs over the whole group: where an actor rank and a rollout worker share a
    GPU, a communicator holding every member cannot exist. Joining is a barrier on the store
    instead (each member publishes which device it is on and reads everyone's), and the
    backend's pairwise connections form at the first message between each pair."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=True)
    prefixed = dist.PrefixStore("megarl-weight-sync", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s))
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    kind = current_platform().same_device_sharing if same_device == "auto" else (
        "shm_file" if same_device == "shm" else None)
    devices = dist.PrefixStore("megarl-devices", store)
    devices.set(str(rank), device_identity(kind) if kind else f"rank-{rank}")
    # every member's device; get() waits for each one's (the group's timeout), a barrier
    where = [devices.get(str(r)).decode() for r in range(world_size)]
    peers = frozenset(r for r in range(world_size) if r != rank and where[r] == where[rank]) if kind else frozenset()
    channel = SameDeviceChannel(dist.PrefixStore("megarl-same-device", store), rank, kind, timeout_s) if kind else None
    return SyncGroup(group, rank, world_size, channel, peers)
