"""Multi-turn episodes under the opportunistic schedule (``rollout.partial: regenerate``).

A weight sync interrupts the engines: each finished episode is kept, with the weight version that
generated it, and each unfinished one is dropped (its turns aborted, its environment closed) and
generated again from its reset under the new weights, with the same seed. An episode's tokens
therefore all come from one version; a batch's version is its oldest episode's, so the staleness
bound holds as for single-turn samples (``megarl.trainer.partial_rollouts``). Continuing an episode
across versions would need its environment's state across the sync and a checkpoint: not done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.schema import RunConfig
from megarl.rollout.episodes import EpisodeRequest, Trajectory
from megarl.rollout.remote import submit_episode_requests
from megarl.rollout.sampling import SamplingConfig
from megarl.trainer.partial_rollouts import take_answers
from megarl.utils.shares import contiguous_shares


@dataclass
class PartialEpisodes:
    """A batch of episodes, some finished; calls in flight or none."""

    index: int
    prompt_ids: list[int]  # the dataset's ids of its prompts
    group_size: int
    requests: list[EpisodeRequest]  # one per episode, a group's side by side
    episodes: list[Trajectory | None]  # None: not finished yet
    versions: list[int]  # the weight version that generated each finished episode
    restarts: int = 0  # episodes dropped by an interruption (and generated again)
    calls: list = field(default_factory=list)  # Ray object refs, one per engine asked
    call_slots: list[list[int]] = field(default_factory=list)  # the episodes each call generates
    call_version: int = -1

    @property
    def finished(self) -> bool:
        return all(t is not None for t in self.episodes)

    @property
    def in_flight(self) -> bool:
        return bool(self.calls)


def new_batch(index: int, prompt_ids: list[int], requests: list[EpisodeRequest], n: int) -> PartialEpisodes:
    return PartialEpisodes(index, list(prompt_ids), n, list(requests), [None] * len(requests), [-1] * len(requests))


def submit(batch: PartialEpisodes, engines: list, sampling: SamplingConfig, cfg: RunConfig, version: int,
           epoch: int) -> None:
    """Asks the engines for every unfinished episode, from its reset, with version ``version``
    (interruptible at ``epoch``); each engine a contiguous share. Returns at once."""
    assert not batch.in_flight, "a batch's calls must be collected before it is submitted again"
    todo = [i for i, t in enumerate(batch.episodes) if t is None]
    batch.calls, batch.call_slots, batch.call_version = [], [], version
    for engine, part in zip(engines, contiguous_shares(todo, len(engines)), strict=True):
        if part:
            batch.calls.append(submit_episode_requests(engine, [batch.requests[i] for i in part], sampling, cfg, epoch))
            batch.call_slots.append(part)


def collect(batch: PartialEpisodes, timeout_s: float) -> None:
    """Waits for the batch's calls (``timeout_s``); keeps each episode that finished."""
    for i, episode in take_answers(batch, timeout_s):
        if episode is not None:
            batch.episodes[i], batch.versions[i] = episode, batch.call_version
        else:
            batch.restarts += 1


def token_versions(batch: PartialEpisodes) -> list[list[int]]:
    """Each finished episode's response tokens, all of its one version."""
    return [[version] * len(t.response_ids) for t, version in zip(batch.episodes, batch.versions, strict=True)]
