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

Interruptible (the opportunistic schedule): ``run``'s ``stop`` ends a call at the next decoding
step. The unfinished episodes are then dropped (``rollout.partial: regenerate``: they start over)
or suspended (``continue``): each cut turn keeps its tokens, every environment its state and its
call in flight, and ``resume`` on the engine's next call (after a weight sync) goes on from there;
``Trajectory.versions`` records which weights generated each token.
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
from megarl.rollout.sampling import SEGMENT_SEED_STRIDE, RolloutSample


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # policy turns
    max_episode_tokens: int = 512  # response tokens (policy and observations) per episode
    max_turn_tokens: int = 128  # one turn
    max_model_len: int = 1024  # prompt + response
    max_concurrent: int = 64
    overlap: bool = True
    step_timeout_s: float = 60.0  # one environment reset or step
    session_wall_s: float | None = None  # an agent's session at the endpoint (rollout.endpoint.session_wall_s)


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
    # The weight version each response token was generated under (an observation's: the version
    # in force when it was inserted); one version unless a turn continued across a weight sync.
    versions: list[int] = field(default_factory=list)
    # An agent's episode through the rollout endpoint (megarl.rollout.endpoint): the trajectories
    # its splits closed (where a turn's prompt did not extend the tokens before it), in order;
    # this one is the last. Each trains as a row of its own, sharing the episode's reward and
    # advantage (``parts``; megarl.rollout_driver.batch.episode_rows).
    segments: list[Trajectory] = field(default_factory=list)

    def parts(self) -> list[Trajectory]:
        """What trains of the episode, a row each, in order: the parts its splits closed, then this one."""
        return [*self.segments, self]

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
        # A turn an interruption cut (``suspend``): its tokens so far (already in the trajectory),
        # and how many calls it has had; the next call continues it from there.
        self.open_turn: list[int] = []
        self.turn_segments = 0

    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids

    def add_info(self, info: dict[str, float]) -> None:
        for key, value in info.items():
            self.traj.info[key] = self.traj.info.get(key, 0.0) + float(value)


def turn_request_id(episode: int, turn: int, segment: int = 0) -> str:
    """The generation request of an episode's turn (of its ``segment``-th piece, when interruptions
    cut it) as the runner names it to the backend."""
    return f"{episode}.{turn}.{segment}"


@dataclass
class _Progress:
    """Every episode of one batch of requests, as far as it got (across ``run`` and ``resume``)."""

    requests: list[EpisodeRequest] = field(default_factory=list)
    waiting: deque = field(default_factory=deque)  # request indices not started
    episodes: dict[int, _Episode] = field(default_factory=dict)  # started, unfinished
    generating: dict[str, _Episode] = field(default_factory=dict)  # request id -> its episode
    stepping: dict[cf.Future, tuple[_Episode, str, float]] = field(default_factory=dict)  # -> episode, what, deadline
    held: list[tuple[_Episode, list[int]]] = field(default_factory=list)  # observations at the lockstep barrier
    paused: list[_Episode] = field(default_factory=list)  # turns cut by ``suspend``, to continue
    done: dict[int, Trajectory] = field(default_factory=dict)  # finished, not yet answered
    owed: list[int] = field(default_factory=list)  # the requests not yet answered, in order
    suspended_at: float = 0.0


