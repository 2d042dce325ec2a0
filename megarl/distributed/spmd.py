"""A pool of SPMD ranks on this machine, started by megarl itself (no torchrun).

Each rank is a spawned process with torch.distributed initialised (gloo on CPU,
nccl on GPU). ``pool.run(fn, **kwargs)`` calls the module-level function ``fn``
on every rank and returns the per-rank results. The CLI starts a pool for one
command; tests keep one pool for a whole session, because starting a rank costs
several seconds of imports.

A rank that raises, or dies, fails the call with an error naming the rank; the
pool is then torn down, since its collectives can no longer be trusted.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from megarl.distributed.bringup import free_port, join_process_group
from megarl.platform import current_platform
from megarl.utils.cores import usable_cores


class SpmdError(RuntimeError):
    """A rank of an SpmdPool failed; the message names the rank and carries its traceback."""


class PoolTooWide(ValueError):
    """More ranks than this machine's GPUs: refused before any rank starts."""


def _threads_per_rank(world_size: int) -> int:
    cores = usable_cores()
    return max(1, cores // world_size)


def _rank_main(rank: int, world_size: int, port: int, threads: int, conn: Connection,
               env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    try:
        join_process_group(rank, world_size, "127.0.0.1", port, local_rank=rank, local_world_size=world_size,
                           threads=threads)
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, kwargs = task
        try:
            conn.send(("ok", fn(**kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class SpmdPool:
    """``world_size`` ranks that run the same function; see the module docstring."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None,
                 threads_per_rank: int | None = None, start_timeout_s: float = 300.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        gpus = current_platform().visible_gpus()
        if gpus is not None and world_size > gpus:
            # each rank binds a GPU of its own: NCCL refuses two ranks of one group on one GPU
            raise PoolTooWide(f"{world_size} ranks need {world_size} GPUs, and {gpus} are visible: use at most "
                             f"{gpus} ranks, or MEGARL_PLATFORM=cpu to run them on the CPU")
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = threads_per_rank or _threads_per_rank(world_size)
        self._conns: list[Connection] = []
        self._procs: list[mp.Process] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, name=f"megarl-rank{rank}",
                args=(rank, world_size, port, threads, child, dict(env or {})),
                # not daemonic: megatron-core checkpoint saving starts child processes
                daemon=False,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start-up", timeout_s=start_timeout_s)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Runs ``fn(**kwargs)`` on every rank; returns the results in rank order."""
        if not self.alive:
            raise SpmdError("the SPMD pool is closed or lost a rank; start a new one")
        for conn in self._conns:
            conn.send((fn, kwargs))
        return self._collect(getattr(fn, "__qualname__", str(fn)), timeout_s)

    def _collect(self, what: str, timeout_s: float | None) -> list[Any]:
        import time

        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending) + list(sentinels), timeout=remaining)
            if not ready:
                self.close(force=True)
                raise SpmdError(f"{what}: ranks {sorted(pending.values())} did not answer "
                                f"within {timeout_s:.0f} s")
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self._conns[rank]
                    if conn in pending and not conn.poll():
                        code = self._procs[rank].exitcode
                        errors[rank] = f"process exited with code {code} (killed or crashed)"
                        pending.pop(conn)
                    continue
                rank = pending.pop(obj)
                try:
                    status, payload = obj.recv()
                except EOFError:
                    errors[rank] = "process closed its pipe (crashed)"
                    continue
                if status == "error":
                    errors[rank] = payload
                else:
                    results[rank] = payload
            if errors:
                # One failed rank leaves the others blocked in collectives: stop them all.
                self.close(force=True)
                first = min(errors)
                detail = errors[first]
                raise SpmdError(f"{what} failed on rank {first} of {self.world_size}"
                                f" (failed ranks: {sorted(errors)}):\n{detail}")
        return [results[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        for conn in self._conns:
            if not force:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> SpmdPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)
