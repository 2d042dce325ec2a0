"""Agent episodes: an async agent function per episode, talking to the endpoint through an
``openai.AsyncOpenAI`` client bound to its own session; its return value is the episode's reward.

``AgentEpisodes.run`` is called on the engine's thread: it starts up to ``max_concurrent``
agents on the endpoint's event loop (each with a session opened for it, the client's
``X-Megarl-Session`` header preset), drives the engine through the ``EngineLink`` while they run,
and answers each episode's ``Trajectory`` (``Session.finish``) in request order. An agent that
raises, returns something other than a finite number, or runs past ``timeout_s`` fails its
episode (``env_error``, reward 0, the error kept); the others go on. With ``stop`` (an
interruption) the unfinished agents are cancelled, their turns aborted, and None answers them.
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


class AgentEpisodes:
    def __init__(self, host: EndpointHost, agent: Callable, options: dict[str, Any], limits: SessionLimits,
                 sampling: SessionSampling, max_concurrent: int, timeout_s: float):
        self.host, self.agent, self.options = host, agent, dict(options)
        self.limits, self.sampling, self.max_concurrent, self.timeout_s = limits, sampling, max_concurrent, timeout_s
        self.call = uuid.uuid4().hex[:8]

    def run(self, requests: list[EpisodeRequest], backend: RequestBackend, version: int,
            stop: Callable[[], bool] | None = None) -> list[Trajectory | None]:
        host = self.host
        answers: list[Trajectory | None] = [None] * len(requests)
        waiting, running = deque(range(len(requests))), {}
        host.link.start()
        try:
            while waiting or running:
                if stop is not None and stop():
                    break
                while waiting and len(running) < self.max_concurrent:
                    i = waiting.popleft()
                    running[host.loop.submit(self._episode(i, requests[i]))] = i
                host.link.pump(backend, version)
                for future in [f for f in running if f.done()]:
                    answers[running.pop(future)] = future.result()
        finally:
            for future, i in running.items():  # interrupted: dropped (their sessions close as they cancel)
                if not future.cancel() and not future.cancelled():
                    answers[i] = future.result()  # it finished meanwhile
            host.link.stop_all(backend, "the episodes' engine call is over")
        return answers

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
