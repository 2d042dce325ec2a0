"""Turns between the endpoint's event loop and the engine's thread.

The endpoint's handlers run on an asyncio loop in a thread of their own (the engine actor's
environment loop); the engine is driven by the actor's main thread, a decoding step at a time.
``generate`` (on the loop) queues a turn and awaits its answer; ``pump`` (on the engine's thread)
hands queued turns and cancellations to the backend, runs one decoding step, and answers the
turns that finished. A handler cancelled while its turn generates (the client went away) aborts
the turn. Nothing else crosses between the two threads: sessions belong to the loop.
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

    # -- the loop's side ----------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], spec: TurnSpec, session: str = "") -> SampledTurn:
        if not self.driving:
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

    def start(self) -> None:
        """An engine call begins pumping (what an earlier call left queued is dropped)."""
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        self.driving = True

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
                backend.abort([command[1]])
                continue
            _, request_id, prompt_ids, spec = command
            try:
                backend.add(request_id, prompt_ids, spec)
            except Exception as exc:  # the engine refuses the request: the client hears why
                self._send(request_id, ApiError(400, f"the engine refused the request: {exc}"))
        if not backend.has_unfinished():
            return 0
        finished = backend.step()
        for request_id, turn in finished:
            turn.version = version
            self._send(request_id, turn)
        return len(finished)

    def stop_all(self, backend: RequestBackend, why: str) -> None:
        """Every queued and generating turn ends unanswered by the engine: the client hears ``why``."""
        self.driving = False
        refused = backend.abort(None)
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
