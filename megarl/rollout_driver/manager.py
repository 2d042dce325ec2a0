"""The rollout side of a step: prompts in, scored samples out.

``RolloutManager`` owns what generation needs and training does not: the prompt
stream (and its position, which checkpoints save), the tokenizer, the engines'
handles and the reward terms. It knows nothing of Megatron roles or of who holds
the device: a reward-model score is passed in, and the colocation hand-overs
happen around its calls (``megarl.trainer.colocation``). This is the piece that
runs ahead of training once rollout is asynchronous.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.config.schema import RunConfig
from megarl.data.dataset import PromptDataset
from megarl.data.prompts import PromptItem
from megarl.data.tokenize import tokenize_prompts
from megarl.rewards.base import RewardInput
from megarl.rewards.combined import RunReward
from megarl.rollout.episodes import EpisodeRequest, Trajectory
from megarl.rollout.remote import episode_item, episode_requests, submit_episode_requests
from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.rollout_driver import partial_episodes, partial_samples
from megarl.rollout_driver.batch import Rollout, build_batch
from megarl.rollout_driver.fleet import Dispatch, EngineFleet
from megarl.rollout_driver.group_streams import (
    GroupStreams,
    groups_as_they_finish,
    open_episode_group_streams,
    open_group_streams,
)
from megarl.rollout_driver.inflight import interrupt
from megarl.rollout_driver.partial_episodes import PartialEpisodes
from megarl.rollout_driver.partial_samples import PartialRollout
from megarl.rollout_driver.scoring import Scores, Scoring
from megarl.utils.shares import contiguous_shares

# Sampling seeds: one per step, distinct across steps and runs with different seeds.
_SEED_STRIDE = 100_003


@dataclass
class PendingRollout:
    """A batch the engines are generating: the calls to wait on, and what to assemble it with."""

    index: int
    version: int
    prompt_ids: list[int]
    calls: list[Dispatch]  # one per engine, in engine order (none: rollout.granularity=group)
    finished: Future | None = None  # collecting and scoring it in the background (``finish_ahead``)
    submitted_at: float = field(default_factory=time.monotonic)
    group_streams: GroupStreams | None = None  # rollout.granularity=group: the groups in flight


class RolloutManager:
    def __init__(self, cfg: RunConfig, engines: list, tokenizer: Any, dataset: PromptDataset[PromptItem],
                 reward: RunReward):
        self.cfg, self.engines, self.tokenizer = cfg, engines, tokenizer
        self.dataset, self.reward = dataset, reward
        # which engines serve; calls that survive an engine's fault (rollout.max_engine_restarts)
        self.fleet = EngineFleet(engines, cfg.rollout.request_timeout_s)
        self.scoring = Scoring(cfg, reward)  # every score of a batch comes from it
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._ahead: ThreadPoolExecutor | None = None
        # The Rust tokenizer refuses a call from a second thread while one is in it (the
        # background thread decodes a finished batch while the next batch's prompts are tokenized)
        self._tokenizer_lock = threading.Lock()
        # rollout.granularity=group under the opportunistic schedule: a thread per batch in flight
        # (k + 1 at most) takes its groups in as they finish, hands the engines the next, and scores them
        self._streams_groups = cfg.rollout.granularity == "group" and cfg.trainer.schedule == "opportunistic"
        self._group_takers = (ThreadPoolExecutor(max_workers=cfg.trainer.max_staleness + 1,
                                                 thread_name_prefix="megarl-group-taker")
                              if self._streams_groups else None)

    def finish_ahead(self) -> None:
        """From now on each submitted batch is collected, assembled and scored by the reward terms
        in a background thread as soon as the engines return it, while the trainer works on an
        earlier one (the rollout service does this; ``collect`` then only waits for it)."""
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-rollout-ahead")

    @property
    def needs_reward_model(self) -> bool:
        return self.reward.needs_model

    def submit(self, index: int, version: int) -> PendingRollout:
        """Draws batch ``index``'s prompts and asks for ``rollout.n`` responses to each, the prompts
        split over the engines; returns at once. The engines refuse if their weights are not
        ``version`` (the fence against generating with weights other than the ones recorded)."""
        ids = self.dataset.next_ids()
        items = [self.dataset.items[i] for i in ids]
        sampling = self._sampling(index, version)
        pending = PendingRollout(index, version, ids, calls=[])
        by_group = self.cfg.rollout.granularity == "group"
        if by_group and self.cfg.env is not None:
            requests, n = self._episode_requests(ids, sampling), sampling.n
            groups = [(g, requests[g * n:(g + 1) * n]) for g in range(len(ids))]
            pending.group_streams = open_episode_group_streams(self.engines, groups, sampling, self.cfg)
        elif by_group:
            pending.group_streams = open_group_streams(self.engines, self._tokenize(items), sampling,
                                                       self.cfg.rollout.max_num_seqs)
        elif self.cfg.env is not None:
            # a group's episodes on one engine, where they share the prompt's cache
            requests = self._episode_requests(ids, sampling)
            shares = contiguous_shares(requests, len(self.fleet.live()), unit=sampling.n)
            pending.calls = self.fleet.submit_shares(
                shares, lambda engine, part: submit_episode_requests(engine, part, sampling, self.cfg))
        else:
            shares = contiguous_shares(self._tokenize(items), len(self.fleet.live()))
            pending.calls = self.fleet.submit_shares(shares,
                                                     lambda engine, part: engine.generate.remote(part, sampling))
        if self._ahead is not None:
            pending.finished = self._ahead.submit(self._collect_and_score, pending)
        return pending

    def submit_partial(self, index: int, version: int, epoch: int) -> PartialRollout | PartialEpisodes:
        """Like ``submit``, as interruptible segments (``trainer.schedule: opportunistic``), or
        with ``env``, interruptible episodes."""
        ids = self.dataset.next_ids()
        sampling = self._sampling(index, version)
        if self.cfg.env is not None:
            batch = partial_episodes.new_batch(index, ids, self._episode_requests(ids, sampling), sampling.n)
            self._submit_episodes(batch, sampling, version, epoch)
            return batch
        prompts = self._tokenize([self.dataset.items[i] for i in ids])
        batch = partial_samples.new_batch(index, ids, prompts, sampling.n, sampling.seed)
        self._submit_samples(batch, sampling, version, epoch)
        return batch

    def continue_partial(self, batch: PartialRollout | PartialEpisodes, version: int, epoch: int) -> None:
        """Submits a batch's unfinished samples again, after a weight sync: from where they stopped
        (``rollout.partial: continue``) or from scratch (``regenerate``)."""
        sampling = self._sampling(batch.index, version)
        if isinstance(batch, PartialEpisodes):
            self._submit_episodes(batch, sampling, version, epoch)
        else:
            self._submit_samples(batch, sampling, version, epoch, regenerate=self.cfg.rollout.partial == "regenerate")

    def _submit_episodes(self, batch: PartialEpisodes, sampling: SamplingConfig, version: int, epoch: int) -> None:
        if not self._streams_groups:
            partial_episodes.submit(batch, self.fleet.live_engines(), sampling, self.cfg, version, epoch)
            return
        partial_episodes.stream(batch, self.engines, sampling, self.cfg, version, epoch)
        # the environments scored each episode: taking the groups in is all that is left to do
        batch.taking = self._group_takers.submit(
            lambda: list(partial_episodes.take_groups(batch, self.cfg.trainer.step_timeout_s)))

    def _submit_samples(self, batch: PartialRollout, sampling: SamplingConfig, version: int, epoch: int,
                        regenerate: bool = False) -> None:
        if not self._streams_groups:
            partial_samples.submit(batch, self.fleet.live_engines(), sampling, version, epoch,
                                   regenerate=regenerate)
            return
        partial_samples.stream(batch, self.engines, sampling, version, epoch, self.cfg.rollout.max_num_seqs,
                                regenerate=regenerate)
        batch.taking = self._group_takers.submit(self._take_groups, batch)

    def _take_groups(self, batch: PartialRollout) -> None:
        """A streamed batch's groups taken in as they finish, each scored by the reward terms then
        (while the engines generate the others), unless a reward model's score is needed."""
        for g in partial_samples.take_groups(batch, self.cfg.trainer.step_timeout_s):
            if self.scoring.ahead:
                inputs = self._reward_inputs(batch.prompt_ids[g:g + 1], [[s.sample() for s in batch.group(g)]])
                batch.scored_groups[g] = (inputs, self.scoring.group(inputs))

    def collect_partial(self, batch: PartialRollout | PartialEpisodes) -> None:
        """Waits for a partial batch's generation in flight (all of it, or up to an interruption)."""
        if batch.taking is not None:
            taking, batch.taking = batch.taking, None
            taking.result()  # take_groups waits at most trainer.step_timeout_s
            return
        home = partial_episodes if isinstance(batch, PartialEpisodes) else partial_samples
        home.collect(batch, self.cfg.trainer.step_timeout_s, self.fleet)

    def interrupt(self, epoch: int) -> None:
        interrupt(list(self.fleet.live_engines().values()), epoch, self.cfg.trainer.collective_timeout_s)

    def assemble_partial(self, batch: PartialRollout | PartialEpisodes) -> Rollout:
        """A finished partial batch as a ``Rollout``; its version is its oldest token's."""
        if isinstance(batch, PartialEpisodes):
            n = batch.group_size
            groups = [[t.sample() for t in batch.episodes[i:i + n]] for i in range(0, len(batch.episodes), n)]
            rollout = self.assemble(batch.index, min(batch.versions), batch.prompt_ids, groups, list(batch.episodes))
            rollout.token_versions = partial_episodes.token_versions(batch)
            rollout.interrupted_episodes = batch.interruptions
            rollout.lost_episodes = batch.lost
            return rollout
        groups, versions = partial_samples.samples(batch)
        oldest = min(v for vs in versions for v in vs)
        scored = batch.scored_groups if len(batch.scored_groups) == len(groups) else {}  # all, as they came in
        rollout = self.assemble(batch.index, oldest, batch.prompt_ids, groups, reward_inputs=[
            x for g in sorted(scored) for x in scored[g][0]] if scored else None)
        rollout.token_versions = versions
        if scored:
            self.scoring.ahead_of_trainer(rollout, {g: terms for g, (_, terms) in scored.items()})
        return rollout

    def episode_batch(self, index: int, prompt_ids: list[int], group_size: int) -> PartialEpisodes:
        """Batch ``index``'s episodes as first submitted, none finished (a checkpoint's read-back)."""
        return partial_episodes.new_batch(index, prompt_ids, self._episode_requests(
            prompt_ids, self._sampling(index, None)), group_size)

    def _episode_requests(self, ids: list[int], sampling: SamplingConfig) -> list[EpisodeRequest]:
        return episode_requests([episode_item(self.dataset.items[i]) for i in ids], sampling, self.cfg)

    def collect(self, pending: PendingRollout) -> Rollout:
        """Waits for a submitted batch (``trainer.step_timeout_s``) and assembles it."""
        if pending.finished is not None:
            return pending.finished.result()  # the background thread waits with the same timeout
        return self._collect_and_score(pending)

    def _collect_and_score(self, pending: PendingRollout) -> Rollout:
        if pending.group_streams is not None:
            return self._collect_groups(pending)
        rollout = self._collect(pending)
        self.scoring.ahead_of_trainer(rollout)
        return rollout

    def _collect_groups(self, pending: PendingRollout) -> Rollout:
        """``rollout.granularity: group``: each group decoded and scored by the reward terms as it
        arrives, while the engines generate the rest; the batch in prompt order once all are in."""
        count = len(pending.prompt_ids)
        groups: list[list[RolloutSample] | None] = [None] * count
        trajectories: list[list[Trajectory] | None] = [None] * count  # multi-turn episodes: as they came
        inputs: list[list[RewardInput] | None] = [None] * count
        terms: dict[int, Scores] = {}
        arrivals = []
        for i, samples in groups_as_they_finish(pending.group_streams, self.cfg.trainer.step_timeout_s):
            arrivals.append(time.monotonic() - pending.submitted_at)
            if self.cfg.env is not None:  # the environments scored them
                trajectories[i], samples = samples, [t.sample() for t in samples]
            groups[i] = samples
            inputs[i] = self._reward_inputs(pending.prompt_ids[i:i + 1], [samples])
            if (scored := self.scoring.group(inputs[i])) is not None:
                terms[i] = scored
        episodes = None if self.cfg.env is None else [t for group in trajectories for t in group]
        rollout = self.assemble(pending.index, pending.version, pending.prompt_ids, groups, episodes,
                                reward_inputs=[x for group in inputs for x in group])
        rollout.group_arrival_s = (arrivals[0], arrivals[-1])
        self.scoring.ahead_of_trainer(rollout, terms)  # the groups' scores, in prompt order, then the penalties
        return rollout

    def _collect(self, pending: PendingRollout) -> Rollout:
        parts = self.fleet.wait(pending.calls, self.cfg.trainer.step_timeout_s, "generation")
        if self.cfg.env is None:
            groups = [g for part in parts for g in part]
            return self.assemble(pending.index, pending.version, pending.prompt_ids, groups)
        episodes = [t for part in parts for t in part]
        n = self.cfg.rollout.n
        groups = [[t.sample() for t in episodes[i:i + n]] for i in range(0, len(episodes), n)]
        return self.assemble(pending.index, pending.version, pending.prompt_ids, groups, episodes)

    def assemble(self, index: int, version: int, prompt_ids: list[int], groups: list[list[RolloutSample]],
                 episodes: list[Trajectory] | None = None, reward_inputs: list[RewardInput] | None = None) -> Rollout:
        """A batch from the engines' samples (fresh, or read back from a checkpoint); ``reward_inputs``:
        the samples' texts when they were decoded already (group by group, as they came in)."""
        batch = build_batch(groups, pad_id=self.pad_id, pad_to_multiple=8, temperature=self.cfg.rollout.temperature)
        if reward_inputs is None:
            reward_inputs = self._reward_inputs(prompt_ids, groups)
        return Rollout(batch, reward_inputs, index, version, prompt_ids, groups, episodes)

    def _reward_inputs(self, prompt_ids: list[int], groups: list[list[RolloutSample]]) -> list[RewardInput]:
        """What the reward terms read of each sample: texts, and the item's metadata (the answer)."""
        items = self.dataset.items
        with self._tokenizer_lock:
            return [RewardInput(prompt=self.tokenizer.decode(s.prompt_ids), metadata=items[pid].metadata,
                                response=self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                    for pid, group in zip(prompt_ids, groups, strict=True) for s in group]

    def score(self, rollout: Rollout, model_scores: torch.Tensor | None = None) -> Scores:
        return self.scoring.batch(rollout, model_scores)

    def turn_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor | None:
        return self.scoring.turn_rewards(rollout, scores)

    def state_dict(self) -> dict[str, Any]:
        """Where the prompt stream stands: a resumed run serves exactly the prompts that came next."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def _tokenize(self, items: list[PromptItem]) -> list[list[int]]:
        with self._tokenizer_lock:
            return tokenize_prompts(self.tokenizer, items, self.cfg.data.max_prompt_len, overlong="truncate_left").ids

    def _sampling(self, index: int, version: int | None) -> SamplingConfig:
        r = self.cfg.rollout
        return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                              n=r.n, stop_token_ids=[self.tokenizer.eos_token_id],
                              seed=self.cfg.seed * _SEED_STRIDE + index, weight_version=version)
