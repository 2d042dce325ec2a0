"""The driver's side of a rollout fleet that survives engine faults (issue 42 item 1).

The watchdog (``megarl.workers.watchdog``) reports an engine that died or stopped answering to
``EngineRestarts.on_fault`` before it would end the run. The fault is taken on when the run can go
on (``decide``): the rollout service is told at once, and sends that engine's calls to the others
(``megarl.rollout_driver.fleet``). A thread stops the failed engine at once and starts a new one on
the same placement bundle with the same settings, so that it loads while the others finish the
step (on GPU an engine's start is a minute or more). At the next weight sync, with nothing
generating, the driver waits for it to be up, forms the weight-sync group anew with it, and the
sync gives it the actor's current weights; its
log-probs are checked against the actor's (``trainer.verify_sync`` runs on every engine whatever its
setting) before the service hands it any work. So a replaced engine never serves weights other than
the version every engine holds.

When no engine is left to finish the batch in flight (one engine, the usual colocated setup), the
failed engine is replaced at once instead (``replace_now``, on the driver's thread while it waits
for that batch or for a drain): its calls wait in the service and are asked of the replacement
once it holds the actor's weights and is checked. That needs ``trainer.max_staleness: 0``, where
the actor's weights are the engines' version whenever the driver waits on generation.

Colocated, the driver starts a replacement (at the sync, not early) where it fits the device's hand-over order
(``megarl.trainer.colocation``: every role off the device as it starts, then it sleeps like the
others and the actor comes back for the sync), whether at a weight sync or at once. On GPU this is
the same code path; only the CPU one is tested.

``rollout.max_engine_restarts`` bounds the restarts per run; past it a failed engine is dropped and
the run goes on with the others while ``rollout.min_engines`` allows. Otherwise, and where this
is not built (streamed groups: ``rollout.granularity=group`` hands each group to an engine outside
the fleet's re-dispatch; one engine with batches generated ahead), the run ends with the
watchdog's one line as before. Under the
opportunistic schedule a failed engine's calls are lost, not asked again at once: their samples
keep the tokens they had and go on elsewhere in the schedule's next round, and their episodes start
over from their reset (an episode is kept only whole: ``megarl.rollout_driver.partial_episodes``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megarl.config.schema import RunConfig
from megarl.utils.abort import wait_all
from megarl.utils.atomic import write_text_atomic

Decision = Literal["restart", "drop", "end"]
_BACKOFF_CAP_S = 30.0


def decide(restarts_used: int, max_restarts: int, live_after: int, min_engines: int,
           replace_now: bool = False) -> Decision:
    """What a run does with an engine's fault: ``live_after`` engines serve once it is out;
    ``replace_now``: with none left, the run can wait for a replacement started at once."""
    if live_after < 1 and not (replace_now and restarts_used < max_restarts):
        return "end"  # no engine left to finish the batch in flight
    if restarts_used < max_restarts:
        return "restart"
    return "drop" if live_after >= min_engines else "end"


def backoff_s(nth_restart: int) -> float:
    """How long after its fault the ``nth_restart``-th replacement (1-based) may start: 1, 2, 4 ... s."""
    return min(_BACKOFF_CAP_S, 2.0 ** (nth_restart - 1))


def unsupported(cfg: RunConfig) -> str | None:
    """Why this run cannot ride through an engine's fault (None: it can)."""
    if cfg.rollout.granularity != "batch":
        return ("rollout.granularity=group streams each group to an engine outside the fleet's re-dispatch, "
                "so engine faults are not survived")
    return None


@dataclass
class Fault:
    index: int
    reason: str
    at: float  # time.monotonic() when the watchdog saw it
    decision: Decision
    nth: int = 0  # which restart of the run (a restart's)
    # a restart started at once: the thread that stops the failed engine and starts the new one
    starting: threading.Thread | None = None
    replacement: Any = None  # its handle, once started
    start_error: str = ""  # why that thread could not start it


def engine_table(engines: list, timeout_s: float) -> list[dict]:
    """Which process is which engine (engines.json): for ``kill``, ``py-spy dump`` or a debugger."""
    healths = wait_all([e.health.remote() for e in engines], timeout_s, "the engines' liveness check")
    return [{"engine": i, "pid": h.pid, "processes": [{"pid": w.pid, "title": w.title} for w in h.watched]}
            for i, h in enumerate(healths)]


