"""One process-wide abort signal for the driver: a watchdog trips it, every wait checks it.

The driver spends its time waiting on Ray calls (a Megatron group's collective, an engine's
generate, a weight sync). When a process one of those calls depends on dies, the call itself
may never return (a rank blocked in a collective whose peer is gone, vLLM waiting on a dead
engine core). A watchdog thread that notices the death trips this signal with one line naming
what died; every driver-side wait polls it at least once a second and raises ``Aborted``
with that line, so the run ends within seconds whatever it was waiting on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

_POLL_S = 1.0


class Aborted(RuntimeError):
    """The run was aborted by a watchdog; the message is its one-line reason."""


class AbortSignal:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None

    @property
    def reason(self) -> str | None:
        return self._reason

    def trip(self, reason: str) -> None:
        """Records the first reason only: later ones are consequences of it."""
        with self._lock:
            if self._reason is None:
                self._reason = reason

    def reset(self) -> None:
        with self._lock:
            self._reason = None

    def check(self) -> None:
        if self._reason is not None:
            raise Aborted(self._reason)


RUN_ABORT = AbortSignal()


def wait_all(refs: Sequence[Any], timeout_s: float | None = None, what: str = "call") -> list[Any]:
    """``ray.get(refs)`` that raises ``Aborted`` within a second of the run being aborted,
    and ``TimeoutError`` (naming ``what``) once ``timeout_s`` has passed."""
    import ray

    refs = list(refs)
    pending = refs
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        RUN_ABORT.check()
        wait_s = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        if ready:
            ray.get(ready)  # raises at once when one failed (a dead actor), not after the others finish
        if pending and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
    return ray.get(refs)
