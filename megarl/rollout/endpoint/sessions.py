"""Sessions: the requests of one caller, recorded token-exactly and assembled into trajectories.

A session is one episode as the endpoint sees it. Each request it serves is a turn: the prompt
ids the engine was given, the ids it sampled, their log-probs, the weight version and the finish
reason. Turns are assembled token in / token out, never from text: a turn whose prompt extends
the current trajectory's tokens (its prompt and everything after it so far) adds the difference
as context (mask 0, an observation: a tool result, the user's reply, the next assistant header)
and then its sampled ids (mask 1, trained). A turn whose prompt does not extend them (an agent
that rewrote or dropped part of its history, or two requests of one session in flight at once)
starts a new trajectory there: the session splits, and ``splits`` counts it. What trains is
always exactly what the engine was given and sampled.

Limits end a session: ``max_turns`` turns (across its splits), ``max_episode_tokens`` response
tokens in one trajectory (policy and context tokens after its prompt), each turn at most
``max_turn_tokens`` and prompt + turn at most ``max_model_len``, and ``wall_s`` seconds from its
opening. The request that would cross a limit gets an ``ApiError`` naming it, and every later
request of the session is refused. Running out of wall time, or a client that disconnects while
its turn generates (the turn is aborted, never recorded), fails the episode (``env_error``): it
trains only the whole turns recorded before, with no reward.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.rollout.endpoint.protocol import ApiError, TurnParams, bad
from megarl.rollout.episodes import Trajectory


@dataclass(frozen=True)
class SessionLimits:
    max_turns: int = 4
    max_episode_tokens: int = 512  # response tokens of one trajectory (policy and context)
    max_turn_tokens: int = 128
    max_model_len: int = 1024
    wall_s: float | None = None  # from the session's opening (rollout.endpoint.session_wall_s); None: none


@dataclass(frozen=True)
class SessionSampling:
    """The session's sampling. ``fixed``: a request may not change temperature or top-p (a
    training session: the trainer scores tokens at the run's temperature)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    fixed: bool = True
    seed: int | None = None  # turn t samples with seed + t unless the request names its own


@dataclass(frozen=True)
class TurnSpec:
    """What the engine samples one turn with."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (the engine stops at the token that completes one)
    top_logprobs: int = 0


@dataclass
class SampledTurn:
    """The engine's answer to one turn."""

    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, as the engine sampled it
    stopped: bool  # ended with the end-of-turn token (else a length limit or a stop string)
    finish_reason: str  # stop | length (OpenAI's: a stop string is "stop")
    version: int  # the weights that sampled it
    top_logprobs: list[dict[int, float]] | None = None  # per token, when asked for


@dataclass
class RecordedTurn:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str


