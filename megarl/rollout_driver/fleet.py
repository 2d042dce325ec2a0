"""The rollout service's view of its engines when one fails: which ones serve, and calls that survive
an engine's fault (issue 42 items 1, 2 and 4).

Each generation call is a ``Dispatch``: the engine it went to and how to ask another engine the
same thing. ``EngineFleet.wait`` waits for a batch's calls like ``wait_all``, except that a call
whose engine failed (its Ray actor died, or the driver's watchdog reported it: ``mark_failed``) is
asked again of a live engine, and a call that has not answered for ``rollout.request_timeout_s``
(a straggler) is asked again elsewhere, once: the first of the two answers is kept, the late
one dropped. The same request with the same
seed, so the batch is the one the failed engine would have returned, and its prompts are trained
once: the answers are kept by call position, never added twice.

The driver replaces a failed engine at the next weight sync (``megarl.rollout_driver.engine_restarts``)
and hands the service the new handle (``replace``) once it holds the current weights; until then
the failed engine gets no new work. When no engine is left to ask, a failed engine's calls wait
for its replacement, which the driver starts at once (``trainer.max_staleness: 0``, one engine,
colocated or not), and are asked of it when it arrives: the batch in flight is the one the failed
engine would have returned, its prompts trained once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout_driver.inflight import LOST
from megarl.utils.abort import RUN_ABORT

_POLL_S = 0.5
_HEALTH_TIMEOUT_S = 5.0


@dataclass
class Dispatch:
    """One generation call in flight: the engine (its index in the fleet), its Ray object ref, and
    ``ask``, the same request made of any engine handle."""

    engine: int
    ref: Any
    ask: Callable[[Any], Any]
    started: float = field(default_factory=time.monotonic)
    # the straggler this call asks again: whichever of the two answers first is kept, the other dropped
    straggler: Dispatch | None = None
    # the engine handle it went to: once a replacement stands at ``engine``, this call is the old one's
    handle: Any = None


class EngineFleet:
    """The engines of the rollout service (``engines``: the manager's own list, changed in place)."""

    def __init__(self, engines: list, request_timeout_s: float):
        self.engines = engines
        self.request_timeout_s = request_timeout_s
        self.failed: set[int] = set()  # indexes with no work until their replacement arrives
        self.redispatched = 0  # calls asked again of another engine: a failed engine's or a straggler's
        self.stragglers = 0  # of those, calls that had not answered within request_timeout_s
        self._lock = threading.Lock()  # mark_failed comes from the service's fleet thread

    def live(self) -> list[int]:
        with self._lock:
            return [i for i in range(len(self.engines)) if i not in self.failed]

    def live_engines(self) -> dict[int, Any]:
        """The engines that serve, by index."""
        with self._lock:
            return {i: e for i, e in enumerate(self.engines) if i not in self.failed}

    def mark_failed(self, index: int) -> None:
        """The driver's watchdog saw engine ``index`` die or hang: its calls go elsewhere."""
        with self._lock:
            self.failed.add(index)

    def replace(self, index: int, engine: Any) -> None:
        """Engine ``index`` is a new one that holds the current weights: it serves from now on."""
        with self._lock:
            self.engines[index] = engine
            self.failed.discard(index)

    def drop(self, index: int) -> None:
        """Engine ``index`` is gone for good (no restarts left): the later ones move down one."""
        with self._lock:
            del self.engines[index]
            self.failed = {i - (i > index) for i in self.failed if i != index}

    def counters(self) -> dict[str, int]:
        return {"redispatched": self.redispatched, "stragglers": self.stragglers}

    def dispatch(self, index: int, ask: Callable[[Any], Any]) -> Dispatch:
        engine = self.engines[index]
        return Dispatch(index, ask(engine), ask, handle=engine)

    def _orphaned(self, call: Dispatch) -> bool:
        """Whether ``call`` went to an engine that failed: still failed, or replaced since."""
        with self._lock:
            return call.engine in self.failed or (call.handle is not None
                                                   and call.handle is not self.engines[call.engine])

    def submit_shares(self, shares: list[Any], ask: Callable[[Any, Any], Any]) -> list[Dispatch]:
        """One call per non-empty share, share k on the k-th live engine (``shares`` as many as
        ``live()`` returned when they were cut)."""
        live = self.live()
        return [self.dispatch(e, lambda engine, s=share: ask(engine, s))
                for e, share in zip(live, shares, strict=True) if share]

    # -- waiting ------------------------------------------------------------------------------------

    def wait(self, calls: list[Dispatch], timeout_s: float, what: str = "generation") -> list[Any]:
        """The calls' answers in order, a failed engine's calls and stragglers asked again elsewhere
        (``calls`` is updated in place); raises ``TimeoutError`` after ``timeout_s`` and the
        engine's own error where the engine is sound (a refusal is not a fault)."""
        import ray

        answers: list[Any] = [None] * len(calls)
        done = [False] * len(calls)
        deadline = time.monotonic() + timeout_s
        while not all(done):
            RUN_ABORT.check()
            waiting = {}  # ref -> (call position, the Dispatch it belongs to)
            for k in range(len(calls)):
                if not done[k]:
                    # a failed engine's call that no engine could take yet waits for the replacement:
                    # its failed ref, ready at once, would only spin this loop
                    if not self._orphaned(calls[k]):
                        waiting[calls[k].ref] = (k, calls[k])
                    if (late := calls[k].straggler) is not None:
                        waiting[late.ref] = (k, late)
            ready = ray.wait(list(waiting), num_returns=1, timeout=_POLL_S)[0] if waiting else []
            if not waiting:
                time.sleep(_POLL_S)
            for ref in ready:
                k, call = waiting[ref]
                try:
                    answers[k], done[k] = ray.get(ref), True
                    continue
                except ray.exceptions.RayActorError:
                    pass
                except ray.exceptions.RayTaskError:
                    if not self._orphaned(call) and not self._faulty(call.engine):
                        raise
                if not self._orphaned(call):  # a replaced engine's call fails as it goes: no news
                    self.mark_failed(call.engine)
                if call is calls[k].straggler:  # the call that asks it again goes on
                    calls[k].straggler = None
            now = time.monotonic()
            for k in range(len(calls)):
                if done[k]:
                    continue
                # asked again once: a second timeout on a slow fleet would only pile up calls
                straggling = calls[k].straggler is None and now - calls[k].started > self.request_timeout_s
                if self._orphaned(calls[k]) or straggling:
                    self._ask_again(calls, k, straggling)
            if not all(done) and now >= deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
        return answers

    def wait_or_lose(self, refs: list, engines: list[int], timeout_s: float, what: str = "generation") -> list[Any]:
        """The answers of ``refs`` (the calls of an interruptible batch, made of ``engines``), ``LOST``
        for each call whose engine failed: the opportunistic schedule asks for those units again in
        its next round, of the engines that serve then."""
        import ray

        answers: list[Any] = [None] * len(refs)
        done = [False] * len(refs)
        deadline = time.monotonic() + timeout_s
        while not all(done):
            RUN_ABORT.check()
            waiting = {refs[k]: k for k in range(len(refs)) if not done[k]}
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                k = waiting[ref]
                try:
                    answers[k], done[k] = ray.get(ref), True
                except ray.exceptions.RayActorError:
                    self.mark_failed(engines[k])
                except ray.exceptions.RayTaskError:
                    if not self._faulty(engines[k]):
                        raise
                    self.mark_failed(engines[k])
            for k in range(len(refs)):
                if not done[k] and engines[k] in self.failed:
                    answers[k], done[k] = LOST, True
                    self.redispatched += 1
                    print(f"fleet: a generation call of rollout engine {engines[k]} is lost with its engine; "
                          f"its samples or episodes go on elsewhere", flush=True)
            if not all(done) and time.monotonic() >= deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
        return answers

    def _ask_again(self, calls: list[Dispatch], k: int, straggling: bool) -> None:
        """Call ``k`` to the live engine with the fewest calls of this batch (another than its own
        for a straggler; for a failed engine's call, its replacement too); none live: it waits for
        a replacement."""
        here = calls[k].engine
        others = [e for e in self.live() if e != here or not straggling]
        if not others:
            return
        load = {e: sum(c.engine == e for c in calls) for e in others}
        target = min(others, key=lambda e: (load[e], e))
        again = self.dispatch(target, calls[k].ask)
        # a straggler's answer is still welcome if it comes first; a failed engine's call is forgotten
        again.straggler = calls[k] if straggling else None
        calls[k] = again
        self.redispatched += 1
        self.stragglers += straggling
        why = f"no answer within {self.request_timeout_s:g} s" if straggling else "its engine failed"
        whom = f"its replacement, engine {target}" if target == here else f"engine {target}"
        print(f"fleet: a generation call of rollout engine {here} asked again of {whom} ({why})", flush=True)

    def _faulty(self, index: int) -> bool:
        """Whether engine ``index`` lost a vLLM process or cannot answer its liveness check."""
        import ray

        if index in self.failed:
            return True
        try:
            health = ray.get(self.engines[index].health.remote(), timeout=_HEALTH_TIMEOUT_S)
        except Exception:
            return True
        return bool(health.dead)
