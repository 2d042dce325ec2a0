"""Roles starting in the background while the driver goes on (megarl.trainer.role_starts): what
comes up is returned, or stopped when a start or the driver fails. The roles here are plain
objects; the real roles' start is the RL runs' (tests/test_trainer.py), whose start-up this is."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.trainer.role_starts import RoleStarts
from megarl.utils.abort import RUN_ABORT, Aborted


class Role:
    def __init__(self, name: str):
        self.name, self.stopped = name, False

    def shutdown(self, graceful: bool = True) -> None:
        assert not self.stopped, f"{self.name} stopped twice"
        self.stopped = True


@pytest.fixture(autouse=True)
def _abort_reset():
    RUN_ABORT.reset()
    yield
    RUN_ABORT.reset()


def test_the_roles_start_side_by_side_while_the_caller_goes_on():
    both_running = threading.Barrier(2, timeout=10)  # each start waits for the other: side by side
    made = {}

    def start(name: str) -> Role:
        both_running.wait()
        made[name] = Role(name)
        return made[name]

    starts = RoleStarts(["actor", "reference"], start)
    started = starts.result()  # the constructor returned before the starts ended
    assert started == made and not any(r.stopped for r in started.values())
    starts.cancel()  # after result(): nothing left to stop


def test_a_failed_start_stops_the_others_and_is_raised_once():
    made = {}

    def start(name: str) -> Role:
        if name == "critic":
            time.sleep(0.2)  # the others are up when it fails
            raise RuntimeError("critic rank 0 died")
        made[name] = Role(name)
        return made[name]

    starts = RoleStarts(["actor", "critic", "reference"], start)
    with pytest.raises(RuntimeError, match="critic rank 0 died"):
        starts.result()
    assert set(made) == {"actor", "reference"} and all(r.stopped for r in made.values())
    starts.cancel()  # the caller's own error handling after the failure: a no-op


def test_cancel_ends_starts_still_waiting_and_stops_those_up():
    made = {}

    def start(name: str) -> Role:
        if name == "reference":  # a start that waits on its ranks, as WorkerGroup's does
            while True:
                RUN_ABORT.check()
                time.sleep(0.01)
        made[name] = Role(name)
        return made[name]

    starts = RoleStarts(["actor", "reference"], start)
    time.sleep(0.1)
    began = time.monotonic()
    starts.cancel()  # the driver failed reading its data
    assert time.monotonic() - began < 5
    assert made["actor"].stopped and RUN_ABORT.reason is not None
    with pytest.raises(Aborted):
        RUN_ABORT.check()
