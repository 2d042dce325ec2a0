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
from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.trainer.batch import RolloutBatch, build_batch
from megarl.trainer.rewards import RunReward
from megarl.utils.abort import wait_all

# Sampling seeds: one per step, distinct across steps and runs with different seeds.
_SEED_STRIDE = 100_003


@dataclass
class Rollout:
    """One step's samples: the batch the roles score and train on, and the texts rewards read."""

    batch: RolloutBatch
    reward_inputs: list[RewardInput]


class RolloutManager:
    def __init__(self, cfg: RunConfig, engines: list, tokenizer: Any, dataset: PromptDataset[PromptItem],
                 reward: RunReward):
        self.cfg, self.engines, self.tokenizer = cfg, engines, tokenizer
        self.dataset, self.reward = dataset, reward
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @property
    def needs_reward_model(self) -> bool:
        return self.reward.needs_model

    def generate(self, step: int) -> Rollout:
        """``rollout.n`` responses to each of the step's prompts, the prompts split over the engines."""
        items = self.dataset.next_batch()
        prompts = tokenize_prompts(self.tokenizer, items, self.cfg.data.max_prompt_len, overlong="truncate_left").ids
        groups = self._sample(prompts, self._sampling(step))
        batch = build_batch(groups, pad_id=self.pad_id, pad_to_multiple=8, temperature=self.cfg.rollout.temperature)
        inputs = [RewardInput(prompt=self.tokenizer.decode(s.prompt_ids), metadata=items[i].metadata,
                              response=self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                  for i, group in enumerate(groups) for s in group]
        return Rollout(batch, inputs)

    def score(self, rollout: Rollout, model_scores: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The reward of every sample [B], and each term's values for the logs."""
        scores, parts = self.reward.score(rollout.reward_inputs, model_scores)
        algo = self.cfg.algorithm
        if algo.overlong_buffer > 0:
            penalty = overlong_penalty(rollout.batch.response_lens, self.cfg.rollout.max_tokens,
                                       algo.overlong_buffer, algo.overlong_penalty)
            scores = scores + penalty
            parts["reward/overlong_penalty"] = penalty
        return scores, parts

    def state_dict(self) -> dict[str, Any]:
        """Where the prompt stream stands: a resumed run serves exactly the prompts that came next."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def _sampling(self, step: int) -> SamplingConfig:
        r = self.cfg.rollout
        return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                              n=r.n, stop_token_ids=[self.tokenizer.eos_token_id],
                              seed=self.cfg.seed * _SEED_STRIDE + step)

    def _sample(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        share = -(-len(prompts) // len(self.engines))
        parts = [prompts[i * share:(i + 1) * share] for i in range(len(self.engines))]
        calls = [e.generate.remote(p, sampling) for e, p in zip(self.engines, parts, strict=True) if p]
        return [g for part in wait_all(calls, self.cfg.trainer.step_timeout_s, "generation") for g in part]
