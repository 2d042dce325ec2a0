"""Multi-turn episodes on one engine: many in flight, each a conversation with its environment.

``EpisodeRunner.run`` keeps up to ``max_concurrent`` episodes going. A policy turn is one
generation request; when it finishes, the episode's environment steps on an event loop in a
background thread while the engine keeps generating the other episodes' turns (continuous
batching across episodes); when the observation arrives, the episode's next turn is queued
with the context extended by the observation's tokens. ``overlap=False`` holds every
observation until no turn is generating and no environment is stepping (turn by turn, in
lockstep; the baseline that shows what overlap buys).

Token-exact by construction: a trajectory is the opening prompt, then each turn's ids exactly
as the engine produced them, then each observation's ids as rendered (``ChatRenderer``); the
next turn's prompt is that concatenation, never a re-tokenisation of decoded text. The mask
marks the engine's tokens (trained) and the observations' (context only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megarl.data.chat import ChatRenderer
from megarl.envs.base import Environment, EpisodeItem, StepResult
from megarl.rollout.sampling import RolloutSample


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # policy turns
    max_episode_tokens: int = 512  # response tokens (policy and observations) per episode
    max_turn_tokens: int = 128  # one turn
    max_model_len: int = 1024  # prompt + response
    max_concurrent: int = 64
    overlap: bool = True
    step_timeout_s: float = 60.0  # one environment reset or step


@dataclass
class EpisodeRequest:
    item: EpisodeItem
    seed: int | None = None  # the first turn's sampling seed (turn t uses seed + t)


@dataclass
class Trajectory:
    """One episode as the trainer sees it, and as it happened."""

    prompt_ids: list[int]  # the opening prompt
    response_ids: list[int]  # every turn and observation after it, in order
    response_mask: list[int]  # 1: a policy token (trained), 0: an observation token (context)
    logprobs: list[float]  # the engine's, one per response token (0.0 on observation tokens)
    # done (the environment ended it after a complete turn) | length (its last turn, or the episode,
    # ran out of tokens) | turns (max_turns reached) | env_error
    finish_reason: str
    reward: float  # the environment's rewards over the episode, summed
    turns: list[list[int]] = field(default_factory=list)  # each turn's ids, as generated
    observations: list[list[int]] = field(default_factory=list)  # each observation's ids, as inserted
    info: dict[str, float] = field(default_factory=dict)  # the environment's counters, summed
    error: str = ""  # what ended an env_error episode
    # The reward of each turn the environment answered, in order (``reward`` is their sum); a
    # turn whose step failed or timed out has none, so there may be one fewer than ``turns``.
    turn_rewards: list[float] = field(default_factory=list)
    routes: torch.Tensor | None = None  # R3: the experts of every token (``RolloutSample.routes``)

    def sample(self) -> RolloutSample:
        reason = "stop" if self.finish_reason == "done" else "length"
        return RolloutSample(list(self.prompt_ids), list(self.response_ids), list(self.logprobs), reason,
                             response_mask=list(self.response_mask), routes=self.routes)


@dataclass
class FinishedTurn:
    """A generation request the backend completed."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    stopped: bool  # ended with a stop token (else a length limit)


class TurnBackend(Protocol):
    """What the runner needs of an engine: queue a turn, advance, report finished turns."""

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int, seed: int | None) -> None: ...

    def step(self) -> list[FinishedTurn]: ...

    def has_unfinished(self) -> bool: ...

    def decode(self, ids: list[int]) -> str: ...

    def abort(self) -> list[FinishedTurn]: ...


class _Episode:
    def __init__(self, index: int, request: EpisodeRequest, env: Environment):
        self.index, self.request, self.env = index, request, env
        self.traj = Trajectory([], [], [], [], "", 0.0)
        self.turn_ended = True  # the last turn ended with the end-of-turn token (not a length limit)

    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids

    def add_info(self, info: dict[str, float]) -> None:
        for key, value in info.items():
            self.traj.info[key] = self.traj.info.get(key, 0.0) + float(value)


