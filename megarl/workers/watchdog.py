"""A hang detector that does not wait for the step timeout: the liveness of every process a run
depends on, checked every few seconds from a thread of the driver.

What it watches:
- each rank of each Megatron group (actor, critic, reference, reward model): its Ray actor's
  state in Ray's control store, which turns DEAD as soon as the process is gone, whether the
  rank was busy in a collective or idle between calls;
- each rollout engine: its Ray actor the same way, and the vLLM processes beneath it (engine
  core, workers), through the engine's ``health()`` (answered from a second thread of the
  engine actor, so a blocked ``generate`` or weight sync does not delay it). An engine that
  does not answer within ``answer_timeout_s`` counts as hung;
- the rollout service (``megarl.rollout_driver.service``): its Ray actor's state.

On the first death it trips the run's abort signal with one line naming the role, the rank or
engine, and the process; every driver-side wait raises it within a second (megarl.utils.abort).
An engine's fault goes first to ``engine_fault`` where one is set (the run's engine restarts,
``rollout.max_engine_restarts``): if it takes the fault on, that engine is no longer watched and
the run goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.utils.abort import RUN_ABORT, AbortSignal
from megarl.workers.group import WorkerGroup

_FAILED_LOOKS_LIMIT = 3


@dataclass(frozen=True)
class _Watched:
    label: str  # "role 'actor' rank 1", "rollout engine 0"
    actor: Any  # Ray actor handle
    group: WorkerGroup | None = None  # None for an engine
    engine: bool = False
    index: int = -1  # an engine's index in the fleet


# (engine index, its Ray actor, the one line that names the fault) -> whether the run takes it on
EngineFault = Callable[[int, Any, str], bool]


def _actor_states() -> dict[str, str]:
    """Ray actor id (hex) -> state, for every actor Ray knows (one control-store query)."""
    from ray._private import state  # no public equivalent that works without the dashboard

    return {actor_id: info.get("State", "") for actor_id, info in state.actors().items()}


class Watchdog:
    def __init__(self, abort: AbortSignal = RUN_ABORT, interval_s: float = 2.0, answer_timeout_s: float = 30.0):
        self.abort = abort
        self.interval_s = interval_s
        self.answer_timeout_s = answer_timeout_s
        self._watched: list[_Watched] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.engine_fault: EngineFault | None = None
        self._lock = threading.Lock()  # the watch thread and the driver's both change what is watched

    def watch_group(self, group: WorkerGroup) -> None:
        for rank, actor in enumerate(group.actors):
            self._watched.append(_Watched(f"role {group.role!r} rank {rank} (pid {group.pids[rank]})", actor, group))

    def watch_engine(self, index: int, engine: Any) -> None:
        with self._lock:
            self._watched.append(_Watched(f"rollout engine {index}", engine, engine=True, index=index))

    def watch_actor(self, label: str, actor: Any) -> None:
        """Any other actor the run depends on, by its state alone (``label`` names it in the line)."""
        self._watched.append(_Watched(label, actor))

    def forget_engines(self) -> None:
        """Stops watching the rollout engines (before they are stopped on purpose)."""
        with self._lock:
            self._watched = [w for w in self._watched if not w.engine]

    def _taken_on(self, w: _Watched, reason: str) -> bool:
        """An engine's fault that ``engine_fault`` takes on: that engine is no longer watched."""
        if not w.engine or self.engine_fault is None or not self.engine_fault(w.index, w.actor, reason):
            return False
        with self._lock:
            self._watched = [x for x in self._watched if x is not w]
        return True

    # -- checking -----------------------------------------------------------------------------

    def check(self, answer_timeout_s: float | None = None) -> str | None:
        """One look at everything watched: the first death found, as one line, or None."""
        import ray

        answer_timeout_s = self.answer_timeout_s if answer_timeout_s is None else answer_timeout_s
        states = _actor_states()
        with self._lock:
            watched = list(self._watched)
        for w in watched:
            if w.group is not None and not w.group.alive:
                continue  # torn down on purpose (its own failure was reported by the call that saw it)
            if states.get(w.actor._actor_id.hex()) == "DEAD":
                reason = f"{w.label}: its process died (killed, crashed or out of memory)"
                if not self._taken_on(w, reason):
                    return reason
        with self._lock:
            engines = [w for w in self._watched if w.engine]
        if not engines:
            return None
        refs = [w.actor.health.remote() for w in engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=answer_timeout_s)
        for w, ref in zip(engines, refs, strict=True):
            if ref not in ready:
                reason = f"{w.label}: did not answer a liveness check within {answer_timeout_s:.0f} s"
            else:
                try:
                    health = ray.get(ref)
                    reason = f"{w.label}: vLLM's {health.dead[0].describe()}" if health.dead else None
                except ray.exceptions.RayActorError:
                    reason = f"{w.label}: its process died (killed, crashed or out of memory)"
            if reason is not None and not self._taken_on(w, reason):
                return reason
        return None

    def _loop(self) -> None:
        failed_looks = 0
        while not self._stop.wait(self.interval_s):
            try:
                reason = self.check()
                failed_looks = 0
            except Exception as error:
                if self._stop.is_set():  # Ray shutting down under us: nothing left to watch
                    return
                # One failed query of Ray's control store is no reason to end a run; several are.
                failed_looks += 1
                reason = (f"the watchdog could not check the run's processes {failed_looks} times in a row: "
                          f"{error}" if failed_looks >= _FAILED_LOOKS_LIMIT else None)
            if reason is not None:
                self.abort.trip(reason)
                return

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._loop, name="megarl-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.answer_timeout_s + self.interval_s)