class EngineRestarts:
    def __init__(self, cfg: RunConfig, engines: list, rollout: Any, watchdog: Any,
                 start_engine: Callable[[int], Any], new_sync: Callable[[], Any], run_dir: Path):
        """``engines``: the run's list (replaced in place); ``rollout``: the service's client;
        ``start_engine(i)``: engine i as the run started it; ``new_sync()``: a weight sync set up with
        ``engines``."""
        self.cfg, self.engines, self.rollout, self.watchdog = cfg, engines, rollout, watchdog
        self.start_engine, self.new_sync, self.run_dir = start_engine, new_sync, run_dir
        self.restarts = 0
        self.dropped = 0
        self.failed: dict[int, Fault] = {}  # taken on, not yet replaced or dropped
        self.replaced: list[Fault] = []  # replaced at this weight sync: they serve once it is checked
        self.fault_seconds: list[float] = []  # per replaced fault: from the fault to serving again
        self._took = 0.0  # the longest of them since the last metrics
        self._why_not = unsupported(cfg)
        # with no engine left, a replacement starts at once (while the driver waits on generation)
        self.replaces_now = cfg.trainer.max_staleness == 0
        # Disaggregated, a replacement starts as soon as its fault is taken on; colocated it waits
        # for its place in the device's hand-over order.
        self.starts_early = cfg.rollout.colocate_with is None
        self._lock = threading.Lock()
        self._in_sync = False  # a weight sync runs (Run.sync_weights): a fault then ends the run

    # -- the watchdog's thread ----------------------------------------------------------------------

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """A weight sync into the engines runs for the block. A sync that failed leaves it set: the
        run names the engine's death as the cause (``Run._cause``) rather than taking it on, until
        ``sync_over`` (a trainer restart in place, whose sync is formed anew)."""
        self._in_sync = True
        yield
        self.sync_over()

    def sync_over(self) -> None:
        self._in_sync = False

    def on_fault(self, index: int, actor: Any, reason: str) -> bool:
        """Whether the run takes engine ``index``'s fault on (else the watchdog ends the run)."""
        r = self.cfg.rollout
        with self._lock:
            if index in self.failed:
                return True
            if self.engines[index] is not actor:
                return False
            if self._why_not is not None:
                print(f"fleet: {reason}; {self._why_not}: the run ends", flush=True)
                return False
            if self._in_sync:  # the actor's ranks wait in the sync's collective on the dead engine
                print(f"fleet: {reason} during the weight sync: the run ends", flush=True)
                return False
            live_after = len(self.engines) - len(self.failed) - 1
            decision = decide(self.restarts, r.max_engine_restarts, live_after, r.min_engines, self.replaces_now)
            if decision == "end":
                return False
            fault = Fault(index, reason, time.monotonic(), decision)
            if decision == "restart":
                self.restarts += 1
                fault.nth = self.restarts
            self.failed[index] = fault
        self.rollout.engine_failed(index)
        if decision == "restart" and self.starts_early:
            fault.starting = threading.Thread(target=self._start_early, args=(fault, actor), daemon=True,
                                              name=f"megarl-replace-engine-{index}")
            fault.starting.start()
        then = (f"its work waits for a replacement, started now (restart {fault.nth} of {r.max_engine_restarts})"
                if decision == "restart" and live_after < 1 else
                f"its work goes to the other engines and a replacement starts "
                f"{'now, to serve ' if self.starts_early else ''}at the next weight sync "
                f"(restart {fault.nth} of {r.max_engine_restarts})" if decision == "restart" else
                f"no restarts left (rollout.max_engine_restarts={r.max_engine_restarts}): the run goes on "
                f"with {live_after} engine{'s' if live_after > 1 else ''}")
        print(f"fleet: {reason}; {then}", flush=True)
        return True

    # -- the driver's thread, at a weight sync with nothing generating ------------------------------

    def stranded(self) -> bool:
        """Every engine failed: nothing finishes the batch in flight until a replacement does."""
        with self._lock:
            return bool(self.engines) and len(self.failed) >= len(self.engines)

    def replace_failed(self, sync: Any, joined: Callable[[list], None] | None = None) -> Any:
        """Replaces (or drops) the failed engines; returns the weight sync to use from now on: ``sync``
        when nothing failed, else one formed anew with the engines that serve next. ``joined(started)``:
        the replacements are up, before they take weights (colocated: they sleep like the others).
        The service gets them from ``serve``, once they are checked."""
        from megarl.rollout.remote import wait_ready

        with self._lock:
            faults, self.failed = sorted(self.failed.values(), key=lambda f: f.index), {}
        if not faults:
            return sync
        timeout_s = self.cfg.trainer.collective_timeout_s
        # the survivors leave the old group: the new one is formed with every engine that will hold weights
        sync.engines = [e for i, e in enumerate(self.engines) if i not in {f.index for f in faults}]
        sync.close()
        for fault in faults:
            if fault.starting is None:
                self._stop(self.engines[fault.index])
        restarts = [f for f in faults if f.decision == "restart"]
        started = []
        for fault in restarts:
            if fault.starting is None:
                self._start_replacement(fault, None)
            else:  # started when its fault was taken on: stopping the old one is at most 10 s
                fault.starting.join(timeout=timeout_s + _BACKOFF_CAP_S)
                if fault.replacement is None:
                    raise RuntimeError(f"rollout engine {fault.index}'s replacement did not start: "
                                       f"{fault.start_error or f'not within {timeout_s + _BACKOFF_CAP_S:.0f} s'}")
            self.engines[fault.index] = fault.replacement
            started.append(fault.replacement)
        drops = [f.index for f in faults if f.decision == "drop"]
        for index in reversed(drops):  # the service's list and this one lose the same entries
            del self.engines[index]  # the evaluator's and colocation's list too: it is theirs
            self.rollout.drop_engine(index)
            self.dropped += 1
        for fault in restarts:  # a dropped engine before it moves a replacement down one
            fault.index -= sum(index < fault.index for index in drops)
        wait_ready(started, timeout_s=self.cfg.trainer.step_timeout_s)
        fresh = self.new_sync()
        if joined is not None:
            joined(started)
        # every engine watched under its index now, the new ones with their processes in engines.json
        self.watchdog.forget_engines()
        for i, engine in enumerate(self.engines):
            self.watchdog.watch_engine(i, engine)
        write_text_atomic(self.run_dir / "engines.json", json.dumps(engine_table(self.engines, timeout_s), indent=2))
        self.replaced = restarts
        return fresh

    def serve(self, version: int, from_step: int) -> None:
        """The replacements hold weight ``version``, checked against the actor: the service gives
        them work from now on (at a sync, from its resume; at once, the failed engine's calls)."""
        for fault in self.replaced:
            self.rollout.replace_engine(fault.index, self.engines[fault.index])
            took = time.monotonic() - fault.at
            self.fault_seconds.append(took)
            self._took = max(self._took, took)
            print(f"fleet: rollout engine {fault.index} holds weight version {version}, checked against the actor, "
                  f"and serves again from step {from_step} ({took:.1f} s after its fault)", flush=True)
        self.replaced = []

    def metrics(self) -> dict[str, float]:
        """The fleet's metrics for a step; ``fleet/fault_s`` where an engine served again since the last."""
        metrics = {"fleet/engines_alive": float(len(self.engines) - len(self.failed)),
                   "fleet/engine_restarts": float(self.restarts), "fleet/engines_dropped": float(self.dropped)}
        if self._took:
            metrics["fleet/fault_s"], self._took = self._took, 0.0
        counters = self.rollout.fleet_counters()
        return metrics | {"fleet/redispatched": float(counters["redispatched"]),
                          "fleet/stragglers": float(counters["stragglers"])}

    def _start_replacement(self, fault: Fault, failed: Any) -> None:
        """Stops ``failed`` (the engine that faulted, when not stopped yet), then, after its backoff,
        starts the new engine on its bundle (Ray returns the handle at once; it loads meanwhile)."""
        if failed is not None:
            self._stop(failed)  # its placement bundle is free for the new one
        time.sleep(max(0.0, fault.at + backoff_s(fault.nth) - time.monotonic()))
        fault.replacement = self.start_engine(fault.index)

    def _start_early(self, fault: Fault, failed: Any) -> None:
        """``_start_replacement`` on its own thread: a failure is the sync's to report."""
        try:
            self._start_replacement(fault, failed)
        except Exception as error:  # noqa: BLE001 - reported at the sync, with the engine named
            fault.start_error = f"{type(error).__name__}: {error}"

    def _stop(self, engine: Any) -> None:
        """A failed engine's processes killed, then its actor (it may be blocked in a call)."""
        import ray

        with contextlib.suppress(Exception):
            ray.get(engine.kill_processes.remote(), timeout=5.0)
        with contextlib.suppress(Exception):
            ray.kill(engine)
