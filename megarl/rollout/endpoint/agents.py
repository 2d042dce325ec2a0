"""Agent episodes: an async agent function per episode, talking to the endpoint through an
``openai.AsyncOpenAI`` client bound to its own session; its return value is the episode's reward.

``AgentEpisodes.run`` is called on the engine's thread: it starts up to ``max_concurrent``
agents on the endpoint's event loop (each with a session opened for it, the client's
``X-Megarl-Session`` header preset), drives the engine through the ``EngineLink`` while they run,
and answers each episode's ``Trajectory`` (``Session.finish``) in request order. An agent that
raises, returns something other than a finite number, or runs past ``timeout_s`` fails its
episode (``env_error``, reward 0, the error kept); the others go on. With ``stop`` (an
interruption) the unfinished agents are cancelled, their turns aborted, and None answers them;
or, with ``suspend`` (``rollout.partial=continue``), they are kept: each agent waits on its
request, the turn it was generating held by the link and generated again, whole, by ``resume``
(the next call, under that call's weights). Each turn's tokens come from one weight version,
recorded with it.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from megarl.rollout.endpoint.link import EngineLink, RequestBackend
from megarl.rollout.endpoint.protocol import SESSION_HEADER
from megarl.rollout.endpoint.server import Endpoint
from megarl.rollout.endpoint.sessions import SessionLimits, SessionSampling
from megarl.rollout.episodes import EpisodeRequest, EventLoopThread, Trajectory


def bound_client(base_url: str, session: str, timeout_s: float, token: str = "") -> Any:
    """An ``openai.AsyncOpenAI`` client for ``session`` at the endpoint ``base_url`` (no retries:
    a refusal is final; no proxies from the environment: the endpoint is on loopback)."""
    import httpx
    import openai

    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=token or "megarl-local", max_retries=0,
                              timeout=timeout_s,
                              default_headers={SESSION_HEADER: session},
                              http_client=httpx.AsyncClient(trust_env=False, timeout=timeout_s))


@dataclass
class EndpointHost:
    """An endpoint serving on an event loop, and its link to the engine."""

    loop: EventLoopThread
    endpoint: Endpoint
    link: EngineLink

    @classmethod
    def start(cls, loop: EventLoopThread, tokenizer: Any, model_name: str, tool_parser: str = "hermes",
              host: str = "127.0.0.1", port: int = 0, token: str = "") -> EndpointHost:
        link = EngineLink(loop.loop)
        endpoint = Endpoint(tokenizer, link.generate, model_name, tool_parser, token=token)
        loop.submit(endpoint.start(host, port)).result(timeout=60)
        return cls(loop, endpoint, link)

    def close(self) -> None:
        self.loop.submit(self.endpoint.stop()).result(timeout=60)


class _Nothing:
    """A backend with nothing at the engine (dropping suspended agents: their turns are held)."""

    def abort(self, request_ids: list[str] | None = None) -> list[str]:
        return []


class AgentEpisodes:
    def __init__(self, host: EndpointHost, agent: Callable, options: dict[str, Any], limits: SessionLimits,
                 sampling: SessionSampling, max_concurrent: int, timeout_s: float):
        self.host, self.agent, self.options = host, agent, dict(options)
        self.limits, self.sampling, self.max_concurrent, self.timeout_s = limits, sampling, max_concurrent, timeout_s
        self.call = uuid.uuid4().hex[:8]
        self._requests: list[EpisodeRequest] = []
        self._answers: list[Trajectory | None] = []
        self._waiting: deque[int] = deque()
        self._running: dict = {}  # the agents' futures -> their request's index
        self._owed: list[int] = []  # the requests not answered yet

    @property
    def suspended(self) -> bool:
        """Whether agents wait for ``resume`` (a call stopped with ``suspend``)."""
        return bool(self._owed)

    def run(self, requests: list[EpisodeRequest], backend: RequestBackend, version: int,
            stop: Callable[[], bool] | None = None, suspend: bool = False) -> list[Trajectory | None]:
        """Every request's episode, in request order (None: stopped)."""
        self._requests, self._answers = list(requests), [None] * len(requests)
        self._waiting, self._running, self._owed = deque(range(len(requests))), {}, list(range(len(requests)))
        self.host.link.start()
        return self._drive(backend, version, stop, suspend)

    def resume(self, backend: RequestBackend, version: int, stop: Callable[[], bool] | None = None,
               suspend: bool = False) -> list[Trajectory | None]:
        """The suspended episodes go on under ``version``; answers them in request order (None:
        stopped again)."""
        assert self._owed, "resume: nothing is suspended"
        self.host.link.start(resume=True)
        return self._drive(backend, version, stop, suspend)

    def close(self) -> None:
        """Drops what is suspended: the agents are cancelled, their held turns refused."""
        for future in self._running:
            future.cancel()
        self._running, self._waiting, self._owed = {}, deque(), []
        self.host.link.stop_all(_Nothing(), "the episodes were dropped")

    def _drive(self, backend: RequestBackend, version: int, stop: Callable[[], bool] | None,
               suspend: bool) -> list[Trajectory | None]:
        host, answers, running, kept = self.host, self._answers, self._running, False
        try:
            while self._waiting or running:
                if stop is not None and stop():
                    if suspend:
                        host.link.suspend(backend)
                        kept = True
                    break
                while self._waiting and len(running) < self.max_concurrent:
                    i = self._waiting.popleft()
                    running[host.loop.submit(self._episode(i, self._requests[i]))] = i
                host.link.pump(backend, version)
                for future in [f for f in running if f.done()]:
                    answers[running.pop(future)] = future.result()
        finally:
            if not kept:
                for future, i in running.items():  # interrupted: dropped (their sessions close as they cancel)
                    if not future.cancel() and not future.cancelled():
                        answers[i] = future.result()  # it finished meanwhile
                running.clear()
                self._waiting.clear()
                host.link.stop_all(backend, "the episodes' engine call is over")
        owed = [answers[i] for i in self._owed]
        self._owed = [i for i in self._owed if answers[i] is None] if kept else []
        return owed

    async def _episode(self, index: int, request: EpisodeRequest) -> Trajectory:
        book = self.host.endpoint.book
        sid = f"{self.call}-{index}"
        session = book.open(sid, self.limits, replace(self.sampling, seed=request.seed))
        client = bound_client(self.host.endpoint.url, sid, self.timeout_s, self.host.endpoint.token)
        reward, error, deadline = None, "", None
        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                value = await self.agent(client, request.item, **self.options)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                error = f"the agent returned {value!r}, not a finite number (its reward)"
            else:
                reward = float(value)
        except asyncio.CancelledError:
            book.close(sid)
            raise
        except Exception as exc:
            timed_out = isinstance(exc, TimeoutError) and deadline is not None and deadline.expired()
            error = (f"the agent took longer than {self.timeout_s} s (env.agent_timeout_s)" if timed_out
                     else f"the agent failed: {type(exc).__name__}: {exc}")
        finally:
            await client.close()
        book.close(sid)
        return session.finish(reward, error)
