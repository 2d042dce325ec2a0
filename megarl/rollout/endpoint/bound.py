"""The rollout endpoint bound for callers outside the run (``rollout.endpoint.port``): debugging
and evaluation against the policy as it trains, with the stock ``openai`` client.

Where it lives: a small Ray actor of its own (``OutsideServer``, an async actor on the driver's
node, no CPU reserved), not in an engine actor. The engines' own endpoint is pumped only while an
engine call runs the run's agent episodes; an outside caller comes at any time, between those
calls too, and a run may have several engines. So this one serves the whole run and routes each
turn to an engine as an engine call (``endpoint_turns``): Ray runs an engine's calls one at a
time, so a turn never samples during a weight sync or a generation call of the run, and the
turns that wait for an engine go to it together (they batch). A session stays on one engine
(its prefix cache stays warm).

Weight syncs: the driver pauses the server before the sync (``pause``: new turns wait, the turns
at an engine finish) and resumes it after with the new version and engines (``resume``); a
waiting request is then served with the new weights, its answer naming them. An engine call
that still finds other weights than expected (a sync the server was not told of) is answered
503, retryable.

Outside sessions are recorded token-exactly (``GET /v1/sessions/{id}``) and never trained:
they are the caller's, not the run's episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megarl.rollout.endpoint.protocol import ApiError
from megarl.rollout.endpoint.sessions import SampledTurn, SessionLimits, SessionSampling, TurnSpec


@dataclass
class _Waiting:
    prompt_ids: list[int]
    spec: TurnSpec
    answer: asyncio.Future


class EngineRouter:
    """Turns to engines: one call at a time per engine, the turns queued meanwhile batched into
    the next; none while paused."""

    def __init__(self, engines: list, stop_token_ids: list[int], version: int, paused: bool = False):
        self.engines, self.stop_token_ids, self.version = list(engines), list(stop_token_ids), version
        self._open = asyncio.Event()
        if not paused:
            self._open.set()
        self._queues: dict[int, list[_Waiting]] = {}
        self._calls: dict[int, asyncio.Task] = {}
        self.served = 0  # turns answered by an engine
        self.engine_calls = 0

    async def generate(self, prompt_ids: list[int], spec: TurnSpec, session: str) -> SampledTurn:
        await self._open.wait()  # paused across a weight sync: the request waits, then resumes
        if not self.engines:
            raise ApiError(503, "the run has no engines now (its training is over)", code="megarl_not_generating",
                           kind="server_error")
        i = zlib.crc32(session.encode()) % len(self.engines)  # stable: the session's prefix cache stays warm
        waiting = _Waiting(list(prompt_ids), spec, asyncio.get_running_loop().create_future())
        self._queues.setdefault(i, []).append(waiting)
        self._kick(i)
        try:
            return await waiting.answer
        except asyncio.CancelledError:  # its client went away: a turn not yet sent to the engine never is
            if i in self._queues:
                self._queues[i] = [w for w in self._queues[i] if w is not waiting]
            raise

    def _kick(self, i: int) -> None:
        if i not in self._calls and self._queues.get(i) and self._open.is_set():
            self._calls[i] = asyncio.get_running_loop().create_task(self._serve(i))

    async def _serve(self, i: int) -> None:
        try:
            while self._queues.get(i) and self._open.is_set():
                batch, self._queues[i] = self._queues[i], []
                await self._call(i, batch)
        finally:
            del self._calls[i]

    async def _call(self, i: int, batch: list[_Waiting]) -> None:
        self.engine_calls += 1
        try:
            answers = await self.engines[i].endpoint_turns.remote([(w.prompt_ids, w.spec) for w in batch],
                                                                   self.stop_token_ids, self.version)
        except Exception as exc:  # the engine died, or holds other weights: the caller may retry
            why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            answers = [ApiError(503, f"rollout engine {i} could not serve the turn: {why}",
                                code="megarl_engine_unavailable", kind="server_error")] * len(batch)
        for waiting, answer in zip(batch, answers, strict=True):
            if waiting.answer.done():  # its client went away
                continue
            if isinstance(answer, SampledTurn):
                self.served += 1
                waiting.answer.set_result(answer)
            else:
                waiting.answer.set_exception(answer if isinstance(answer, ApiError) else ApiError(400, answer))

    async def pause(self) -> None:
        """New turns wait; returns once no engine call of the endpoint runs."""
        self._open.clear()
        await asyncio.gather(*self._calls.values(), return_exceptions=True)

    def resume(self, version: int, engines: list) -> None:
        self.version, self.engines = version, list(engines)
        self._open.set()
        for i in list(self._queues):
            if i >= len(self.engines):  # an engine dropped from the fleet: its queued turns go to engine 0
                self._queues.setdefault(0, []).extend(self._queues.pop(i))
        for i in list(self._queues):
            self._kick(i)


class OutsideServer:
    """The Ray actor (async): the endpoint on ``host:port``, routing to the run's engines."""

    def __init__(self, model_path: str, model_name: str, tool_parser: str, limits: SessionLimits,
                 sampling: SessionSampling, stop_token_ids: list[int]):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.args = (model_name, tool_parser, limits, sampling, stop_token_ids)
        self.router: EngineRouter | None = None
        self.endpoint = None

    async def start(self, host: str, port: int, token: str, engines: list, version: int, paused: bool) -> str:
        from megarl.rollout.endpoint.server import Endpoint

        model_name, tool_parser, limits, sampling, stop_token_ids = self.args
        self.router = EngineRouter(engines, stop_token_ids, version, paused)
        self.endpoint = Endpoint(self.tokenizer, self.router.generate, model_name, tool_parser, token=token,
                                 outside=(limits, sampling))
        return await self.endpoint.start(host, port)

    async def pause(self) -> None:
        await self.router.pause()

    async def resume(self, version: int, engines: list) -> None:
        self.router.resume(version, engines)

    async def counts(self) -> dict[str, int]:
        """Turns served and engine calls made (a batch of turns is one call)."""
        return {"turns": self.router.served, "engine_calls": self.router.engine_calls,
                "open_sessions": len(self.endpoint.book.open_sessions)}

    async def stop(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.stop()


class OutsideEndpoint:
    """The driver's handle on the bound endpoint; ``NoEndpoint`` where ``rollout.endpoint.port`` is unset."""

    def __init__(self, actor: Any, url: str, timeout_s: float):
        self.actor, self.url, self.timeout_s = actor, url, timeout_s

    def pause(self) -> None:
        import ray

        ray.get(self.actor.pause.remote(), timeout=self.timeout_s)

    def resume(self, version: int, engines: list) -> None:
        import ray

        ray.get(self.actor.resume.remote(version, list(engines)), timeout=self.timeout_s)

    @contextlib.contextmanager
    def paused(self, version: int, engines: list) -> Iterator[None]:
        """Paused for the block (a weight sync); resumed after it with ``version`` and ``engines``
        (not after a failure: the run ends)."""
        self.pause()
        yield
        self.resume(version, engines)

    def stop(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=30)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


class NoEndpoint:
    url = ""

    def pause(self) -> None:
        pass

    def resume(self, version: int, engines: list) -> None:
        pass

    @contextlib.contextmanager
    def paused(self, version: int, engines: list) -> Iterator[None]:
        yield

    def stop(self) -> None:
        pass


def start_outside_endpoint(cfg: Any, engines: list, model_path: str, version: int = 0,
                           paused: bool = False) -> OutsideEndpoint | NoEndpoint:
    """The endpoint on ``rollout.endpoint.host:port`` in front of ``engines`` (holding ``version``;
    ``paused`` until the first ``resume`` where they hold no policy weights yet), for the whole run."""
    import os

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    bound = cfg.rollout.endpoint
    if bound.port is None:
        return NoEndpoint()
    from transformers import AutoTokenizer

    r, env = cfg.rollout, cfg.env
    limits = SessionLimits(max_turns=env.max_turns if env is not None else SessionLimits.max_turns,
                           max_episode_tokens=env.max_episode_tokens if env is not None
                           else SessionLimits.max_episode_tokens,
                           max_turn_tokens=r.max_tokens, max_model_len=r.max_model_len,
                           wall_s=bound.session_wall_s)
    # not fixed: an outside caller evaluates (greedy, say) as it likes; nothing it samples trains
    sampling = SessionSampling(r.temperature, r.top_p, r.top_k, fixed=False)
    stop_ids = [AutoTokenizer.from_pretrained(model_path).eos_token_id]
    # on the driver's node: the host and port checked before start are this machine's
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(OutsideServer).options(num_cpus=0, scheduling_strategy=here, max_concurrency=1000).remote(
        model_path, os.path.basename(str(model_path).rstrip("/")), env.tool_parser if env is not None else "hermes",
        limits, sampling, stop_ids)
    # as long as an engine may take to start: a loaded machine starts a Ray worker and imports
    # transformers slowly; a pause waits for the endpoint's engine calls, queued behind the run's
    timeout_s = cfg.trainer.step_timeout_s
    try:
        url = ray.get(actor.start.remote(bound.host, bound.port, bound.token, list(engines), version, paused),
                      timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise RuntimeError(f"the rollout endpoint for outside callers did not start within {timeout_s:.0f} s "
                           "(trainer.step_timeout_s)") from None
    print(f"rollout endpoint for outside callers: {url}/v1 (POST {url}/v1/sessions opens a session)", flush=True)
    return OutsideEndpoint(actor, url, timeout_s)