class Session:
    def __init__(self, sid: str, limits: SessionLimits, sampling: SessionSampling = SessionSampling(),
                 clock: Callable[[], float] = time.monotonic):
        self.id, self.limits, self.sampling, self.clock = sid, limits, sampling, clock
        self.opened_at = clock()
        self.failure = ""  # what failed the episode (wall time, a client gone mid-request)
        self.turns: list[RecordedTurn] = []  # every turn served, in the order they finished
        self.segments: list[Trajectory] = []  # trajectories closed by a split
        self.current: Trajectory | None = None
        self.splits = 0
        self.in_flight = 0
        self.ended = ""  # why the session takes no more requests: turns | length | wall_time | disconnected | closed
        self.closed = False  # its episode is over: a turn that finishes now is not recorded
        self.turn_ended = True  # the last turn ended with the end-of-turn token
        # The conversation as of the last turn, for the next prompt (megarl.rollout.endpoint.prompts):
        self.history: list[tuple] = []  # chat: canonical messages, the reply last
        self.text: str | None = None  # completions: the prompt and the completion, as text

    @property
    def context(self) -> list[int]:
        """The current trajectory's tokens: what a next turn's prompt extends."""
        return [] if self.current is None else self.current.prompt_ids + self.current.response_ids

    def extends(self, prompt_ids: list[int]) -> bool:
        context = self.context
        return self.current is not None and len(prompt_ids) >= len(context) and prompt_ids[:len(context)] == context

    def admit(self, prompt_ids: list[int], params: TurnParams) -> TurnSpec:
        """A request about to generate: checked against the session's state and limits (a limit
        reached ends the session), and the turn it becomes."""
        if self.ended:
            raise ApiError(410, f"session {self.id!r} has ended ({self._why()}): it takes no more requests",
                           code="megarl_session_ended")
        lim = self.limits
        if self.wall_left() == 0.0:
            raise self.out_of_time()
        if len(self.turns) + self.in_flight >= lim.max_turns:
            self.ended = "turns"
            raise bad(f"session {self.id!r} reached its limit of {lim.max_turns} turns (env.max_turns); "
                      "the episode is over", code="megarl_session_turns")
        if len(prompt_ids) >= lim.max_model_len:
            raise bad(f"the prompt is {len(prompt_ids)} tokens; this model's context is {lim.max_model_len} "
                      "(rollout.max_model_len) with room for at least one token", "messages",
                      "context_length_exceeded")
        used = len(prompt_ids) - len(self.current.prompt_ids) if self.extends(prompt_ids) else 0
        if used >= lim.max_episode_tokens:
            self.ended = "length"
            raise bad(f"session {self.id!r} used its {lim.max_episode_tokens} response tokens (env.max_episode_tokens)"
                      f"; this prompt brings them to {used}; the episode is over", code="megarl_session_tokens")
        spec = self._sampling(params)
        budget = min(params.max_tokens or lim.max_turn_tokens, lim.max_turn_tokens, lim.max_episode_tokens - used,
                     lim.max_model_len - len(prompt_ids))
        self.in_flight += 1
        return TurnSpec(budget, *spec, seed=self._seed(params), stop=params.stop, top_logprobs=params.top_logprobs)

    def _sampling(self, params: TurnParams) -> tuple[float, float, int]:
        s = self.sampling
        if s.fixed:
            for name, asked, own in (("temperature", params.temperature, s.temperature),
                                     ("top_p", params.top_p, s.top_p)):
                if asked is not None and not math.isclose(asked, own, abs_tol=1e-6):
                    raise bad(f"{name} is fixed at {own} in a training session (the trainer scores tokens as "
                              f"sampled at rollout.{name}); omit it or pass {own}", name)
        temperature = s.temperature if params.temperature is None else params.temperature
        return temperature, s.top_p if params.top_p is None else params.top_p, s.top_k

    def _seed(self, params: TurnParams) -> int | None:
        if params.seed is not None:
            return params.seed
        return None if self.sampling.seed is None else self.sampling.seed + len(self.turns) + self.in_flight - 1

    def abandon(self) -> None:
        """A request admitted that did not generate (the engine refused it, the client left)."""
        self.in_flight -= 1

    def wall_left(self) -> float | None:
        """Seconds the session may still run (None: no wall-time limit)."""
        if self.limits.wall_s is None:
            return None
        return max(0.0, self.limits.wall_s - (self.clock() - self.opened_at))

    def out_of_time(self) -> ApiError:
        """The session ran out of wall time: it ends, its episode failed; the error its request gets."""
        why = (f"session {self.id!r} passed its wall-time limit of {self.limits.wall_s:g} s "
               "(rollout.endpoint.session_wall_s); the episode is over")
        self.fail("wall_time", why)
        return bad(why, code="megarl_session_wall_time")

    def fail(self, ended: str, why: str) -> None:
        """The episode fails (``env_error`` at ``finish``) and the session takes no more requests."""
        self.ended = self.ended or ended
        self.failure = self.failure or why

    def record(self, prompt_ids: list[int], turn: SampledTurn) -> bool:
        """A turn the engine answered, into the trajectory; True where it split the session."""
        self.in_flight -= 1
        split = self.current is not None and not self.extends(prompt_ids)
        if self.current is not None and not split:
            observation = list(prompt_ids[len(self.context):])
            self._append(observation, 0, [0.0] * len(observation), turn.version)
            self.current.observations.append(observation)
        else:
            if split:
                self.segments.append(self.current)
                self.splits += 1
            self.current = Trajectory(list(prompt_ids), [], [], [], "", 0.0)
        self._append(turn.token_ids, 1, turn.logprobs, turn.version)
        self.current.turns.append(list(turn.token_ids))
        self.turn_ended = turn.stopped
        self.turns.append(RecordedTurn(list(prompt_ids), list(turn.token_ids), list(turn.logprobs), turn.version,
                                       turn.finish_reason))
        return split

    def _append(self, ids: list[int], policy: int, logprobs: list[float], version: int) -> None:
        t = self.current
        t.response_ids.extend(ids)
        t.response_mask.extend([policy] * len(ids))
        t.logprobs.extend(logprobs)
        t.versions.extend([version] * len(ids))

    def finish(self, reward: float | None, error: str = "") -> Trajectory:
        """The episode's trajectory: the last one (what trains), the ones its splits closed in
        ``segments``. Its finish reason: ``env_error`` where the session failed (its wall time, a
        client gone mid-request: no reward), else the limit that ended the session, else
        ``env_error`` where the agent failed (or made no request), else done / length by how its
        last turn ended."""
        limit = self.ended if self.ended in ("turns", "length") else ""
        if self.failure:  # no reward: the agent's (if it returned one) scored an episode cut short
            reward, limit, error = None, "", self.failure + (f"; then {error}" if error else "")
        if not self.turns and not error:
            error = "the agent made no request to the endpoint"
        reason = limit or ("env_error" if error else "done" if self.turn_ended else "length")
        value = 0.0 if reward is None else float(reward)
        self.ended, self.closed = self.ended or "closed", True
        for segment in self.segments:
            segment.finish_reason = "length"  # cut where the agent rewrote its history
            segment.reward, segment.turn_rewards = value, [0.0] * len(segment.turns)
        t = self.current or Trajectory([], [], [], [], "", 0.0)
        t.finish_reason, t.reward, t.error = reason, value, error
        t.turn_rewards = [0.0] * (len(t.turns) - 1) + [value] if t.turns else []
        t.info = {"endpoint_turns": float(len(self.turns)), "history_splits": float(self.splits)}
        t.segments = list(self.segments)
        return t

    def _why(self) -> str:
        if self.ended == "wall_time":
            return f"its {self.limits.wall_s:g} s of wall time are used"
        return {"turns": f"its {self.limits.max_turns} turns are used", "length": "its tokens are used",
                "closed": "its episode is over", "disconnected": "its client disconnected mid-request"
                }.get(self.ended, self.ended)


