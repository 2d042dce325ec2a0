"""Roles starting side by side (megarl.trainer.role_starts): what comes up is returned, or stopped
when a start fails or the wait is interrupted. The roles here are plain objects; the real roles'
start is the RL runs' (tests/test_trainer.py), and its restarts in place."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megarl.trainer.role_starts import start_side_by_side
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


def test_the_roles_start_side_by_side():
    both_running = threading.Barrier(2, timeout=10)  # each start waits for the other: side by side
    made = {}

    def start(name: str) -> Role:
        both_running.wait()
        made[name] = Role(name)
        return made[name]

    started = start_side_by_side(["actor", "reference"], start)
    assert started == made and not any(r.stopped for r in started.values())


def test_a_failed_start_stops_the_others_and_is_raised():
    made = {}

    def start(name: str) -> Role:
        if name == "critic":
            time.sleep(0.2)  # the others are up when it fails
            raise RuntimeError("critic rank 0 died")
        made[name] = Role(name)
        return made[name]

    with pytest.raises(RuntimeError, match="critic rank 0 died"):
        start_side_by_side(["actor", "critic", "reference"], start)
    assert set(made) == {"actor", "reference"} and all(r.stopped for r in made.values())


def test_ctrl_c_ends_the_starts_still_waiting_and_stops_those_up():
    made = {}
    # Ctrl-C as in a terminal, whatever the process running the test did with SIGINT (a pytest-xdist
    # worker's handling of it once left this test waiting forever in the suite)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def start(name: str) -> Role:
        if name == "reference":  # a start that waits on its ranks, as WorkerGroup's does
            deadline = time.monotonic() + 20  # fail, never hang, if the interruption is lost
            while time.monotonic() < deadline:
                RUN_ABORT.check()
                time.sleep(0.01)
            raise TimeoutError("the Ctrl-C never tripped the run abort")
        made[name] = Role(name)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the caller waits
        return made[name]

    began = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            start_side_by_side(["actor", "reference"], start)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - began < 5
    assert made["actor"].stopped and RUN_ABORT.reason == "start-up interrupted"
    with pytest.raises(Aborted):
        RUN_ABORT.check()