class EventLoopThread:
    """An asyncio loop in a daemon thread: environments' coroutines run there, concurrently,
    while the engine's thread generates."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="megarl-envs", daemon=True)
        self.thread.start()

    def submit(self, coro) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


def suspended_name(stream: int) -> str:
    """The name under which the episodes an interruption suspended in group-streaming call
    ``stream`` wait on its engine (``VLLMEngine.continue_episodes``)."""
    return f"stream.{stream}"


class EpisodeRunner:
    """Runs one batch of episode requests on a backend. ``version`` is recorded with every
    response token (the weight version the engine holds; see ``Trajectory.versions``)."""

    def __init__(self, backend: TurnBackend, renderer: ChatRenderer, make_env: Callable[[], Environment],
                 limits: EpisodeLimits, loop: EventLoopThread, version: int = 0):
        self.backend, self.renderer, self.make_env = backend, renderer, make_env
        self.limits, self.loop, self.version = limits, loop, version
        self._p: _Progress | None = None

    def run(self, requests: list[EpisodeRequest], stop: Callable[[], bool] | None = None,
            suspend: bool = False) -> list[Trajectory | None]:
        """Every request's episode, in request order. ``stop`` (checked before each decoding step):
        once it says so, the unfinished episodes come back as None and are either dropped (their
        turns aborted, their environments closed) or, with ``suspend``, kept for ``resume``: each
        cut turn keeps the tokens it has, environments keep their state and calls in flight."""
        self._p = None
        self.add(requests)
        return self._drive(stop, suspend)

    @property
    def suspended(self) -> bool:
        """Whether episodes wait for ``resume`` (``run`` or ``resume`` stopped with ``suspend``)."""
        return self._p is not None and bool(self._p.owed)

    def resume(self, backend: TurnBackend, version: int, stop: Callable[[], bool] | None = None,
               suspend: bool = False) -> list[Trajectory | None]:
        """Continues the suspended episodes on ``backend`` (the engine's next call) with weights
        ``version``: each cut turn goes on from its tokens, seeded anew. Answers the episodes that
        were unfinished, in request order (None: stopped again)."""
        p = self._p
        assert p is not None and p.owed, "resume: nothing is suspended"
        self.backend, self.version = backend, version
        idle = time.monotonic() - p.suspended_at
        p.stepping = {f: (episode, what, deadline + idle) for f, (episode, what, deadline) in p.stepping.items()}
        paused, p.paused = p.paused, []
        for episode in paused:
            self._queue_turn(episode)
        return self._drive(stop, suspend)

    def close(self) -> None:
        """Drops what is suspended: environment calls cancelled, environments closed (best effort)."""
        if self._p is not None:
            for future in self._p.stepping:
                future.cancel()
            for episode in self._p.episodes.values():
                self.loop.submit(episode.env.close())
            self._p = None

    # -- driven from outside, a round at a time (``rollout.granularity: group``) ------------------

    def add(self, requests: list[EpisodeRequest]) -> list[int]:
        """More episodes to run (their indices), joining those in flight at the next round."""
        if self._p is None:
            self._p = _Progress()
        p = self._p
        indices = list(range(len(p.requests), len(p.requests) + len(requests)))
        p.requests += requests
        p.waiting.extend(indices)
        p.owed += indices
        return indices

    @property
    def busy(self) -> bool:
        """Whether an episode is unfinished (running, or waiting for a slot)."""
        return self._p is not None and bool(self._p.episodes or self._p.waiting)

    def take(self, indices: list[int]) -> list[Trajectory] | None:
        """These episodes, once every one of them has finished (then forgotten); else None."""
        if not all(i in self._p.done for i in indices):
            return None
        return self.take_finished(indices)

    def take_finished(self, indices: list[int]) -> list[Trajectory | None]:
        """These episodes as they stand: the finished ones (then forgotten), None for the others."""
        p = self._p
        taken = [p.done.pop(i, None) for i in indices]
        gone = {i for i, t in zip(indices, taken, strict=True) if t is not None}
        p.owed = [i for i in p.owed if i not in gone]
        return taken

    def interrupt(self, suspend: bool) -> None:
        """Stops the unfinished episodes where they are: dropped, or with ``suspend`` kept for
        ``resume`` (which answers them in the order they were added)."""
        if suspend:
            self._suspend()
        else:
            self._drop()

    def advance(self) -> None:
        """One round: a decoding step (or a short wait on the environments), then what the
        environments answered, then new episodes into the free slots."""
        p = self._p
        self._start_more()
        if self.backend.has_unfinished():
            for turn in self.backend.step():
                self._turn_done(p.generating.pop(turn.request_id), turn)
        elif p.stepping:
            cf.wait(list(p.stepping), timeout=0.5, return_when=cf.FIRST_COMPLETED)
        elif p.held:
            pass
        elif not p.waiting:
            raise RuntimeError(f"{len(p.episodes)} episodes are neither generating nor stepping")
        for future in [f for f in p.stepping if f.done() or time.monotonic() > p.stepping[f][2]]:
            episode, what, _ = p.stepping.pop(future)
            if not future.done():
                future.cancel()
                episode.traj.error = f"environment {what} took longer than {self.limits.step_timeout_s} s"
                self._finish(episode, "env_error")
                continue
            if (exc := future.exception()) is not None:
                episode.traj.error = f"environment {what} failed: {type(exc).__name__}: {exc}"
                self._finish(episode, "env_error")
                continue
            if what == "reset":
                episode.traj.prompt_ids = self.renderer.opening([m.to_chat() for m in future.result()])
                self._queue_turn(episode)
            else:
                self._observed(episode, future.result())
        if p.held and (self.limits.overlap or (not p.generating and not p.stepping)):
            for episode, ids in p.held:
                self._append(episode, ids, 0, [0.0] * len(ids))
                episode.traj.observations.append(ids)
                self._queue_turn(episode)
            p.held.clear()
        self._start_more()

    def _drive(self, stop: Callable[[], bool] | None, suspend: bool) -> list[Trajectory | None]:
        p = self._p
        while self.busy:
            if stop is not None and stop():
                if suspend:
                    self._suspend()
                else:
                    self._drop()
                break
            self.advance()
        answers = [p.done.pop(i, None) for i in p.owed]
        p.owed = [i for i, t in zip(p.owed, answers, strict=True) if t is None]
        if not suspend:
            p.owed = []
        return answers

    def _start_more(self) -> None:
        p = self._p
        while p.waiting and len(p.episodes) < self.limits.max_concurrent:
            index = p.waiting.popleft()
            episode = p.episodes[index] = _Episode(index, p.requests[index], self.make_env())
            self._submit(episode, "reset", episode.env.reset(episode.request.item))

    def _finish(self, episode: _Episode, reason: str) -> None:
        episode.traj.finish_reason = reason
        self._p.done[episode.index] = episode.traj
        del self._p.episodes[episode.index]
        self.loop.submit(episode.env.close())  # best effort: a failed close does not undo an episode

    def _queue_turn(self, episode: _Episode) -> None:
        """The episode's next policy turn (or the rest of a cut one) goes to the backend."""
        traj, lim = episode.traj, self.limits
        budget = min(lim.max_turn_tokens - len(episode.open_turn), lim.max_episode_tokens - len(traj.response_ids),
                     lim.max_model_len - len(episode.context()))
        if budget <= 0:
            if episode.open_turn:  # a cut turn that used up its tokens: it ends as a turn cut by its limit
                self._turn_done(episode, FinishedTurn("", [], [], False))
            else:
                self._finish(episode, "length")
            return
        seed = None
        if episode.request.seed is not None:
            seed = episode.request.seed + len(traj.turns) + SEGMENT_SEED_STRIDE * episode.turn_segments
        request_id = turn_request_id(episode.index, len(traj.turns), episode.turn_segments)
        self._p.generating[request_id] = episode
        self.backend.add(request_id, episode.context(), budget, seed)

    def _drop(self) -> None:
        """An interruption: the unfinished episodes' turns and environment calls stop, and their
        environments close (best effort, as for a finished episode)."""
        self.backend.abort()
        self.close()

    def _suspend(self) -> None:
        """An interruption that keeps the episodes: each cut turn keeps what it generated."""
        p = self._p
        for turn in self.backend.abort():
            episode = p.generating.pop(turn.request_id)
            self._append(episode, turn.token_ids, 1, turn.logprobs)
            episode.open_turn += turn.token_ids
            episode.turn_segments += 1
            p.paused.append(episode)
        p.suspended_at = time.monotonic()

    # -- one turn's end, one observation's arrival ----------------------------------------------

    def _turn_done(self, episode: _Episode, turn: FinishedTurn) -> None:
        # A turn cut by its token limit still goes to the environment (as a single-turn response
        # cut by max_tokens is still scored); the observation then closes the turn first.
        whole = episode.open_turn + list(turn.token_ids)
        episode.open_turn, episode.turn_segments = [], 0
        episode.traj.turns.append(whole)
        episode.turn_ended = turn.stopped
        self._append(episode, turn.token_ids, 1, turn.logprobs)
        self._submit(episode, "step", episode.env.step(self.backend.decode(whole)))

    def _observed(self, episode: _Episode, result: StepResult) -> None:
        traj = episode.traj
        traj.reward += float(result.reward)
        traj.turn_rewards.append(float(result.reward))
        episode.add_info(result.info)
        if result.done:
            self._finish(episode, "done" if episode.turn_ended else "length")
            return
        if len(traj.turns) >= self.limits.max_turns:
            self._finish(episode, "turns")
            return
        ids = self.renderer.observation([m.to_chat() for m in result.observation], turn_ended=episode.turn_ended)
        if len(traj.response_ids) + len(ids) >= self.limits.max_episode_tokens:
            self._finish(episode, "length")
            return
        self._p.held.append((episode, ids))

    def _submit(self, episode: _Episode, what: str, coro) -> None:
        self._p.stepping[self.loop.submit(coro)] = (episode, what, time.monotonic() + self.limits.step_timeout_s)

    def _append(self, episode: _Episode, ids: list[int], policy: int, logprobs: list[float]) -> None:
        traj = episode.traj
        traj.response_ids.extend(ids)
        traj.response_mask.extend([policy] * len(ids))
        traj.logprobs.extend(logprobs)
        traj.versions.extend([self.version] * len(ids))


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
        # agents through the endpoint: turns whose prompt rewrote the history (the episode split there)
        "env/history_splits": sum(t.info.get("history_splits", 0.0) for t in trajectories),
        # what of those splits trains (a row each, beside the episode's last part), and every row
        "env/split_parts": sum(len(t.segments) for t in trajectories),
        "env/trained_rows": sum(len(t.parts()) for t in trajectories),
    }
    for reason in ("done", "length", "turns", "env_error"):
        out[f"env/finish_{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    return out
