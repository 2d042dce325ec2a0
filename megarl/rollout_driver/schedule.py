"""``trainer.schedule``: what happens to the batches in flight when the engines' weights change.

The queue (``megarl.rollout_driver.batch_queue``) decides which batch is submitted when, and
fences what reaches the trainer; a schedule decides how a batch is generated and how the queue
is drained before a weight sync (or a checkpoint):

- ``exact``: each batch is generated whole by the version it was submitted against; ``drain``
  waits for every batch in flight, so a run is the same function of its seed whatever the timing.
- ``opportunistic``: the batches are interruptible; ``drain`` interrupts them (one decoding step
  later each unfinished sample stops with the tokens it has), ``resume`` has them go on under the
  new weights (``rollout.partial``), and a batch the trainer asks for finishes under the weights
  held then. Each interruption is an epoch: the calls after it are not cut by it.
"""

from __future__ import annotations

from typing import Any, Literal

from megarl.rollout_driver.batch import Rollout
from megarl.rollout_driver.inflight import InFlight

Queued = InFlight | Rollout  # a batch in the queue: in flight (or interrupted), or finished


class ExactSchedule:
    name: Literal["exact"] = "exact"

    def __init__(self, manager: Any):
        self.manager = manager

    def submit(self, index: int, version: int) -> Queued:
        return self.manager.submit(index, version=version)

    def finish(self, queued: Queued, version: int) -> Rollout:
        """The batch the trainer takes now, as generated (waited for if it is still in flight)."""
        return self.manager.finish(queued) if isinstance(queued, InFlight) else queued

    def drain(self, batches: dict[int, Queued]) -> None:
        """Waits for every batch in flight, which then waits in the queue finished."""
        for index, queued in batches.items():
            if isinstance(queued, InFlight):
                batches[index] = self.manager.finish(queued)

    def resume(self, batches: dict[int, Queued], version: int) -> None:
        """Nothing was interrupted: the next batches are submitted against ``version`` as the queue asks."""

    def in_flight(self, queued: Queued) -> bool:
        return isinstance(queued, InFlight)


class OpportunisticSchedule:
    name: Literal["opportunistic"] = "opportunistic"

    def __init__(self, manager: Any):
        self.manager = manager
        self.epoch = 0  # calls submitted since the last interruption

    def submit(self, index: int, version: int) -> Queued:
        return self.manager.submit(index, version=version, epoch=self.epoch)

    def finish(self, queued: Queued, version: int) -> Rollout:
        """Nothing interrupts the batch the trainer takes: what is left of it finishes under ``version``."""
        if not isinstance(queued, InFlight):
            return queued
        return self.manager.finish(queued, version, self.epoch)

    def drain(self, batches: dict[int, Queued]) -> None:
        """Interrupts the batches in flight and takes in what they got."""
        if any(self.in_flight(q) for q in batches.values()):
            self.manager.interrupt(self.epoch)
            self.epoch += 1  # later calls are not interrupted by this
        for queued in batches.values():
            if isinstance(queued, InFlight):
                self.manager.collect(queued)

    def resume(self, batches: dict[int, Queued], version: int) -> None:
        """After ``drain`` and a weight sync to ``version``: the interrupted batches' unfinished
        samples generate again."""
        for queued in batches.values():
            if isinstance(queued, InFlight) and not queued.finished and not queued.in_flight:
                self.manager.send(queued, version, self.epoch)

    def in_flight(self, queued: Queued) -> bool:
        return isinstance(queued, InFlight) and queued.in_flight


Schedule = ExactSchedule | OpportunisticSchedule
SCHEDULES: dict[str, type[ExactSchedule] | type[OpportunisticSchedule]] = {
    "exact": ExactSchedule, "opportunistic": OpportunisticSchedule}
