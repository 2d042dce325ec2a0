"""Trainer faults restart in place (``trainer.max_restarts``, ``trainer.snapshot``).

When a Megatron rank's process dies (any role's: actor, critic, reference, ...), the step fails.
Instead of ending the run, ``Restarts.guard`` tears every Megatron role down, starts its ranks
again on the same placement, brings the trained roles back to a restore point and goes on from
there; the rollout engines and the rollout service survive and get the restored actor's weights
by the usual weight sync. The restore point is:

- ``snapshot: none``: the run's last checkpoint (``trainer.save_every``), or the run's start;
- ``snapshot: memory``: a copy of each trained role's ranks (weights, optimizer, RNG,
  ``megarl.workers.snapshot_fns``) taken after every step and kept in Ray's object store on each
  rank's node, owned by the driver (``WorkerGroup.run_kept``), so at most the step in progress is
  lost. A node that is lost takes its ranks' copies with it: that restart fails, naming it.

Either way the trainer's own state (step, prompt stream position, the rollout queue with the
batches it holds, the KL coefficient) comes back with it, as a checkpoint holds them, so under
the exact schedule the finished run equals one that never failed, each prompt trained once.

Colocated (``rollout.colocate_with``), the new ranks load with vLLM asleep, as after the step's
``to_training`` hand-over, and the weight sync that follows wakes it in the usual order. After a
step the roles are off the device, so the memory snapshot's copies are taken once the step's
updates are done (``after_update``), while the roles still hold the device, and become the restore
point with the rest of the step's state at its end; a step that fails in between drops them.

Only a death restarts: a rank that raises would raise again, and an engine's or the rollout
service's fault is not the trainer's. Past ``max_restarts`` the run ends as it does without
restarts, and re-running the command resumes from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.engine_faults import waiting_on_engines
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.roles import BaseOfActor
from megarl.trainer.run import Run, RunFailed
from megarl.utils.abort import RUN_ABORT, AbortSignal, wait_all
from megarl.utils.atomic import atomic_dir, write_text_atomic
from megarl.workers import snapshot_fns
from megarl.workers.group import WorkerGroupError
from megarl.workers.watchdog import Watchdog

TRAINER_STATE = "restart_point"  # the run directory's copy of the trainer's state at the restore point


@dataclass
class RestorePoint:
    step: int
    taken_at: float  # time.monotonic() when the run's state was this step's (for the seconds lost)
    checkpoint: Path | None = None  # the checkpoint to restore; None: the roles' copies and TRAINER_STATE
    copies: dict[str, list[Any]] = field(default_factory=dict)  # role -> its ranks' snapshots (ObjectRefs)

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"the checkpoint {self.checkpoint.name}"
        return "the in-memory snapshot" if self.copies else "the run's start"


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


class Restarts:
    def __init__(self, run: Run, log: MetricsLogger):
        self.run, self.log = run, log
        self.max_restarts, self.mode = run.cfg.trainer.max_restarts, run.cfg.trainer.snapshot
        self.count = 0
        self.report: dict[str, float] = {}  # the last restart's seconds, logged with the next step
        self.point = RestorePoint(run.step, time.monotonic())
        self._copied: dict[str, list[Any]] | None = None  # this step's copies, taken after its updates
        if self.max_restarts:
            latest = run.checkpoints.latest() if run.step else None
            self.point.checkpoint = latest if latest and self.mode == "none" else None
            if self.point.checkpoint is None:
                self._remember()  # the start: the roles' state as loaded, the prompt stream at its start

    # -- the loop's hooks --------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """One step: a Megatron rank that dies in it brings the run back to the restore point
        (``run.step`` with it) instead of ending it, while restarts are left."""
        try:
            yield
        except Exception as error:
            self._copied = None  # the failed step's copies are no restore point
            if not self.max_restarts:
                raise
            began = time.monotonic()
            cause = self._trainer_fault(error)
            if cause is None:
                raise
            if self.count >= self.max_restarts:
                raise RunFailed(f"{error} (after {self.count} restart(s) in place, trainer.max_restarts="
                                f"{self.max_restarts})") from error
            failed_step = self.run.step
            try:
                self._restart()
            except Exception as again:
                raise RunFailed(f"restarting the roles after a trainer fault at step {failed_step} ({cause}) "
                                f"failed: {self.run._cause(again)}") from again
            self._record(failed_step, cause, began)

    def after_update(self) -> None:
        """Colocated, ``snapshot: memory``: the trained roles' copies, taken while the roles are on
        the device (``after_step`` makes them the restore point)."""
        run = self.run
        if self.max_restarts and self.mode == "memory" and run.colocation.active and run.step < run.cfg.trainer.steps:
            self._copied = self._copies()

    def after_step(self) -> None:
        """The state at the end of ``run.step`` becomes the restore point: its checkpoint, if it
        saved one (``snapshot: none``), or a copy of it (``snapshot: memory``)."""
        if not self.max_restarts or self.run.step >= self.run.cfg.trainer.steps:
            return  # after the last step nothing is restarted: the final save follows
        if self.mode == "memory":
            self._remember()
            return
        latest = self.run.checkpoints.latest()
        if latest is not None and CheckpointManager.trainer_state(latest)["step"] == self.run.step:
            self.point = RestorePoint(self.run.step, time.monotonic(), latest)

    def metrics(self) -> dict[str, float]:
        """``trainer/restarts`` so far (runs with restarts on), and once after each restart its seconds."""
        if not self.max_restarts:
            return {}
        report, self.report = self.report, {}
        return {"trainer/restarts": float(self.count)} | report

    # -- the restore point --------------------------------------------------------------------

    def _remember(self) -> None:
        """A copy of the trained roles' ranks in Ray's object store (memory mode), and the trainer's
        state beside the checkpoints, written as a checkpoint writes it (the queue's untrained
        batches, a few KiB of tokens, included)."""
        run = self.run
        copies, self._copied = self._copied, None
        if self.mode == "memory" and copies is None:
            with run.colocation.roles_on_device():  # colocated, at the start they may be off the device
                copies = self._copies()
        waiting_on_engines(run, run.rollout.drain)  # nothing generating into the queue while it is copied
        state = run.rollout.state_dict() | {"kl_control": run.kl_control.state_dict()}
        with atomic_dir(run.run_dir / TRAINER_STATE, overwrite=True) as folder:
            run.rollout.save(folder)
            (folder / "trainer_state.json").write_text(json.dumps({"step": run.step, **state}, indent=2))
        run.rollout.resume(run.step)
        self.point = RestorePoint(run.step, time.monotonic(), None, copies or {})

    def _copies(self) -> dict[str, list[Any]]:
        # each rank's copy stays on its node, owned by the driver: it outlives the rank
        return {name: role.group.run_kept(snapshot_fns.take, key=name, timeout_s=role.timeout_s)
                for name, role in self.run.trained_roles().items()}

    # -- the fault ----------------------------------------------------------------------------

    def _trainer_fault(self, error: BaseException) -> str | None:
        """The line naming the Megatron rank whose process died, when that is what failed the
        step, and the engines and the rollout service are well; else None (not the trainer's)."""
        run = self.run
        died = [e for e in _chain(error) if isinstance(e, WorkerGroupError) and e.died]
        found = str(died[0]).splitlines()[0].rstrip(":") if died else None
        if found is None:  # the watchdog saw it first: a rank of a group that is still up is dead
            ranks = Watchdog(abort=AbortSignal())
            for role in run.roles.values():
                ranks.watch_group(role.group)
            found = ranks.check()
        if found is None:
            return None
        others = Watchdog(abort=AbortSignal())
        for index, engine in enumerate(run.engines):
            others.watch_engine(index, engine)
        others.watch_actor("the rollout service", run.rollout.actor)
        return found if others.check(answer_timeout_s=run.cfg.trainer.collective_timeout_s) is None else None

    def _restart(self) -> None:
        """Every Megatron role's ranks again, on the same bundles; the trained ones at the restore point."""
        run, tr, point = self.run, self.run.cfg.trainer, self.point
        run.watchdog.stop()
        RUN_ABORT.reset()  # the death it tripped on is handled here
        own = {name: role for name, role in run.roles.items() if not isinstance(role, BaseOfActor)}
        for role in own.values():
            role.shutdown(graceful=False)
        # the engines leave the old sync group (an engine still receiving from a dead rank first
        # fails its receive, within the sync's timeout)
        timeout_s = tr.collective_timeout_s * 4
        wait_all([e.leave_sync_group.remote() for e in run.engines], timeout_s + tr.collective_timeout_s,
                 "the engines leaving the weight sync")
        run.rollout.drain()  # generation the step had started finishes (or stops) before the queue rewinds
        run.colocation.engines_sleep()  # colocated, the new ranks load as after to_training
        for name, restarted in run.start_roles(list(own)).items():
            own[name].group = restarted.group  # the loop holds these role objects: they take the new ranks
        for role in run.roles.values():
            if isinstance(role, BaseOfActor):
                role.group = role.actor.group
        run.sync = run._new_sync()  # the new actor ranks and the same engines
        if point.checkpoint is not None:
            run.restore(point.checkpoint)
        else:
            for name, copies in point.copies.items():
                role = run.roles[name]
                calls = [role.group.submit_on([rank], snapshot_fns.restore, key=name, snapshot=copy,
                                              optim=role.cfg.optim) for rank, copy in enumerate(copies)]
                for call in calls:
                    call.result(role.timeout_s)
            run.restore(run.run_dir / TRAINER_STATE, roles=False)
        self.log.rewind(run.step)
        service_pid = run.rollout.pid()
        pids = {name: role.group.pids for name, role in run.roles.items()} | {"rollout_service": [service_pid]}
        write_text_atomic(run.run_dir / "workers.json", json.dumps(pids, indent=2))
        run._start_watchdog(service_pid)

    def _record(self, failed_step: int, cause: str, began: float) -> None:
        """One line on the console and in ``restarts.jsonl``; the seconds go out with the next step's metrics."""
        self.count += 1
        now = time.monotonic()
        restart_s, lost_s = now - began, now - self.point.taken_at
        self.report = {"trainer/restart_s": restart_s, "trainer/lost_s": lost_s}
        record = {"restart": self.count, "failed_step": failed_step, "restored_step": self.run.step,
                  "from": self.point.describe(), "cause": cause, "restart_s": restart_s, "lost_s": lost_s,
                  "training_again_at": time.time()}
        with open(self.run.run_dir / "restarts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"trainer fault at step {failed_step} ({cause}): restart {self.count} of {self.max_restarts}, "
              f"back at step {self.run.step} from {self.point.describe()} in {restart_s:.1f} s "
              f"({lost_s:.1f} s of training lost)", flush=True)
