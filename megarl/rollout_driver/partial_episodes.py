"""The episode unit kind (``Episodes``): multi-turn episodes, whole (the exact schedule) or, under
the opportunistic schedule, interruptible.

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
from typing import Any, Literal

from megarl.config.schema import RunConfig
from megarl.rollout.episodes import EpisodeRequest, Trajectory, suspended_name
from megarl.rollout.remote import submit_episode_requests
from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.rollout_driver.group_streams import groups_as_they_finish, open_episode_group_streams
from megarl.rollout_driver.inflight import LOST, InFlight, Kept, dispatch
from megarl.utils.shares import contiguous_shares

Home = tuple[int, str]  # where a suspended episode waits: (engine index, the name it is kept under)


@dataclass
class Episodes:
    """A batch's episodes, some finished, a group's side by side."""

    cfg: RunConfig
    interruptible: bool  # the opportunistic schedule: a sync cuts the unfinished ones
    group_size: int
    requests: list[EpisodeRequest]  # one per episode
    episodes: list[Trajectory | None]  # None: not finished yet
    versions: list[int]  # each finished episode's oldest token's weight version
    homes: list[Home | None]  # each suspended episode's engine and name (rollout.partial=continue)
    interruptions: int = 0  # episodes an interruption cut (dropped and restarted, or suspended)
    lost: int = 0  # episodes an engine's fault cut: started over from their reset on another engine
    call_homes: list[Home | None] = field(default_factory=list)  # where each call suspends its episodes
    streams_suspend: bool = False  # whether the streams keep the episodes an interruption cuts
    kind: Literal["episode"] = "episode"

    @property
    def keep(self) -> bool:
        """Whether an interrupted episode is suspended on its engine (else dropped, to start over)."""
        return self.interruptible and self.cfg.rollout.partial == "continue"

    @property
    def finished(self) -> bool:
        return all(t is not None for t in self.episodes)

    def group(self, g: int) -> range:
        """Group ``g``'s episodes (their positions in the batch)."""
        return range(g * self.group_size, (g + 1) * self.group_size)

    def submit(self, batch: InFlight, fleet: Any, sampling: SamplingConfig, version: int, epoch: int | None) -> None:
        """Every unfinished episode with version ``version`` (interruptible at ``epoch``): a
        suspended one from where it stopped, on the engine that holds it; the others from their
        reset, each live engine a contiguous share (whole groups, where they share the prompt's
        cache, when the batch is not interruptible)."""
        engines = fleet.live_engines() if fleet is not None else {}
        fresh = self._continue_suspended(batch, fleet, engines, sampling, version, epoch)
        unit = 1 if self.interruptible else self.group_size
        for e, part in zip(engines, contiguous_shares(fresh, len(engines), unit=unit), strict=True):
            if part:
                # unique: an episode starts fresh once (again after an engine's fault: another attempt)
                name = f"{batch.index}.{part[0]}" + (f".{self.lost}" if self.lost else "") if self.keep else None
                requests = [self.requests[i] for i in part]
                batch.calls.append(dispatch(fleet, engines, e, lambda engine, r=requests, k=name: (
                    submit_episode_requests(engine, r, sampling, self.cfg, epoch, keep=k))))
                batch.call_slots.append(part)
                self.call_homes.append(None if name is None else (e, name))

    def stream(self, batch: InFlight, engines: list, sampling: SamplingConfig, version: int,
               epoch: int | None) -> None:
        """``submit`` a group at a time: the suspended episodes go on where they wait, and every
        group with an episode to start from its reset streams to the engines, the next whenever
        one of an engine's own finishes."""
        fresh = set(self._continue_suspended(batch, None, dict(enumerate(engines)), sampling, version, epoch))
        groups = []
        for g in range(len(self.episodes) // self.group_size):
            asked = [self.requests[i] if i in fresh else None for i in self.group(g)]
            if any(r is not None for r in asked):
                groups.append((g, asked))
        self.streams_suspend = self.keep
        batch.streams = open_episode_group_streams(engines, groups, sampling, self.cfg, epoch,
                                                   suspend=self.streams_suspend)

    def take_groups(self, batch: InFlight, timeout_s: float) -> Iterator[int]:
        """The streamed groups' episodes kept as each group comes back, then the suspended episodes'
        calls' (``timeout_s`` for all); yields each group that is then finished. After an
        interruption, the episodes it cut wait for the next round, suspended or to start over."""
        streams, deadline = batch.streams, time.monotonic() + timeout_s
        try:
            for g, episodes in groups_as_they_finish(streams, timeout_s):
                e = streams.came_from[g]
                home = (e, suspended_name(streams.streams[e])) if self.streams_suspend else None
                # the episodes this stream was asked for: unfinished, not waiting elsewhere (``stream``)
                asked = [i for i in self.group(g) if self.episodes[i] is None and self.homes[i] is None]
                for i in asked:
                    self._keep(batch, i, episodes[i - g * self.group_size], home)
                if all(self.episodes[i] is not None for i in self.group(g)):
                    yield g
        finally:
            batch.streams = None
        touched = self._collect(batch, max(1.0, deadline - time.monotonic()), None)
        yield from sorted(g for g in touched if all(self.episodes[i] is not None for i in self.group(g)))

    def _continue_suspended(self, batch: InFlight, fleet: Any, engines: dict[int, Any], sampling: SamplingConfig,
                            version: int, epoch: int | None) -> list[int]:
        """Sends every suspended episode back to the engine where it waits (one call per name it waits
        under); returns the unfinished episodes that start from their reset (those suspended on an
        engine that failed among them)."""
        assert not batch.in_flight, "a batch's calls must be collected before it is submitted again"
        todo = [i for i, t in enumerate(self.episodes) if t is None]
        batch.calls, batch.call_slots, self.call_homes, batch.call_version = [], [], [], version
        waiting: dict[Home, list[int]] = {}
        for i in todo:
            if (home := self.homes[i]) is not None and home[0] not in engines:
                self.homes[i], self.lost = None, self.lost + 1
            elif home is not None:
                waiting.setdefault(home, []).append(i)
        one = replace(sampling, n=1)
        for (engine, name), part in waiting.items():
            batch.calls.append(dispatch(fleet, engines, engine,
                                        lambda handle, k=name: handle.continue_episodes.remote(k, one, epoch)))
            batch.call_slots.append(part)
            self.call_homes.append((engine, name))
        return [i for i in todo if self.homes[i] is None]

    def forget_engine(self, index: int, dropped: bool = False) -> None:
        """Engine ``index`` failed: the episodes suspended there start over from their reset (a
        replacement holds none); ``dropped``, the engines after it move down one."""
        for i, home in enumerate(self.homes):
            if home is not None and home[0] == index:
                self.homes[i], self.lost = None, self.lost + 1
            elif home is not None and dropped and home[0] > index:
                self.homes[i] = (home[0] - 1, home[1])

    def collect(self, batch: InFlight, timeout_s: float, fleet: Any = None) -> None:
        self._collect(batch, timeout_s, fleet)

    def _collect(self, batch: InFlight, timeout_s: float, fleet: Any) -> set[int]:
        """Waits for the batch's calls (``timeout_s``); keeps each episode that finished, and where
        each suspended one waits; returns the groups touched. An episode whose engine failed is
        never kept half: it starts over from its reset in the next round."""
        home_of = {i: home for part, home in zip(batch.call_slots, self.call_homes, strict=True) for i in part}
        answers, self.call_homes = batch.take_answers(timeout_s, fleet), []
        for i, episode in answers:
            if episode is LOST:
                self.homes[i], self.lost = None, self.lost + 1
                continue
            self._keep(batch, i, episode, home_of[i])
        return {i // self.group_size for i, _ in answers}

    def _keep(self, batch: InFlight, i: int, episode: Trajectory | None, home: Home | None) -> None:
        """Episode ``i``'s answer: finished, or cut by an interruption (suspended at ``home``, or None:
        dropped, to start over)."""
        if episode is not None:
            self.episodes[i], self.homes[i] = episode, None
            self.versions[i] = min(episode.versions, default=batch.call_version)
        else:
            self.homes[i] = home
            self.interruptions += 1

    def group_samples(self, g: int) -> list[RolloutSample]:
        return [self.episodes[i].sample() for i in self.group(g)]

    def groups(self) -> tuple[list[list[RolloutSample]], list[Trajectory]]:
        n = self.group_size
        return ([[t.sample() for t in self.episodes[i:i + n]] for i in range(0, len(self.episodes), n)],
                list(self.episodes))

    def oldest_version(self, batch: InFlight) -> int:
        return min(self.versions)

    def annotate(self, rollout: Any) -> None:
        """Under the opportunistic schedule: each token's version and the episodes cut."""
        if self.interruptible:
            rollout.token_versions = [list(t.versions) for t in self.episodes]
            rollout.interrupted_episodes, rollout.lost_episodes = self.interruptions, self.lost

    def kept(self) -> Kept:
        """The finished episodes; the others start over (an environment's state is not checkpointed)."""
        kept = [i for i, t in enumerate(self.episodes) if t is not None]
        episodes = [self.episodes[i] for i in kept]
        return Kept("episodes", kept, [t.sample() for t in episodes], [list(t.versions) for t in episodes], episodes,
                    extra={"versions": [self.versions[i] for i in kept], "interruptions": self.interruptions})


def new_batch(index: int, prompt_ids: list[int], requests: list[EpisodeRequest], n: int, cfg: RunConfig,
              interruptible: bool = True, version: int | None = None) -> InFlight:
    count = len(requests)
    units = Episodes(cfg, interruptible, n, list(requests), [None] * count, [-1] * count, [None] * count)
    return InFlight(index, list(prompt_ids), n, units, version)