class SessionBook:
    """The sessions of an endpoint: open ones by id, and the recently closed ones (named in the
    error a late request gets)."""

    def __init__(self, remember: int = 4096):
        self.open_sessions: dict[str, Session] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._remember = remember

    def open(self, sid: str, limits: SessionLimits, sampling: SessionSampling = SessionSampling()) -> Session:
        if sid in self.open_sessions or sid in self._closed:
            raise ValueError(f"session {sid!r} exists already")
        session = self.open_sessions[sid] = Session(sid, limits, sampling)
        return session

    def get(self, sid: Any) -> Session:
        if not isinstance(sid, str) or not sid:
            raise bad("no session: name it in the X-Megarl-Session header (or the megarl_session field)",
                      code="megarl_no_session")
        session = self.open_sessions.get(sid)
        if session is not None:
            return session
        if sid in self._closed:
            raise ApiError(410, f"session {sid!r} has ended ({self._closed[sid]}): it takes no more requests",
                           code="megarl_session_ended")
        raise ApiError(404, f"no session {sid!r}: the run's episodes open their own; a caller from outside "
                       "opens one with POST /v1/sessions",
                       code="megarl_unknown_session", kind="not_found_error")

    def close(self, sid: str) -> Session | None:
        session = self.open_sessions.pop(sid, None)
        if session is not None:
            session.ended, session.closed = session.ended or "closed", True
            self._closed[sid] = session._why()
            while len(self._closed) > self._remember:
                self._closed.popitem(last=False)
        return session

