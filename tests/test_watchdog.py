"""The pieces of the hang detector that need no Ray: process liveness, the abort signal, and the
watchdog's tolerance of a failed look (the whole path runs in test_trainer's death tests)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from megarl.utils import process_watch
from megarl.utils.abort import Aborted, AbortSignal
from megarl.workers.watchdog import Watchdog


def _sleeper(subprocesses) -> subprocess.Popen:
    return subprocesses.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_dead_child_is_seen_as_dead_before_and_after_it_is_reaped(subprocesses):
    child, other = _sleeper(subprocesses), _sleeper(subprocesses)
    try:
        watched = [p for p in process_watch.descendants() if p.pid in (child.pid, other.pid)]
        assert sorted(p.pid for p in watched) == sorted([child.pid, other.pid])
        assert process_watch.deaths(watched) == []
        child.kill()
        time.sleep(0.5)  # not reaped yet: a zombie counts as dead
        [death] = process_watch.deaths(watched)
        assert (death.pid, death.how) == (child.pid, "zombie")
        child.wait()
        [death] = process_watch.deaths(watched)
        assert (death.pid, death.how) == (child.pid, "exited")
        assert death.describe().endswith(f"(pid {child.pid}) died")
        assert process_watch.kill_all(watched) == 1  # only the one still running
        other.wait(timeout=10)
    finally:
        for p in (child, other):
            p.kill()
            p.wait()


def test_the_first_reason_wins_until_reset():
    signal = AbortSignal()
    signal.check()
    signal.trip("rollout engine 0: died")
    signal.trip("role 'actor' rank 0: a consequence")
    with pytest.raises(Aborted, match="^rollout engine 0: died$"):
        signal.check()
    signal.reset()
    signal.check()


class _Flaky(Watchdog):
    def __init__(self, looks: list[str | None | Exception], abort: AbortSignal):
        super().__init__(abort=abort, interval_s=0.01)
        self.looks = looks

    def check(self, answer_timeout_s: float | None = None) -> str | None:
        look = self.looks.pop(0) if self.looks else None
        if isinstance(look, Exception):
            raise look
        return look


@pytest.mark.parametrize(("looks", "tripped"), [
    ([RuntimeError("gcs busy"), RuntimeError("gcs busy"), None, RuntimeError("gcs busy")], None),
    ([RuntimeError("gone")] * 3, "the watchdog could not check the run's processes 3 times in a row: gone"),
    ([None, "rollout engine 1: vLLM's process VLLM::Worker (pid 7) died"],
     "rollout engine 1: vLLM's process VLLM::Worker (pid 7) died"),
])
def test_the_watchdog_trips_on_a_death_or_repeated_failed_looks_only(looks, tripped):
    abort = AbortSignal()
    watchdog = _Flaky(list(looks), abort).start()
    time.sleep(0.5)
    watchdog.stop()
    assert abort.reason == tripped
