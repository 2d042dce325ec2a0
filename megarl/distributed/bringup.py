"""One way to bring a rank up: its environment, its threads, its device, its process group.

Used by both ways megarl starts ranks: ``SpmdPool`` (processes it spawns itself, for the
CLI's one-shot jobs) and ``WorkerGroup`` (Ray actors, for a run's roles).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` ("" = every interface) right now, for a rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_process_group(rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int,
                       local_world_size: int, threads: int, timeout_s: float | None = None) -> None:
    """Sets the torch.distributed environment of this process and joins the group with the
    platform's backend (gloo on CPU, nccl on GPU); a bounded ``timeout_s`` turns a collective
    whose peer hung into an error on this rank."""
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world_size), OMP_NUM_THREADS=str(threads),
    )
    import torch
    import torch.distributed as dist

    from megarl.platform import current_platform

    torch.set_num_threads(threads)
    platform = current_platform()
    platform.bind_device(local_rank)
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group(platform.backend, rank=rank, world_size=world_size, **timeout)
