"""Multi-turn episodes under the opportunistic schedule.

A weight sync interrupts the engines at their next decoding step; each finished episode is kept.
Each unfinished one, by ``rollout.partial``:

- ``regenerate``: dropped (its turns aborted, its environment closed) and generated again from its
  reset under the new weights, with the same seed: an episode's tokens all come from one version.
- ``continue``: suspended on its engine (its cut turn keeps its tokens, its environment its state
  and any call in flight) and continued there under the new weights, on that engine's next call;
  each token records the version that generated it (``Trajectory.versions``).

A batch's version is its oldest token's, so the staleness bound holds as for single-turn samples
(``megarl.trainer.partial_rollouts``). Environments' states are not checkpointed: a resumed run
starts a checkpointed batch's unfinished episodes over from their reset (its finished ones kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megarl.config.schema import RunConfig
from megarl.rollout.episodes import EpisodeRequest, Trajectory
from megarl.rollout.remote import submit_episode_requests
from megarl.rollout.sampling import SamplingConfig
from megarl.trainer.partial_rollouts import take_answers
from megarl.utils.shares import contiguous_shares

Home = tuple[int, str]  # where a suspended episode waits: (engine index, the name it is kept under)


@dataclass
class PartialEpisodes:
    """A batch of episodes, some finished; calls in flight or none."""

    index: int
    prompt_ids: list[int]  # the dataset's ids of its prompts
    group_size: int
    requests: list[EpisodeRequest]  # one per episode, a group's side by side
    episodes: list[Trajectory | None]  # None: not finished yet
    versions: list[int]  # each finished episode's oldest token's weight version
    homes: list[Home | None]  # each suspended episode's engine and name (rollout.partial=continue)
    interruptions: int = 0  # episodes an interruption cut (dropped and restarted, or suspended)
    calls: list = field(default_factory=list)  # Ray object refs, one per engine call
    call_slots: list[list[int]] = field(default_factory=list)  # the episodes each call answers
    call_homes: list[Home | None] = field(default_factory=list)  # where each call suspends its episodes
    call_version: int = -1

    @property
    def finished(self) -> bool:
        return all(t is not None for t in self.episodes)

    @property
    def in_flight(self) -> bool:
        return bool(self.calls)


def new_batch(index: int, prompt_ids: list[int], requests: list[EpisodeRequest], n: int) -> PartialEpisodes:
    count = len(requests)
    return PartialEpisodes(index, list(prompt_ids), n, list(requests), [None] * count, [-1] * count, [None] * count)


def submit(batch: PartialEpisodes, engines: list, sampling: SamplingConfig, cfg: RunConfig, version: int,
           epoch: int) -> None:
    """Asks the engines for every unfinished episode with version ``version`` (interruptible at
    ``epoch``): a suspended one from where it stopped, on the engine that holds it; the others
    from their reset, each engine a contiguous share. Returns at once."""
    assert not batch.in_flight, "a batch's calls must be collected before it is submitted again"
    todo = [i for i, t in enumerate(batch.episodes) if t is None]
    batch.calls, batch.call_slots, batch.call_homes, batch.call_version = [], [], [], version
    waiting: dict[Home, list[int]] = {}
    for i in todo:
        if (home := batch.homes[i]) is not None:
            waiting.setdefault(home, []).append(i)
    for (engine, name), part in waiting.items():
        batch.calls.append(engines[engine].continue_episodes.remote(name, replace(sampling, n=1), epoch))
        batch.call_slots.append(part)
        batch.call_homes.append((engine, name))
    fresh = [i for i in todo if batch.homes[i] is None]
    keep = cfg.rollout.partial == "continue"
    for e, part in enumerate(contiguous_shares(fresh, len(engines))):
        if part:
            name = f"{batch.index}.{part[0]}" if keep else None  # unique: an episode starts fresh once
            batch.calls.append(submit_episode_requests(engines[e], [batch.requests[i] for i in part], sampling, cfg,
                                                       epoch, keep=name))
            batch.call_slots.append(part)
            batch.call_homes.append(None if name is None else (e, name))


def collect(batch: PartialEpisodes, timeout_s: float) -> None:
    """Waits for the batch's calls (``timeout_s``); keeps each episode that finished, and where
    each suspended one waits."""
    home_of = {i: home for part, home in zip(batch.call_slots, batch.call_homes, strict=True) for i in part}
    answers, batch.call_homes = take_answers(batch, timeout_s), []
    for i, episode in answers:
        if episode is not None:
            batch.episodes[i], batch.homes[i] = episode, None
            batch.versions[i] = min(episode.versions, default=batch.call_version)
        else:
            batch.homes[i] = home_of[i]
            batch.interruptions += 1


def token_versions(batch: PartialEpisodes) -> list[list[int]]:
    """Each finished episode's response tokens' weight versions."""
    return [list(t.versions) for t in batch.episodes]
