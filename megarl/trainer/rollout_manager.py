"""The rollout side of a step: prompts in, scored samples out.

``RolloutManager`` owns what generation needs and training does not: the prompt
stream (and its position, which checkpoints save), the tokenizer, the engines'
handles and the reward terms. It knows nothing of Megatron roles or of who holds
the device: a reward-model score is passed in, and the colocation hand-overs
happen around its calls (``megarl.trainer.colocation``). This is the piece that
runs ahead of training once rollout is asynchronous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.algorithms import overlong_penalty
from megarl.config.schema import RunConfig
from megarl.data.dataset import PromptDataset
from megarl.data.prompts import PromptItem
from megarl.data.tokenize import tokenize_prompts
from megarl.rewards.base import RewardInput
from megarl.rollout.episodes import Trajectory
from megarl.rollout.remote import episode_item, submit_episodes, submit_generation
from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.trainer import partial_rollouts
from megarl.trainer.batch import RolloutBatch, build_batch, turn_reward_tensor
from megarl.trainer.partial_rollouts import PartialRollout
from megarl.trainer.rewards import RunReward
from megarl.utils.abort import wait_all

# Sampling seeds: one per step, distinct across steps and runs with different seeds.
_SEED_STRIDE = 100_003


@dataclass
class Rollout:
    """One batch of samples: what the roles score and train on, the texts rewards read, and
    where it came from (which prompts, which weights)."""

    batch: RolloutBatch
    reward_inputs: list[RewardInput]
    index: int  # the batch's number in the run: step ``index`` trains on it
    version: int  # the policy weight version that generated every token (0: the initial weights)
    prompt_ids: list[int]  # the prompts' indices in the dataset, for accounting across resumes
    groups: list[list[RolloutSample]]  # the engines' samples, as a checkpoint stores them
    # Multi-turn runs (``env``): each sample's episode, in sample order; its environment rewards
    # are the samples' scores. None: single-turn, scored by the reward terms.
    episodes: list[Trajectory] | None = None
    # Partial rollouts (trainer.schedule: opportunistic): each sample's per-token weight versions
    # (``version`` is the oldest of them). None: every token is ``version``'s.
    token_versions: list[list[int]] | None = None


@dataclass
class PendingRollout:
    """A batch the engines are generating: the calls to wait on, and what to assemble it with."""

    index: int
    version: int
    prompt_ids: list[int]
    calls: list  # Ray object refs, one per engine, in engine order


class RolloutManager:
    def __init__(self, cfg: RunConfig, engines: list, tokenizer: Any, dataset: PromptDataset[PromptItem],
                 reward: RunReward):
        self.cfg, self.engines, self.tokenizer = cfg, engines, tokenizer
        self.dataset, self.reward = dataset, reward
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

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
        if self.cfg.env is not None:
            calls = submit_episodes(self.engines, [episode_item(item) for item in items], sampling, self.cfg)
        else:
            prompts = tokenize_prompts(self.tokenizer, items, self.cfg.data.max_prompt_len,
                                       overlong="truncate_left").ids
            calls = submit_generation(self.engines, prompts, sampling)
        return PendingRollout(index, version, ids, calls)

    def submit_partial(self, index: int, version: int, epoch: int) -> PartialRollout:
        """Like ``submit``, as interruptible segments (``trainer.schedule: opportunistic``)."""
        ids = self.dataset.next_ids()
        prompts = tokenize_prompts(self.tokenizer, [self.dataset.items[i] for i in ids], self.cfg.data.max_prompt_len,
                                   overlong="truncate_left").ids
        sampling = self._sampling(index, version)
        batch = partial_rollouts.new_batch(index, ids, prompts, sampling.n, sampling.seed)
        partial_rollouts.submit(batch, self.engines, sampling, version, epoch)
        return batch

    def continue_partial(self, batch: PartialRollout, version: int, epoch: int) -> None:
        """Submits a batch's unfinished samples again, after a weight sync: from where they stopped
        (``rollout.partial: continue``) or from scratch (``regenerate``)."""
        partial_rollouts.submit(batch, self.engines, self._sampling(batch.index, version), version, epoch,
                                regenerate=self.cfg.rollout.partial == "regenerate")

    def collect_partial(self, batch: PartialRollout) -> None:
        partial_rollouts.collect(batch, self.cfg.trainer.step_timeout_s)

    def interrupt(self, epoch: int) -> None:
        partial_rollouts.interrupt(self.engines, epoch, self.cfg.trainer.collective_timeout_s)

    def assemble_partial(self, batch: PartialRollout) -> Rollout:
        """A finished partial batch as a ``Rollout``; its version is its oldest token's."""
        groups, versions = partial_rollouts.samples(batch)
        oldest = min(v for vs in versions for v in vs)
        rollout = self.assemble(batch.index, oldest, batch.prompt_ids, groups)
        rollout.token_versions = versions
        return rollout

    def collect(self, pending: PendingRollout) -> Rollout:
        """Waits for a submitted batch (``trainer.step_timeout_s``) and assembles it."""
        parts = wait_all(pending.calls, self.cfg.trainer.step_timeout_s, "generation")
        if self.cfg.env is None:
            groups = [g for part in parts for g in part]
            return self.assemble(pending.index, pending.version, pending.prompt_ids, groups)
        episodes = [t for part in parts for t in part]
        n = self.cfg.rollout.n
        groups = [[t.sample() for t in episodes[i:i + n]] for i in range(0, len(episodes), n)]
        return self.assemble(pending.index, pending.version, pending.prompt_ids, groups, episodes)

    def assemble(self, index: int, version: int, prompt_ids: list[int], groups: list[list[RolloutSample]],
                 episodes: list[Trajectory] | None = None) -> Rollout:
        """A batch from the engines' samples (fresh, or read back from a checkpoint)."""
        batch = build_batch(groups, pad_id=self.pad_id, pad_to_multiple=8, temperature=self.cfg.rollout.temperature)
        inputs = [RewardInput(prompt=self.tokenizer.decode(s.prompt_ids), metadata=self.dataset.items[pid].metadata,
                              response=self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                  for pid, group in zip(prompt_ids, groups, strict=True) for s in group]
        return Rollout(batch, inputs, index, version, prompt_ids, groups, episodes)

    def score(self, rollout: Rollout, model_scores: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The reward of every sample [B], and each term's values for the logs."""
        if rollout.episodes is not None:  # the environments scored their episodes
            scores = torch.tensor([t.reward for t in rollout.episodes], dtype=torch.float32)
            parts = {"reward/env": scores}
        else:
            scores, parts = self.reward.score(rollout.reward_inputs, model_scores)
        algo = self.cfg.algorithm
        if algo.overlong_buffer > 0:
            penalty = overlong_penalty(rollout.batch.response_lens, self.cfg.rollout.max_tokens,
                                       algo.overlong_buffer, algo.overlong_penalty)
            scores = scores + penalty
            parts["reward/overlong_penalty"] = penalty
        return scores, parts

    def turn_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor | None:
        """Each turn's reward on its last token (``env.credit: turn``), rows summing to ``scores``;
        None when every policy token of an episode is credited with the whole episode."""
        if rollout.episodes is None or self.cfg.env is None or self.cfg.env.credit != "turn":
            return None
        episodes = rollout.episodes
        return turn_reward_tensor([t.turns for t in episodes], [t.observations for t in episodes],
                                  [t.turn_rewards for t in episodes], rollout.batch, scores)

    def state_dict(self) -> dict[str, Any]:
        """Where the prompt stream stands: a resumed run serves exactly the prompts that came next."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def _sampling(self, index: int, version: int) -> SamplingConfig:
        r = self.cfg.rollout
        return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                              n=r.n, stop_token_ids=[self.tokenizer.eos_token_id],
                              seed=self.cfg.seed * _SEED_STRIDE + index, weight_version=version)
