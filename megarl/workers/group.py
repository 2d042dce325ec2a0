"""An SPMD group of Ray actors: one role (actor, critic, reference, rollout) of an RL job.

Each rank is a Ray actor in its own process; the ranks form one torch.distributed
group (gloo on CPU, nccl on GPU), inside which megatron-core builds its parallel
groups. The driver calls module-level functions on the ranks:

    group = WorkerGroup("actor", 4, pythonpath=[...])
    group.run(build_model, hf_dir=path)             # every rank, results in rank order
    call = group.submit(send_weights, port=port)     # start now ...
    rollout.run(receive_weights, port=port)          # ... while another group joins in
    call.result()

It is SpmdPool (megarl.distributed.spmd) placed by Ray instead of multiprocessing:
Ray gives placement groups, GPUs per rank and multi-node placement; SpmdPool stays
for one-machine CLI commands that need no Ray.

Functions. ``fn`` is pickled by Ray (cloudpickle): a function of an importable module
travels by reference (module + qualname) and is imported on the rank. Functions in
megarl/ always import; test or script modules import only if their directory is on
the rank's sys.path, which ``pythonpath`` adds before the first call (Ray itself adds
only the driver's working directory). Objects that outlive a call live in
megarl.workers.state.state; ``current_rank()`` tells a function who it is. The
keyword arguments are serialised once for all ranks; an ObjectRef passed as one (a
batch another role produced) arrives as its value.

Order. Each rank runs calls one at a time, in the order the driver submitted them
(Ray keeps one caller's order per actor), so every rank meets collectives in the
same order. Submit from one driver thread.

Failures. A rank that raises, a rank whose process dies, or a call past its timeout
fails the call with WorkerGroupError naming the role, the rank(s) and the function,
without waiting for the other ranks (they may be blocked in a collective forever).
The group is then torn down (its collectives can no longer be trusted); start a new
one.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megarl.distributed.bringup import free_port, join_process_group
from megarl.platform import current_platform
from megarl.utils.abort import RUN_ABORT
from megarl.utils.cores import usable_cores
from megarl.workers.state import RankContext, current_rank, set_current_rank, state

_POLL_S = 1.0  # longest single ray.wait, so the driver stays responsive to Ctrl-C
# After a rank raises, how long to look for a rank whose process died: a death makes
# its peers' collectives raise too, and the death is the cause worth reporting.
_FAILURE_GRACE_S = 2.0
_CLOSE_TIMEOUT_S = 10.0


class WorkerGroupError(RuntimeError):
    """A call on a WorkerGroup failed; the message names role, rank(s), function and cause."""

    def __init__(self, message: str, role: str = "", ranks: Sequence[int] = (), what: str = "",
                 died: Sequence[int] = ()):
        super().__init__(message)
        self.role = role
        self.ranks = list(ranks)  # the ranks that failed, or did not answer in time
        self.what = what  # the function (or start-up step) that failed
        # the ranks whose process died (not a rank that raised): a restart can bring those back
        # (trainer.max_restarts), while an error a rank raises would only repeat
        self.died = list(died)


@dataclass(frozen=True)
class RankAddress:
    """Where a rank runs: for logs, for killing it in tests, for node-local ranks."""

    node_ip: str
    node_id: str
    pid: int


# --------------------------------------------------------------------------- rank side


class RankWorker:
    """One rank's process: runs the group's calls in order; RankState outlives them."""

    def __init__(self, role: str, rank: int, world_size: int, pythonpath: Sequence[str]) -> None:
        for path in reversed(pythonpath):
            if path not in sys.path:
                sys.path.insert(0, path)
        set_current_rank(RankContext(role, rank, world_size))

    def call(self, fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
        """Returns (True, result) or (False, traceback): the rank's traceback text, as it was.

        A keyword argument that is an ObjectRef (another role's output, say) arrives as its
        value, as Ray does for a task's own arguments; refs nested deeper stay refs.
        """
        import ray

        try:
            kwargs = {k: ray.get(v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()}
            return True, fn(**kwargs)
        except BaseException:  # SystemExit too: it would end the actor with a worse message
            return False, traceback.format_exc()

    def call_kept(self, fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[tuple[bool, Any], Any]:
        """``call`` as two results (Ray's ``num_returns=2``): (ok, traceback or None) for the driver
        to read, and the result, which stays in this node's object store (``WorkerGroup.run_kept``)."""
        ok, value = self.call(fn, kwargs)
        return (ok, None if ok else value), (value if ok else None)


def _where() -> RankAddress:
    import ray

    return RankAddress(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid())


def _init_distributed(master_addr: str, master_port: int, local_rank: int, local_world_size: int,
                      node_ip: str, threads: int | None, collective_timeout_s: float | None = None) -> None:
    """Joins this rank to the group's torch.distributed group with the platform's backend."""
    ctx = current_rank()
    import ray

    if ray.get_runtime_context().get_assigned_resources().get("GPU", 0) > 0 and not current_platform().is_gpu:
        # Ray gave this rank a GPU share, yet torch sees no CUDA (a CPU-only torch, or
        # MEGARL_PLATFORM=cpu on a GPU node): refuse instead of training on the CPU unnoticed
        raise RuntimeError(f"rank {ctx.rank} was given a GPU by Ray but torch sees no CUDA here "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                           f"MEGARL_PLATFORM={os.environ.get('MEGARL_PLATFORM', '')!r})")
    # Ray sets OMP_NUM_THREADS to the actor's logical CPUs (1); size the pool from the
    # real cores shared by this group's ranks on the node instead, as SpmdPool does.
    threads = threads or max(1, usable_cores() // local_world_size)
    join_process_group(ctx.rank, ctx.world_size, master_addr, master_port, local_rank, local_world_size, threads,
                       timeout_s=collective_timeout_s)
    set_current_rank(replace(ctx, local_rank=local_rank, local_world_size=local_world_size,
                                        node_ip=node_ip))


def _close_rank() -> None:
    """Drops the rank's objects and its process group before the process is killed."""
    import gc

    import torch.distributed as dist

    state.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


@functools.cache
def _actor_class() -> Any:
    import ray

    return ray.remote(RankWorker)


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ------------------------------------------------------------------------- driver side


class PendingCall:
    """A call started on some ranks of a group; ``result()`` collects it (once)."""

    def __init__(self, group: WorkerGroup, refs: dict[int, Any], what: str) -> None:
        self._group = group
        self._refs = refs
        self.what = what
        self._outcome: list[Any] | WorkerGroupError | None = None

    @property
    def ranks(self) -> list[int]:
        return list(self._refs)

    def done(self) -> bool:
        """True once every rank has answered (or failed); never blocks."""
        import ray

        if self._outcome is not None:
            return True
        refs = list(self._refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def failed(self) -> bool:
        """True once some rank has failed (raised, or its process died); never blocks.

        A driver that waits on another party of the same collective (a rollout engine in a
        weight sync) polls this, so that a dead rank ends the wait at once."""
        import ray

        if self._outcome is not None:
            return isinstance(self._outcome, WorkerGroupError)
        refs = list(self._refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return any(not _outcome(ref)[0] for ref in ready)

    def result(self, timeout_s: float | None = None) -> list[Any]:
        """The ranks' results in the order the ranks were given; raises WorkerGroupError.

        A timeout is a failure like any other (the ranks that did not answer may be stuck
        in a collective): it tears the group down. Use ``done()`` to poll.
        """
        if self._outcome is None:
            try:
                self._outcome = self._group._collect(self._refs, self.what, timeout_s)
            except WorkerGroupError as error:
                self._outcome = error
        if isinstance(self._outcome, WorkerGroupError):
            raise self._outcome
        return self._outcome


class WorkerGroup:
    """``world_size`` Ray actors forming one torch.distributed group; see the module docstring.

    ``num_cpus_per_rank``/``num_gpus_per_rank`` are Ray resources per rank (fractions let
    colocated roles share a GPU). With ``placement_group``, rank r goes to bundle
    ``bundle_offset + r``, so several roles can share one placement group. ``env`` is set
    in each rank's process before it starts (Ray runtime_env). ``pythonpath`` entries go
    first on each rank's sys.path, so functions of modules outside the installed packages
    (tests, scripts) can be called. ``threads_per_rank`` defaults to the node's cores over
    this group's ranks on that node.
    """

    def __init__(self, role: str, world_size: int, *, num_cpus_per_rank: float = 1,
                 num_gpus_per_rank: float = 0, env: Mapping[str, str] | None = None,
                 placement_group: Any = None, bundle_offset: int = 0, pythonpath: Sequence[str] = (),
                 threads_per_rank: int | None = None, start_timeout_s: float = 300,
                 collective_timeout_s: float | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        from megarl.cluster.ray_env import ensure_ray

        ensure_ray()
        self.role = role
        self.world_size = world_size
        self._closed: str | None = None  # why the group stopped, once it has
        self._resources = dict(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank)
        self._start_timeout_s = start_timeout_s
        self._actors: list[Any] = []
        try:
            for rank in range(world_size):
                self._actors.append(self._start_actor(rank, env, placement_group, bundle_offset, pythonpath))
        except BaseException:  # e.g. a bundle index the placement group does not have
            self._teardown("start-up failed")
            raise
        deadline = time.monotonic() + start_timeout_s
        try:
            self.addresses: list[RankAddress] = self._collect(
                self._send(range(world_size), _where, {}), "start-up", start_timeout_s, starting=True)
            self._join_process_group(threads_per_rank, deadline, collective_timeout_s)
        except BaseException:  # an abort or Ctrl-C (a failure or timeout has stopped the ranks already)
            self._teardown("start-up interrupted")
            raise

    def _join_process_group(self, threads_per_rank: int | None, deadline: float,
                            collective_timeout_s: float | None) -> None:
        """Rank 0 picks the rendezvous port on its node; every rank then joins with its node-local rank."""
        [port] = self._collect(self._send([0], free_port, {}), "start-up (port)",
                               max(0.0, deadline - time.monotonic()), starting=True)
        node_ranks: dict[str, list[int]] = {}
        for rank, address in enumerate(self.addresses):
            node_ranks.setdefault(address.node_id, []).append(rank)
        refs = {}
        for rank, address in enumerate(self.addresses):
            local = node_ranks[address.node_id]
            refs[rank] = self._actors[rank].call.remote(_init_distributed, dict(
                master_addr=self.addresses[0].node_ip, master_port=port, local_rank=local.index(rank),
                local_world_size=len(local), node_ip=address.node_ip, threads=threads_per_rank,
                collective_timeout_s=collective_timeout_s))
        self._collect(refs, "init_process_group", max(0.0, deadline - time.monotonic()), starting=True)

    def _start_actor(self, rank: int, env: Mapping[str, str] | None, placement_group: Any,
                     bundle_offset: int, pythonpath: Sequence[str]) -> Any:
        options: dict[str, Any] = dict(self._resources, max_restarts=0, max_task_retries=0)
        if env:
            options["runtime_env"] = {"env_vars": {k: str(v) for k, v in env.items()}}
        if placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_offset + rank)
        return _actor_class().options(**options).remote(self.role, rank, self.world_size, list(pythonpath))

    # ------------------------------------------------------------------ calls

    @property
    def alive(self) -> bool:
        """False once the group failed or was shut down (a dead process shows at the next call)."""
        return self._closed is None

    @property
    def pids(self) -> list[int]:
        return [address.pid for address in self.addresses]

    @property
    def actors(self) -> list[Any]:
        """The ranks' Ray actor handles, in rank order (for liveness checks)."""
        return list(self._actors)

    def run(self, fn: Callable[..., Any], /, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Calls ``fn(**kwargs)`` on every rank; returns the results in rank order."""
        return self.submit(fn, **kwargs).result(timeout_s)

    def run_on(self, ranks: Iterable[int], fn: Callable[..., Any], /, timeout_s: float | None = None,
               **kwargs: Any) -> list[Any]:
        """Calls ``fn(**kwargs)`` on ``ranks`` only; results in the order of ``ranks``."""
        return self.submit_on(ranks, fn, **kwargs).result(timeout_s)

    def run_kept(self, fn: Callable[..., Any], /, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Calls ``fn(**kwargs)`` on every rank and leaves each result where the rank put it, in its
        node's object store, owned by the driver (so it outlives the rank's process): the results'
        ObjectRefs in rank order. Passed to a later call as a keyword argument, a ref arrives as its value."""
        import ray

        if self._closed is not None:
            raise WorkerGroupError(f"WorkerGroup {self.role!r} is closed ({self._closed}); start a new one",
                                   self.role, list(range(self.world_size)), _describe(fn))
        args = ray.put(dict(kwargs))
        pairs = {rank: actor.call_kept.options(num_returns=2).remote(fn, args)
                 for rank, actor in enumerate(self._actors)}
        self._collect({rank: pair[0] for rank, pair in pairs.items()}, _describe(fn), timeout_s)
        return [pairs[rank][1] for rank in range(self.world_size)]

    def submit(self, fn: Callable[..., Any], /, **kwargs: Any) -> PendingCall:
        """Starts ``fn(**kwargs)`` on every rank and returns at once.

        The driver needs this to drive two groups in one collective (a weight sync from
        this group into a rollout engine): a blocking call on one would wait forever for
        the other, which would not have been started yet.
        """
        return self.submit_on(range(self.world_size), fn, **kwargs)

    def submit_on(self, ranks: Iterable[int], fn: Callable[..., Any], /, **kwargs: Any) -> PendingCall:
        """Starts ``fn(**kwargs)`` on ``ranks`` only and returns at once."""
        if not callable(fn):
            raise TypeError(f"fn must be a function, got {fn!r}")
        ranks = list(ranks)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"ranks must be distinct ranks of {self.world_size}, got {ranks}")
        if self._closed is not None:
            raise WorkerGroupError(f"WorkerGroup {self.role!r} is closed ({self._closed}); start a new one",
                                   self.role, ranks, _describe(fn))
        return PendingCall(self, self._send(ranks, fn, kwargs), _describe(fn))

    def _send(self, ranks: Iterable[int], fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[int, Any]:
        import ray

        args = ray.put(dict(kwargs))  # serialised once, however many ranks read it
        return {rank: self._actors[rank].call.remote(fn, args) for rank in ranks}

    def _collect(self, refs: dict[int, Any], what: str, timeout_s: float | None,
                 starting: bool = False) -> list[Any]:
        """Waits for every rank's answer, failing as soon as one rank fails or time runs out."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = {ref: rank for rank, ref in refs.items()}
        results: dict[int, Any] = {}
        failures: dict[int, tuple[bool, str]] = {}  # rank -> (process died, detail), in arrival order
        while pending:
            # A watchdog that saw a process this call may depend on die ends the wait: the ranks
            # may be blocked in a collective with it forever.
            RUN_ABORT.check()
            wait_s = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            for ref in ready:
                rank = pending.pop(ref)
                ok, value, died = _outcome(ref)
                if ok:
                    results[rank] = value
                else:
                    failures[rank] = (died, value)
            if failures:
                self._look_for_deaths(pending, failures)
                raise self._failed(what, failures)
            if deadline is not None and pending and time.monotonic() >= deadline:
                raise self._timed_out(what, sorted(pending.values()), timeout_s or 0.0, starting)
        return [results[rank] for rank in refs]

    @staticmethod
    def _look_for_deaths(pending: dict[Any, int], failures: dict[int, tuple[bool, str]]) -> None:
        import ray

        grace_end = time.monotonic() + _FAILURE_GRACE_S
        while pending and not any(died for died, _ in failures.values()):
            left = grace_end - time.monotonic()
            if left <= 0:
                return
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                ok, value, died = _outcome(ref)
                rank = pending.pop(ref)
                if not ok:
                    failures[rank] = (died, value)

    def _failed(self, what: str, failures: dict[int, tuple[bool, str]]) -> WorkerGroupError:
        was_closed = self._closed
        died = [rank for rank, (d, _) in failures.items() if d]
        first = died[0] if died else next(iter(failures))
        self._teardown(f"{what} failed on rank {first}")
        head = f"WorkerGroup {self.role!r}: {what} failed on rank {first} of {self.world_size}"
        if was_closed is not None:
            head += f" because the group was closed meanwhile ({was_closed})"
        elif died:
            head += " (its process died: killed, crashed or out of memory)"
        others = [rank for rank in failures if rank != first]
        if others:
            head += f"; also failed: ranks {others}"
        return WorkerGroupError(f"{head}:\n{failures[first][1]}", self.role, list(failures), what, died)

    def _timed_out(self, what: str, ranks: list[int], timeout_s: float, starting: bool) -> WorkerGroupError:
        self._teardown(f"{what} timed out")
        limit = self._start_timeout_s if starting else timeout_s
        message = (f"WorkerGroup {self.role!r}: {what} timed out after {limit:.1f} s; "
                   f"ranks {ranks} of {self.world_size} did not answer")
        if starting:
            import ray

            message += (f" (each rank asks for {self._resources}; Ray has {ray.available_resources()} free:"
                        f" not enough resources, or a placement group that is not ready?)")
        return WorkerGroupError(message, self.role, ranks, what)

    # --------------------------------------------------------------- shutdown

    def _teardown(self, reason: str) -> None:
        import ray

        if self._closed is None:
            self._closed = reason
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray already shut down
                pass

    def shutdown(self, graceful: bool = True) -> None:
        """Stops the ranks: lets them drop their objects and process group first if ``graceful``."""
        import ray

        if self._closed is not None:
            return
        if graceful and ray.is_initialized():
            try:
                refs = list(self._send(range(self.world_size), _close_rank, {}).values())
                ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_TIMEOUT_S)
            except Exception:  # a rank already died: nothing to close gracefully, kill the rest
                pass
        self._teardown("shut down by the driver")

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(graceful=exc[0] is None)

    def __repr__(self) -> str:
        status = "alive" if self._closed is None else f"closed: {self._closed}"
        return f"WorkerGroup({self.role!r}, world_size={self.world_size}, {status})"


def _outcome(ref: Any) -> tuple[bool, Any, bool]:
    """(ok, result or error text, whether the rank's process died) for one finished call."""
    import ray
    from ray.exceptions import RayActorError, RayError

    try:
        ok, value = ray.get(ref)
    except RayActorError as error:
        return False, str(error), True
    except RayError as error:  # e.g. the function or its arguments could not be unpickled
        hint = ("\n(is the function's module importable on the ranks? pass its directory in "
                "WorkerGroup(pythonpath=[...]))" if "No module named" in str(error) else "")
        return False, str(error) + hint, False
    return ok, value, False
