"""Multi-turn episodes under the opportunistic schedule.

A weight sync interrupts the engines at their next decoding step; each finished episode is kept.
Each unfinished one, by ``rollout.partial``:

- ``regenerate``: dropped (its turns aborted, its environment closed) and generated again from its
  reset under the new weights, with the same seed: an episode's tokens all come from one version.
- ``continue``: suspended on its engine (its cut turn keeps its tokens, its environment its state
  and any call in flight) and continued there under the new weights, on that engine's next call;
  each token records the version that generated it (``Trajectory.versions``).

With ``rollout.granularity: group`` (``stream``, ``take_groups``) the groups with no suspended
episode stream to the engines a group at a time, and come back as each finishes; an interruption
sends back the groups it cut with their finished episodes, the others dropped or suspended on
that engine (a suspended episode goes on there, in a ``continue_episodes`` call of its own).

A batch's version is its oldest token's, so the staleness bound holds as for single-turn samples
(``megarl.rollout_driver.partial_samples``). Environments' states are not checkpointed: a resumed run
starts a checkpointed batch's unfinished episodes over from their reset (its finished ones kept).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from megarl.config.schema import RunConfig
from megarl.rollout.episodes import EpisodeRequest, Trajectory, suspended_name
from megarl.rollout.remote import submit_episode_requests
from megarl.rollout.sampling import SamplingConfig
from megarl.rollout_driver.group_streams import groups_as_they_finish, open_episode_group_streams
from megarl.rollout_driver.inflight import LOST, InFlight
from megarl.utils.shares import contiguous_shares

Home = tuple[int, str]  # where a suspended episode waits: (engine index, the name it is kept under)


@dataclass
class PartialEpisodes(InFlight):
    """A batch of episodes, some finished; calls in flight or none."""

    requests: list[EpisodeRequest]  # one per episode, a group's side by side
    episodes: list[Trajectory | None]  # None: not finished yet
    versions: list[int]  # each finished episode's oldest token's weight version
    homes: list[Home | None]  # each suspended episode's engine and name (rollout.partial=continue)
    interruptions: int = 0  # episodes an interruption cut (dropped and restarted, or suspended)
    lost: int = 0  # episodes an engine's fault cut: started over from their reset on another engine
    call_homes: list[Home | None] = field(default_factory=list)  # where each call suspends its episodes
    streams_suspend: bool = False  # whether the streams keep the episodes an interruption cuts

    @property
    def finished(self) -> bool:
        return all(t is not None for t in self.episodes)

    def group(self, g: int) -> range:
        """Group ``g``'s episodes (their positions in the batch)."""
        return range(g * self.group_size, (g + 1) * self.group_size)


def new_batch(index: int, prompt_ids: list[int], requests: list[EpisodeRequest], n: int) -> PartialEpisodes:
    count = len(requests)
    return PartialEpisodes(index, list(prompt_ids), n, list(requests), [None] * count, [-1] * count, [None] * count)


def submit(batch: PartialEpisodes, engines: dict[int, Any], sampling: SamplingConfig, cfg: RunConfig,
           version: int, epoch: int) -> None:
    """Asks the engines for every unfinished episode with version ``version`` (interruptible at
    ``epoch``): a suspended one from where it stopped, on the engine that holds it; the others
    from their reset, each engine (``engines``: the live ones by index) a contiguous share.
    Returns at once."""
    fresh = _continue_suspended(batch, engines, sampling, version, epoch)
    keep = cfg.rollout.partial == "continue"
    for e, part in zip(engines, contiguous_shares(fresh, len(engines)), strict=True):
        if part:
            # unique: an episode starts fresh once (again after an engine's fault: another attempt)
            name = f"{batch.index}.{part[0]}" + (f".{batch.lost}" if batch.lost else "") if keep else None
            batch.calls.append(submit_episode_requests(engines[e], [batch.requests[i] for i in part], sampling, cfg,
                                                       epoch, keep=name))
            batch.call_slots.append(part)
            batch.call_homes.append(None if name is None else (e, name))
            batch.call_engines.append(e)


