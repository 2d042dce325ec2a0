"""Turns between the endpoint's event loop and the engine's thread.

The endpoint's handlers run on an asyncio loop in a thread of their own (the engine actor's
environment loop); the engine is driven by the actor's main thread, a decoding step at a time.
``generate`` (on the loop) queues a turn and awaits its answer; ``pump`` (on the engine's thread)
hands queued turns and cancellations to the backend, runs one decoding step, and answers the
turns that finished. A handler cancelled while its turn generates (the client went away) aborts
the turn. Nothing else crosses between the two threads: sessions belong to the loop.

Suspended (``rollout.partial=continue``: a weight sync interrupted the call, ``suspend``), the
link holds the turns it had handed to the engine and queues new ones; the next call
(``start(resume=True)``) hands them to the engine again, whole, under its weights.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
from typing import Any, Protocol

from megarl.rollout.endpoint.protocol import ApiError
from megarl.rollout.endpoint.sessions import SampledTurn, TurnSpec


class RequestBackend(Protocol):
    """What the link needs of an engine (``megarl.rollout.endpoint.vllm_requests``)."""

    def add(self, request_id: str, prompt_ids: list[int], spec: TurnSpec) -> None: ...

    def step(self) -> list[tuple[str, SampledTurn]]:
        """One decoding step; the turns it finished (their ``version`` is filled in by the link)."""
        ...

    def abort(self, request_ids: list[str] | None = None) -> list[str]:
        """Stops these requests (None: all); the ids it stopped."""
        ...

    def has_unfinished(self) -> bool: ...


class EngineLink:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[str, asyncio.Future] = {}  # on the loop only
        self._ids = itertools.count()
        self.driving = False  # an engine call pumps (set by the engine's thread)
        self.holding = False  # suspended: turns wait for the next call (set by the engine's thread)
        # the engine's thread only: each turn handed to the backend, under the id it has there
        # (a held turn goes back under a new one: the engine may still know the old)
        self._given: dict[str, tuple[str, list[int], TurnSpec]] = {}
        self._attempts = itertools.count()
        self._tried: set[str] = set()  # the turns given to the engine at least once

    # -- the loop's side ----------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], spec: TurnSpec, session: str = "") -> SampledTurn:
        if not (self.driving or self.holding):
            raise ApiError(503, "the engine is not running episodes now", code="megarl_not_generating",
                           kind="server_error")
        request_id = f"megarl-endpoint-{next(self._ids)}"
        future = self.loop.create_future()
        self._waiting[request_id] = future
        self._inbox.put(("add", request_id, list(prompt_ids), spec))
        try:
            return await future
        except asyncio.CancelledError:
            self._inbox.put(("abort", request_id))
            raise
        finally:
            self._waiting.pop(request_id, None)

    def _answer(self, request_id: str, answer: Any) -> None:
        future = self._waiting.get(request_id)
        if future is None or future.done():
            return
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)

    def _fail_waiting(self, why: str) -> None:
        for request_id in list(self._waiting):
            self._answer(request_id, ApiError(503, why, code="megarl_not_generating", kind="server_error"))

    # -- the engine's side ----------------------------------------------------------------------

    def start(self, resume: bool = False) -> None:
        """An engine call begins pumping: what an earlier call left queued is dropped, or with
        ``resume`` what a suspended call held goes to the engine first."""
        if not resume:
            while True:
                try:
                    self._inbox.get_nowait()
                except queue.Empty:
                    break
            self._given.clear()
            self._tried.clear()
        self.driving, self.holding = True, False

    def suspend(self, backend: RequestBackend) -> int:
        """The call is interrupted and its episodes kept: the turns at the engine are aborted and
        held (their callers wait), and new turns queue, until ``start(resume=True)``; how many
        turns were held."""
        held = list(self._given.values())
        backend.abort(None)
        self._given.clear()
        for request_id, prompt_ids, spec in held:
            self._inbox.put(("add", request_id, prompt_ids, spec))
        self.driving, self.holding = False, True
        return len(held)

    def _send(self, request_id: str, answer: Any) -> None:
        self.loop.call_soon_threadsafe(self._answer, request_id, answer)

    def pump(self, backend: RequestBackend, version: int, idle_wait_s: float = 0.01) -> int:
        """Queued turns and cancellations to ``backend``, then one decoding step (or, with nothing
        to generate, a wait of up to ``idle_wait_s`` for a turn); how many turns finished."""
        wait = not backend.has_unfinished()
        while True:
            try:
                command = self._inbox.get(timeout=idle_wait_s) if wait else self._inbox.get_nowait()
            except queue.Empty:
                break
            wait = False
            if command[0] == "abort":
                given = [k for k, (rid, _, _) in self._given.items() if rid == command[1]]
                backend.abort(given)
                for k in given:
                    del self._given[k]
                continue
            _, request_id, prompt_ids, spec = command
            # its own id the first time; a held turn given again gets a new one
            key = f"{request_id}.again-{next(self._attempts)}" if request_id in self._tried else request_id
            self._tried.add(request_id)
            try:
                backend.add(key, prompt_ids, spec)
                self._given[key] = (request_id, prompt_ids, spec)
            except Exception as exc:  # the engine refuses the request: the client hears why
                self._send(request_id, ApiError(400, f"the engine refused the request: {exc}"))
        if not backend.has_unfinished():
            return 0
        finished = backend.step()
        for key, turn in finished:
            turn.version = version
            given = self._given.pop(key, None)
            if given is not None:
                self._send(given[0], turn)
        return len(finished)

    def stop_all(self, backend: RequestBackend, why: str) -> None:
        """Every queued and generating turn ends unanswered by the engine: the client hears ``why``."""
        self.driving = self.holding = False
        refused = [self._given[k][0] for k in backend.abort(None) if k in self._given]
        self._given.clear()
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                refused.append(command[1])
        for request_id in refused:
            self._send(request_id, ApiError(503, why, code="megarl_not_generating", kind="server_error"))
        # a turn queued as this ran (its handler saw ``driving`` still set) is answered there too
        self.loop.call_soon_threadsafe(self._fail_waiting, why)