class EventLoopThread:
    """An asyncio loop in a daemon thread: environments' coroutines run there, concurrently,
    while the engine's thread generates."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="megarl-envs", daemon=True)
        self.thread.start()

    def submit(self, coro) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


class EpisodeRunner:
    def __init__(self, backend: TurnBackend, renderer: ChatRenderer, make_env: Callable[[], Environment],
                 limits: EpisodeLimits, loop: EventLoopThread):
        self.backend, self.renderer, self.make_env = backend, renderer, make_env
        self.limits, self.loop = limits, loop

    def run(self, requests: list[EpisodeRequest], stop: Callable[[], bool] | None = None
            ) -> list[Trajectory | None]:
        """Every request's episode, in request order. ``stop`` (checked before each decoding step):
        once it says so, the unfinished episodes are dropped (their turns aborted, their
        environments closed) and come back as None; the finished ones are kept."""
        waiting = deque(range(len(requests)))
        episodes: dict[int, _Episode] = {}
        generating: dict[str, _Episode] = {}
        stepping: dict[cf.Future, tuple[_Episode, str, float]] = {}  # future -> episode, what, deadline
        held: list[tuple[_Episode, list[int]]] = []  # observations waiting for the lockstep barrier
        done: dict[int, Trajectory] = {}

        def start_more() -> None:
            while waiting and len(episodes) < self.limits.max_concurrent:
                index = waiting.popleft()
                episode = episodes[index] = _Episode(index, requests[index], self.make_env())
                self._submit(stepping, episode, "reset", episode.env.reset(episode.request.item))

        def finish(episode: _Episode, reason: str) -> None:
            episode.traj.finish_reason = reason
            done[episode.index] = episode.traj
            del episodes[episode.index]
            self.loop.submit(episode.env.close())  # best effort: a failed close does not undo an episode

        def queue_turn(episode: _Episode) -> None:
            traj, lim = episode.traj, self.limits
            budget = min(lim.max_turn_tokens, lim.max_episode_tokens - len(traj.response_ids),
                         lim.max_model_len - len(episode.context()))
            if budget <= 0:
                finish(episode, "length")
                return
            seed = None if episode.request.seed is None else episode.request.seed + len(traj.turns)
            request_id = f"{episode.index}.{len(traj.turns)}"
            generating[request_id] = episode
            self.backend.add(request_id, episode.context(), budget, seed)

        start_more()
        while episodes or waiting:
            if stop is not None and stop():
                self._drop(episodes, stepping)
                return [done.get(i) for i in range(len(requests))]
            if self.backend.has_unfinished():
                for turn in self.backend.step():
                    self._turn_done(generating.pop(turn.request_id), turn, stepping, finish)
            elif stepping:
                cf.wait(list(stepping), timeout=0.5, return_when=cf.FIRST_COMPLETED)
            elif held:
                pass
            elif not waiting:
                raise RuntimeError(f"{len(episodes)} episodes are neither generating nor stepping")
            for future in [f for f in stepping if f.done() or time.monotonic() > stepping[f][2]]:
                episode, what, _ = stepping.pop(future)
                if not future.done():
                    future.cancel()
                    episode.traj.error = f"environment {what} took longer than {self.limits.step_timeout_s} s"
                    finish(episode, "env_error")
                    continue
                if (exc := future.exception()) is not None:
                    episode.traj.error = f"environment {what} failed: {type(exc).__name__}: {exc}"
                    finish(episode, "env_error")
                    continue
                if what == "reset":
                    episode.traj.prompt_ids = self.renderer.opening([m.to_chat() for m in future.result()])
                    queue_turn(episode)
                else:
                    self._observed(episode, future.result(), held, finish)
            if held and (self.limits.overlap or (not generating and not stepping)):
                for episode, ids in held:
                    self._append(episode, ids, 0, [0.0] * len(ids))
                    episode.traj.observations.append(ids)
                    queue_turn(episode)
                held.clear()
            start_more()
        return [done[i] for i in range(len(requests))]

    def _drop(self, episodes: dict[int, _Episode], stepping: dict) -> None:
        """An interruption: the unfinished episodes' turns and environment calls stop, and their
        environments close (best effort, as for a finished episode)."""
        self.backend.abort()
        for future in stepping:
            future.cancel()
        for episode in episodes.values():
            self.loop.submit(episode.env.close())

    # -- one turn's end, one observation's arrival ----------------------------------------------

    def _turn_done(self, episode: _Episode, turn: FinishedTurn, stepping: dict, finish: Callable) -> None:
        # A turn cut by its token limit still goes to the environment (as a single-turn response
        # cut by max_tokens is still scored); the observation then closes the turn first.
        episode.traj.turns.append(list(turn.token_ids))
        episode.turn_ended = turn.stopped
        self._append(episode, turn.token_ids, 1, turn.logprobs)
        action = self.backend.decode(turn.token_ids)
        self._submit(stepping, episode, "step", episode.env.step(action))

    def _observed(self, episode: _Episode, result: StepResult, held: list, finish: Callable) -> None:
        traj = episode.traj
        traj.reward += float(result.reward)
        traj.turn_rewards.append(float(result.reward))
        episode.add_info(result.info)
        if result.done:
            finish(episode, "done" if episode.turn_ended else "length")
            return
        if len(traj.turns) >= self.limits.max_turns:
            finish(episode, "turns")
            return
        ids = self.renderer.observation([m.to_chat() for m in result.observation], turn_ended=episode.turn_ended)
        if len(traj.response_ids) + len(ids) >= self.limits.max_episode_tokens:
            finish(episode, "length")
            return
        held.append((episode, ids))

    def _submit(self, stepping: dict, episode: _Episode, what: str, coro) -> None:
        stepping[self.loop.submit(coro)] = (episode, what, time.monotonic() + self.limits.step_timeout_s)

    @staticmethod
    def _append(episode: _Episode, ids: list[int], policy: int, logprobs: list[float]) -> None:
        traj = episode.traj
        traj.response_ids.extend(ids)
        traj.response_mask.extend([policy] * len(ids))
        traj.logprobs.extend(logprobs)


def episode_metrics(trajectories: list[Trajectory]) -> dict[str, Any]:
    """Per-step summaries of a batch of episodes (the ``tool/`` and ``env/`` metrics)."""
    n = max(len(trajectories), 1)
    called = [t for t in trajectories if t.info.get("tool_calls", 0) > 0]
    out = {
        "tool/call_fraction": len(called) / n,
        "tool/calls_mean": sum(t.info.get("tool_calls", 0.0) for t in trajectories) / n,
        "tool/error_fraction": (sum(t.info.get("tool_errors", 0.0) for t in trajectories)
                                / max(sum(t.info.get("tool_calls", 0.0) for t in trajectories), 1.0)),
        "tool/seconds": sum(t.info.get("tool_seconds", 0.0) for t in trajectories),
        "env/seconds": sum(t.info.get("env_seconds", 0.0) for t in trajectories),  # a remote service's answers
        "env/turns_mean": sum(len(t.turns) for t in trajectories) / n,
    }
    for reason in ("done", "length", "turns", "env_error"):
        out[f"env/finish_{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    return out
