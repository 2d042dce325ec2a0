"""A process group between the actor's ranks and the rollout engine's workers.

It is made outside torch.distributed's global state (its own TCPStore and
backend object), so it can span processes that already belong to other groups:
the actor's Megatron world on one side, vLLM's own TP world on the other.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def node_ip() -> str:
    """An address of this machine that the other side can reach."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class SyncGroup:
    """The sync group's backend with its rank and size; send/recv go straight to the backend."""

    def __init__(self, backend_group, rank: int, world_size: int):
        self.backend = backend_group
        self.rank = rank
        self.world_size = world_size

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        return self.backend.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int):
        return self.backend.recv(tensors, src, tag)

    def close(self) -> None:
        try:
            self.backend.shutdown()
        except (AttributeError, RuntimeError):
            pass


def open_sync_group(host: str, port: int, rank: int, world_size: int, backend: str,
                    timeout_s: float = 300.0) -> SyncGroup:
    """Joins (rank 0: hosts) the sync group; every member must call this concurrently."""
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
    sync = SyncGroup(group, rank, world_size)
    _warm_up(sync)
    return sync


def _warm_up(group: SyncGroup) -> None:
    """One small all-reduce: connects every pair now, not inside the first timed transfer."""
    t = torch.ones(1)
    group.backend.allreduce([t]).wait()
    if t.item() != group.world_size:
        raise RuntimeError(f"weight-sync group: warm-up all-reduce gave {t.item()}, expected {group.world_size}")
