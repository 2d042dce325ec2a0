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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from megarl.config.schema import RunConfig
from megarl.data.dataset import PromptDataset
from megarl.data.prompts import PromptItem
from megarl.data.tokenize import tokenize_prompts
from megarl.rewards.base import RewardInput
from megarl.rewards.combined import RunReward
from megarl.rollout.episodes import EpisodeRequest, Trajectory
from megarl.rollout.remote import episode_item, episode_requests
from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.rollout_driver import partial_episodes, partial_samples, whole_samples
from megarl.rollout_driver.batch import Rollout, build_batch, rows_multiple
from megarl.rollout_driver.fleet import EngineFleet
from megarl.rollout_driver.inflight import InFlight, interrupt
from megarl.rollout_driver.partial_samples import Segments, Slot
from megarl.rollout_driver.scoring import RewardTexts, Scores, Scoring

# Sampling seeds: one per step, distinct across steps and runs with different seeds.
_SEED_STRIDE = 100_003


class RolloutManager:
    def __init__(self, cfg: RunConfig, engines: list, tokenizer: Any, dataset: PromptDataset[PromptItem],
                 reward: RunReward):
        self.cfg, self.engines, self.tokenizer = cfg, engines, tokenizer
        self.dataset, self.reward = dataset, reward
        # which engines serve; calls that survive an engine's fault (rollout.max_engine_restarts)
        self.fleet = EngineFleet(engines, cfg.rollout.request_timeout_s)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._ahead: ThreadPoolExecutor | None = None
        # The Rust tokenizer refuses a call from a second thread while one is in it (the
        # background thread decodes a finished batch while the next batch's prompts are tokenized)
        self._tokenizer_lock = threading.Lock()
        # every score of a batch comes from it, and every text the reward terms read
        self.scoring = Scoring(cfg, reward, RewardTexts(tokenizer, dataset, self._tokenizer_lock))
        # What a batch is, decided once: the unit kind (env: episodes; the opportunistic schedule:
        # interruptible segments; else whole samples) and the transport (rollout.granularity: whole
        # calls, or group streams, taken in by a thread per batch in flight, k + 1 at most, that
        # scores each group as it finishes while the engines generate the others)
        self.interruptible = cfg.trainer.schedule == "opportunistic"
        self.streaming = cfg.rollout.granularity == "group"
        self._group_takers = (ThreadPoolExecutor(max_workers=cfg.trainer.max_staleness + 1,
                                                 thread_name_prefix="megarl-group-taker")
                              if self.streaming else None)

    def finish_ahead(self) -> None:
        """From now on each batch of the exact schedule is collected, assembled and scored by the
        reward terms in a background thread as soon as the engines return it, while the trainer
        works on an earlier one (the rollout service does this; ``finish`` then only waits for it)."""
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-rollout-ahead")

    @property
    def needs_reward_model(self) -> bool:
        return self.reward.needs_model

    def submit(self, index: int, version: int, epoch: int | None = None) -> InFlight:
        """Draws batch ``index``'s prompts and asks for ``rollout.n`` responses to each (of the
        config's unit kind, by its transport); returns at once. The engines refuse if their weights
        are not ``version`` (the fence against generating with weights other than the ones
        recorded); ``epoch``: the interruptible calls' epoch (the opportunistic schedule)."""
        ids = self.dataset.next_ids()
        batch = self._new_batch(index, ids, None if self.interruptible else version)
        self.send(batch, version, epoch)
        if self._ahead is not None and not self.interruptible:
            batch.ready = self._ahead.submit(self._finish, batch)
        return batch

    def _new_batch(self, index: int, ids: list[int], version: int | None) -> InFlight:
        n, r = self.cfg.rollout.n, self.cfg.rollout
        if self.cfg.env is not None:
            return partial_episodes.new_batch(index, ids, self._episode_requests(ids, self._sampling(index, version)),
                                              n, self.cfg, interruptible=self.interruptible, version=version)
        prompts = self._tokenize([self.dataset.items[i] for i in ids])
        if self.interruptible:
            return partial_samples.new_batch(index, ids, prompts, n, self._sampling(index, version).seed,
                                             regenerate=r.partial == "regenerate", max_num_seqs=r.max_num_seqs)
        return whole_samples.new_batch(index, ids, prompts, n, version, max_num_seqs=r.max_num_seqs)

    def send(self, batch: InFlight, version: int, epoch: int | None = None) -> None:
        """Asks the engines for every unit of ``batch`` not finished yet, sampled with weight version
        ``version``: a batch's first submission, or after a weight sync an interrupted batch's rest
        (from where each unit stopped, or from scratch: ``rollout.partial``). Returns at once."""
        sampling = self._sampling(batch.index, version)
        if self.streaming:
            batch.units.stream(batch, self.engines, sampling, version, epoch)
            batch.taking = self._group_takers.submit(self._take_groups, batch)
        else:
            batch.units.submit(batch, self.fleet, sampling, version, epoch)

    def _take_groups(self, batch: InFlight) -> None:
        """A streamed batch's groups taken in as they finish, each scored then where it can be."""
        for g in batch.units.take_groups(batch, self.cfg.trainer.step_timeout_s):
            batch.arrivals.append(time.monotonic() - batch.submitted_at)
            if (scored := self.scoring.group(batch.prompt_ids[g], batch.units.group_samples(g))) is not None:
                batch.scored_groups[g] = scored

    def collect(self, batch: InFlight) -> None:
        """Waits for a batch's generation in flight (all of it, or up to an interruption)."""
        if batch.taking is not None:
            taking, batch.taking = batch.taking, None
            taking.result()  # take_groups waits at most trainer.step_timeout_s
            return
        batch.units.collect(batch, self.cfg.trainer.step_timeout_s, self.fleet)

    def interrupt(self, epoch: int) -> None:
        interrupt(list(self.fleet.live_engines().values()), epoch, self.cfg.trainer.collective_timeout_s)

    def finish(self, batch: InFlight, version: int | None = None, epoch: int | None = None) -> Rollout:
        """The batch generated to its end, assembled and scored: what is left of an interrupted one
        generates under ``version`` (``epoch``), nothing interrupting it; a batch of the exact
        schedule is waited for (``trainer.step_timeout_s``)."""
        if batch.ready is not None:
            return batch.ready.result()  # the background thread waits with the same timeout
        return self._finish(batch, version, epoch)

    def _finish(self, batch: InFlight, version: int | None = None, epoch: int | None = None) -> Rollout:
        while True:
            if batch.in_flight:
                self.collect(batch)
            if batch.finished:
                return self.assemble_batch(batch)
            self.send(batch, version, epoch)

    def assemble_batch(self, batch: InFlight) -> Rollout:
        """A finished batch as a ``Rollout``, scored where nothing of the trainer's is needed; its
        version is the one it was submitted against, or (interruptible) its oldest token's."""
        groups, episodes = batch.units.groups()
        version = batch.version if batch.version is not None else batch.units.oldest_version(batch)
        rollout = self.assemble(batch.index, version, batch.prompt_ids, groups, episodes,
                                reward_inputs=self.scoring.inputs(batch.prompt_ids, groups, batch.scored_groups))
        batch.units.annotate(rollout)
        if batch.arrivals and batch.version is not None:
            rollout.group_arrival_s = (batch.arrivals[0], batch.arrivals[-1])
        self.scoring.ahead_of_trainer(rollout, batch.scored_groups)
        return rollout

    def episode_batch(self, index: int, prompt_ids: list[int], group_size: int) -> InFlight:
        """Batch ``index``'s episodes as first submitted, none finished (a checkpoint's read-back)."""
        return partial_episodes.new_batch(index, prompt_ids, self._episode_requests(
            prompt_ids, self._sampling(index, None)), group_size, self.cfg, interruptible=True)

    def segment_batch(self, index: int, prompt_ids: list[int], group_size: int, slots: list[Slot]) -> InFlight:
        """An interrupted batch of samples, each as far as it got (a checkpoint's read-back)."""
        r = self.cfg.rollout
        return InFlight(index, list(prompt_ids), group_size,
                        Segments(slots, group_size, r.partial == "regenerate", r.max_num_seqs))

    def _episode_requests(self, ids: list[int], sampling: SamplingConfig) -> list[EpisodeRequest]:
        return episode_requests([episode_item(self.dataset.items[i]) for i in ids], sampling, self.cfg)

    def assemble(self, index: int, version: int, prompt_ids: list[int], groups: list[list[RolloutSample]],
                 episodes: list[Trajectory] | None = None, reward_inputs: list[RewardInput] | None = None) -> Rollout:
        """A batch from the engines' samples (fresh, or read back from a checkpoint); ``reward_inputs``:
        the samples' texts when they were decoded already (group by group, as they came in)."""
        batch = build_batch(groups, pad_id=self.pad_id, pad_to_multiple=8, temperature=self.cfg.rollout.temperature,
                            episodes=episodes, rows_multiple=rows_multiple(self.cfg))
        if reward_inputs is None:
            reward_inputs = self.scoring.texts(prompt_ids, groups)
        return Rollout(batch, reward_inputs, index, version, prompt_ids, groups, episodes)

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
