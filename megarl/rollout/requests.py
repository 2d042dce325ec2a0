"""One request type for every unit a rollout engine generates, and the one streaming call that
serves a list of them.

A ``RolloutRequest`` is a prompt (``PromptRequest``: its ``sampling.n`` samples, whole), a
continued segment of one sample (``SegmentRequest``: the opportunistic schedule) or an episode
(``EpisodeRequest``: multi-turn, against the run's environment). A batch's units are all of one
kind; a ``StreamCall`` says which, and how they are served: the sampling, the interruption epoch
(None: not interruptible) and, for episodes, the environment they run against. The engine's one
streaming entry point (``GroupStreaming.serve``) takes a ``StreamCall`` and serves the groups of
requests handed to it (``add_groups``), whatever their kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config.schema import EnvConfig, RewardTermConfig
from megarl.rollout.episodes import EpisodeLimits, EpisodeRequest
from megarl.rollout.sampling import SamplingConfig, SegmentRequest


@dataclass(frozen=True)
class PromptRequest:
    """A prompt's ``sampling.n`` samples, generated whole: sample j seeded ``sampling.seed + j``."""

    prompt_ids: list[int]


RolloutRequest = PromptRequest | SegmentRequest | EpisodeRequest
RequestKind = Literal["prompt", "segment", "episode"]


@dataclass(frozen=True)
class EpisodeHosting:
    """What a call of episodes runs against: the environment, the reward terms that score final
    answers, the limits; ``suspend``: an interruption keeps the episodes it cuts on the engine."""

    env: EnvConfig
    rewards: list[RewardTermConfig]
    limits: EpisodeLimits
    suspend: bool = False


@dataclass(frozen=True)
class StreamCall:
    """One streaming call: the kind of its requests, their sampling, the epoch whose ``interrupt``
    ends it (None: nothing interrupts it) and, for episodes, what they run against."""

    kind: RequestKind
    sampling: SamplingConfig
    epoch: int | None = None
    episodes: EpisodeHosting | None = None

    def __post_init__(self) -> None:
        if (self.kind == "episode") != (self.episodes is not None):
            raise ValueError("a StreamCall of episodes names what they run against (episodes), and only it")
