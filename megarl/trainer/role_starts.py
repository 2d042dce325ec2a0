"""Megatron roles starting side by side, in the background, while the driver goes on.

At start-up the driver has its own work between starting the engines and training (the
tokenizer, the prompt and evaluation data, the rollout service): the roles' ranks import
megatron-core, bring up their process groups and load their weights meanwhile. At scale each
role's load reads its own checkpoint for minutes, so they start together too.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megarl.utils.abort import RUN_ABORT


class RoleStarts:
    """``start(name)`` for each of ``names``, one thread each, begun at construction.

    ``result()`` waits for them all; if one failed, the others still finish starting and are
    stopped, and the first failure is raised. ``cancel()`` (the driver failed meanwhile) waits for
    the starts to end and stops every role that came up. An interruption (Ctrl-C) while waiting
    trips the run abort, which ends the starts' own waits within a second."""

    def __init__(self, names: list[str], start: Callable[[str], Any]):
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(names)), thread_name_prefix="megarl-role-start")
        self._starts = {name: self._pool.submit(start, name) for name in names}
        self._ended = False

    def result(self) -> dict[str, Any]:
        done = False
        try:
            futures.wait(self._starts.values())
            done = True
        except BaseException:
            RUN_ABORT.trip("start-up interrupted")
            raise
        finally:
            failed = self._end(stop_all=not done)
        if failed:
            raise failed[0]
        return {name: start.result() for name, start in self._starts.items()}

    def cancel(self) -> None:
        """Stops every role that started (or is still starting: it is waited for)."""
        RUN_ABORT.trip("start-up failed")
        self._end(stop_all=True)

    def _end(self, stop_all: bool) -> list[BaseException]:
        """Waits for every start to end; stops the roles that came up if any failed (no one else
        knows them) or ``stop_all``. Returns the failures (none the second time)."""
        if self._ended:
            return []
        self._ended = True
        self._pool.shutdown(wait=True)
        failed = [start.exception() for start in self._starts.values() if start.exception() is not None]
        if failed or stop_all:
            for start in self._starts.values():
                if start.exception() is None:
                    start.result().shutdown(graceful=False)
        return failed
