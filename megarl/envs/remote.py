"""An environment served over HTTP: the episode's state lives in the service, keyed by an
episode id megarl chooses.

Protocol (JSON bodies, ``POST``; ``url`` is the service's base):

- ``{url}/reset`` ``{"episode_id", "prompt", "metadata", "system_prompt", "context"}`` ->
  ``{"messages": [{"role", "content", "name"?}, ...]}``: the episode's opening messages
  (system and user; the service describes its tools there, if any);
- ``{url}/step`` ``{"episode_id", "action"}`` -> ``{"messages": [...], "reward": number,
  "done": bool, "info"?: {name: number}}``: the policy's turn (decoded text) and the service's
  answer; ``info`` counters (``tool_calls``, ``tool_errors``, ...) are summed into the step's
  metrics like a local environment's;
- ``{url}/close`` ``{"episode_id"}``: the episode is over (best effort; its answer is ignored).

Transport, retries and the per-attempt deadline are ``megarl.utils.http_json``'s (5xx, 429,
connection failures and timeouts are retried; other 4xx are not). An answer that breaks the
protocol raises ``RemoteEnvironmentError`` naming the field; the episode runner ends that
episode as ``env_error`` and the run goes on. Calls are blocking HTTP, so they run in a thread
pool of ``max_concurrency`` threads shared by every episode of the engine: that many requests
are in flight at most, however many episodes wait.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from megarl.envs.base import ROLES, EpisodeItem, Message, StepResult
from megarl.utils.http_json import HttpJsonError, JsonPoster, RetryPolicy, url_problem


class RemoteEnvironmentError(HttpJsonError):
    """The environment service failed for good or answered outside the protocol."""


class RemoteEnvironmentService:
    """What every episode of one engine shares: the endpoint, its retry policy and the bounded
    pool of request threads."""

    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3, max_concurrency: int = 16,
                 backoff_s: float = 0.5, headers: dict[str, str] | None = None) -> None:
        problem = url_problem(url)
        if problem:
            raise ValueError(f"RemoteEnvironment: url {problem}, got {url!r}")
        policy = RetryPolicy(timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s)
        problems = policy.problems()
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            problems.append(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
        if problems:
            raise ValueError(f"RemoteEnvironment: {problems[0]}")
        self.poster = JsonPoster(url, policy, "remote environment", RemoteEnvironmentError, headers)
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="remote-env")

    async def call(self, suffix: str, payload: dict[str, Any], what: str) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.poster.post, payload, what, suffix)

    def episode(self) -> RemoteEnvironment:
        return RemoteEnvironment(self)


class RemoteEnvironment:
    def __init__(self, service: RemoteEnvironmentService) -> None:
        self.service = service
        self.episode_id = uuid.uuid4().hex
        self.started = False

    def tool_specs(self) -> list[dict[str, Any]]:
        return []  # the service's opening messages describe its tools

    async def reset(self, item: EpisodeItem) -> list[Message]:
        payload = {"episode_id": self.episode_id, "prompt": item.prompt, "metadata": item.metadata,
                   "system_prompt": item.system_prompt,
                   "context": [{k: v for k, v in asdict(m).items() if v is not None} for m in item.context]}
        answer = await self.service.call("/reset", payload, f"reset of episode {self.episode_id}")
        self.started = True
        messages = self._messages(answer, "reset")
        if not messages:
            raise RemoteEnvironmentError(f"{self._where('reset')}: 'messages' is empty (an episode opens with at "
                                         f"least the user's message)")
        return messages

    async def step(self, action: str) -> StepResult:
        if not self.started:
            raise RuntimeError("RemoteEnvironment.step before reset")
        started = time.perf_counter()
        answer = await self.service.call("/step", {"episode_id": self.episode_id, "action": action},
                                         f"step of episode {self.episode_id}")
        messages = self._messages(answer, "step")
        reward, done, info = answer.get("reward"), answer.get("done"), answer.get("info", {})
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise RemoteEnvironmentError(f"{self._where('step')}: 'reward' must be a finite number, got {reward!r}")
        if not isinstance(done, bool):
            raise RemoteEnvironmentError(f"{self._where('step')}: 'done' must be true or false, got {done!r}")
        if not isinstance(info, dict) or not all(
                isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for k, v in info.items()):
            raise RemoteEnvironmentError(f"{self._where('step')}: 'info' must map names to finite numbers")
        counters = {**{k: float(v) for k, v in info.items()}, "env_seconds": time.perf_counter() - started}
        return StepResult([] if done else messages, float(reward), done, counters)

    async def close(self) -> None:
        if self.started:
            try:
                await self.service.call("/close", {"episode_id": self.episode_id},
                                        f"close of episode {self.episode_id}")
            except HttpJsonError:
                pass  # best effort: the episode's trajectory is complete either way

    def _where(self, what: str) -> str:
        return f"remote environment {self.service.poster.endpoint('/' + what)} (episode {self.episode_id})"

    def _messages(self, answer: Any, what: str) -> list[Message]:
        if not isinstance(answer, dict) or not isinstance(answer.get("messages"), list):
            raise RemoteEnvironmentError(f"{self._where(what)}: the answer must be an object with a 'messages' list")
        out = []
        for i, m in enumerate(answer["messages"]):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str) or \
                    not isinstance(m.get("name", ""), str):
                raise RemoteEnvironmentError(f"{self._where(what)}: messages[{i}] must have a role "
                                             f"({', '.join(ROLES)}), content text and an optional name text")
            out.append(Message(m["role"], m["content"], m.get("name")))
        return out