def stream(batch: PartialEpisodes, engines: list, sampling: SamplingConfig, cfg: RunConfig, version: int,
           epoch: int) -> None:
    """``submit`` a group at a time (``rollout.granularity: group``): the suspended episodes go on
    where they wait, and every group with an episode to start from its reset streams to the
    engines, the next whenever one of an engine's own finishes; ``take_groups`` takes them in.
    Returns at once."""
    fresh = set(_continue_suspended(batch, dict(enumerate(engines)), sampling, version, epoch))
    groups = []
    for g in range(len(batch.episodes) // batch.group_size):
        asked = [batch.requests[i] if i in fresh else None for i in batch.group(g)]
        if any(r is not None for r in asked):
            groups.append((g, asked))
    batch.streams_suspend = cfg.rollout.partial == "continue"
    batch.streams = open_episode_group_streams(engines, groups, sampling, cfg, epoch, suspend=batch.streams_suspend)


def take_groups(batch: PartialEpisodes, timeout_s: float) -> Iterator[int]:
    """The streamed groups' episodes kept as each group comes back, then the suspended episodes'
    calls' (``timeout_s`` for all); yields each group that is then finished. After an
    interruption, the episodes it cut wait for the next round, suspended or to start over."""
    streams, deadline = batch.streams, time.monotonic() + timeout_s
    try:
        for g, episodes in groups_as_they_finish(streams, timeout_s):
            e = streams.came_from[g]
            home = (e, suspended_name(streams.streams[e])) if batch.streams_suspend else None
            # the episodes this stream was asked for: unfinished, not waiting elsewhere (``stream``)
            asked = [i for i in batch.group(g) if batch.episodes[i] is None and batch.homes[i] is None]
            for i in asked:
                _keep(batch, i, episodes[i - g * batch.group_size], home)
            if all(batch.episodes[i] is not None for i in batch.group(g)):
                yield g
    finally:
        batch.streams = None
    touched = collect(batch, max(1.0, deadline - time.monotonic()))
    yield from sorted(g for g in touched if all(batch.episodes[i] is not None for i in batch.group(g)))


def _continue_suspended(batch: PartialEpisodes, engines: dict[int, Any], sampling: SamplingConfig, version: int,
                        epoch: int) -> list[int]:
    """Sends every suspended episode back to the engine where it waits (one call per name it waits
    under); returns the unfinished episodes that start from their reset (those suspended on an
    engine that failed among them)."""
    assert not batch.in_flight, "a batch's calls must be collected before it is submitted again"
    todo = [i for i, t in enumerate(batch.episodes) if t is None]
    batch.calls, batch.call_slots, batch.call_homes, batch.call_version = [], [], [], version
    batch.call_engines = []
    waiting: dict[Home, list[int]] = {}
    for i in todo:
        if (home := batch.homes[i]) is not None and home[0] not in engines:
            batch.homes[i], batch.lost = None, batch.lost + 1
        elif home is not None:
            waiting.setdefault(home, []).append(i)
    for (engine, name), part in waiting.items():
        batch.calls.append(engines[engine].continue_episodes.remote(name, replace(sampling, n=1), epoch))
        batch.call_slots.append(part)
        batch.call_homes.append((engine, name))
        batch.call_engines.append(engine)
    return [i for i in todo if batch.homes[i] is None]


def forget_engine(batch: PartialEpisodes, index: int, dropped: bool = False) -> None:
    """Engine ``index`` failed: the episodes suspended there start over from their reset (a
    replacement holds none); ``dropped``, the engines after it move down one."""
    for i, home in enumerate(batch.homes):
        if home is not None and home[0] == index:
            batch.homes[i], batch.lost = None, batch.lost + 1
        elif home is not None and dropped and home[0] > index:
            batch.homes[i] = (home[0] - 1, home[1])


def collect(batch: PartialEpisodes, timeout_s: float, fleet: Any = None) -> set[int]:
    """Waits for the batch's calls (``timeout_s``); keeps each episode that finished, and where
    each suspended one waits. An episode whose engine failed is never kept half: it starts over
    from its reset in the next round."""
    home_of = {i: home for part, home in zip(batch.call_slots, batch.call_homes, strict=True) for i in part}
    answers, batch.call_homes = batch.take_answers(timeout_s, fleet), []
    for i, episode in answers:
        if episode is LOST:
            batch.homes[i], batch.lost = None, batch.lost + 1
            continue
        _keep(batch, i, episode, home_of[i])
    return {i // batch.group_size for i, _ in answers}


def _keep(batch: PartialEpisodes, i: int, episode: Trajectory | None, home: Home | None) -> None:
    """Episode ``i``'s answer: finished, or cut by an interruption (suspended at ``home``, or None:
    dropped, to start over)."""
    if episode is not None:
        batch.episodes[i], batch.homes[i] = episode, None
        batch.versions[i] = min(episode.versions, default=batch.call_version)
    else:
        batch.homes[i] = home
        batch.interruptions += 1


def token_versions(batch: PartialEpisodes) -> list[list[int]]:
    """Each finished episode's response tokens' weight versions."""
    return [list(t.versions) for t in batch.episodes]
