"""Every score of a rollout, in one place: what the reward terms read of a sample, the reward
terms on a group as it comes in, a batch's scores (the environments', the terms', or a reward
model's through the terms), the overlong penalty, and each turn's reward for per-turn credit.

The in-flight batch (``megarl.rollout_driver.inflight``) only says when a group or a batch is
ready; whether it is scored then, what it scores, and how the groups' scores make a batch's, is
decided here, so the rollout service (ahead of the trainer) and the driver (a reward model's
score, a term that needs the main thread) give the same numbers.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from megarl.algorithms import overlong_penalty
from megarl.config.schema import RunConfig
from megarl.rewards.base import RewardInput
from megarl.rewards.combined import RunReward
from megarl.rollout.episodes import Trajectory
from megarl.rollout.sampling import RolloutSample
from megarl.rollout_driver.batch import Rollout, episode_rows, turn_reward_tensor

Scores = tuple[torch.Tensor, dict[str, torch.Tensor]]  # every sample's reward [B], each term's values
GroupScore = tuple[list[RewardInput], Scores]  # a group scored as it came in: its texts and scores


class RewardTexts:
    """What the reward terms read of each sample: texts, and the item's metadata (the answer)."""

    def __init__(self, tokenizer: Any, dataset: Any, lock: threading.Lock):
        # the lock: the Rust tokenizer refuses a call from a second thread while one is in it
        self.tokenizer, self.dataset, self.lock = tokenizer, dataset, lock

    def __call__(self, prompt_ids: list[int], groups: list[list[RolloutSample]]) -> list[RewardInput]:
        items = self.dataset.items
        with self.lock:
            return [RewardInput(prompt=self.tokenizer.decode(s.prompt_ids), metadata=items[pid].metadata,
                                response=self.tokenizer.decode(s.response_ids, skip_special_tokens=True))
                    for pid, group in zip(prompt_ids, groups, strict=True) for s in group]


class Scoring:
    def __init__(self, cfg: RunConfig, reward: RunReward, texts: RewardTexts | None = None):
        """``texts``: where samples are decoded (the rollout manager); without it, only batches
        that carry their reward inputs are scored (the driver's side)."""
        self.cfg, self.reward, self.texts = cfg, reward, texts

    @property
    def needs_model(self) -> bool:
        return self.reward.needs_model

    @property
    def ahead(self) -> bool:
        """Whether a batch is scored as it comes in: by the reward terms alone, off the main thread."""
        return not self.reward.needs_model and not self.reward.needs_main_thread

    def group(self, prompt_id: int, samples: list[RolloutSample]) -> GroupScore | None:
        """One group's texts and reward terms as it comes in, while the engines generate the
        others (None: it waits for the batch's scoring, which needs a reward model or the main
        thread, or the environments scored it)."""
        if not self.ahead or self.cfg.env is not None:
            return None
        inputs = self.texts([prompt_id], [samples])
        return inputs, self.reward.score(inputs)

    def inputs(self, prompt_ids: list[int], groups: list[list[RolloutSample]],
               scored: dict[int, GroupScore] | None = None) -> list[RewardInput]:
        """A batch's reward inputs: those of its groups scored as they came in, when every group
        was, else decoded now."""
        if scored and len(scored) == len(groups):
            return [x for g in sorted(scored) for x in scored[g][0]]
        return self.texts(prompt_ids, groups)

    def batch(self, rollout: Rollout, model_scores: torch.Tensor | None = None,
              groups: dict[int, Scores] | None = None) -> Scores:
        """The reward of every sample [B], and each term's values for the logs (the reward terms'
        own, when the batch was scored as it came in and no reward model's score is given).
        ``groups``: every group's terms by its index in the batch, scored as the groups came in."""
        if rollout.scored is not None and model_scores is None:
            return rollout.scored
        episode_of = rollout.batch.episode_of  # an episode that trains as several rows: each row its reward
        if rollout.episodes is not None:  # the environments scored their episodes
            scores = torch.tensor([t.reward for t in rollout.episodes], dtype=torch.float32)
            scores = scores if episode_of is None else scores[episode_of]
            parts = {"reward/env": scores}
        elif groups:
            scores, parts = _in_order(groups)
        else:
            scores, parts = self.reward.score(rollout.reward_inputs, model_scores)
        algo = self.cfg.algorithm
        if algo.overlong_buffer > 0:
            penalty = overlong_penalty(rollout.batch.response_lens, self.cfg.rollout.max_tokens,
                                       algo.overlong_buffer, algo.overlong_penalty)
            if episode_of is not None:  # an episode's reward is one: its longest part's penalty on every row
                worst = torch.zeros(int(episode_of.max()) + 1).scatter_reduce(0, episode_of, penalty, "amin")
                penalty = worst[episode_of]
            scores = scores + penalty
            parts["reward/overlong_penalty"] = penalty
        return scores, parts

    def ahead_of_trainer(self, rollout: Rollout, scored: dict[int, GroupScore] | None = None) -> None:
        """Scores a batch where it was assembled, when nothing of the trainer's is needed: from
        its groups' scores (``scored``, every group's) in prompt order, else as a whole."""
        if self.ahead:
            groups = {g: terms for g, (_, terms) in scored.items()} if scored and len(scored) == len(rollout.groups) \
                else None
            rollout.scored = self.batch(rollout, groups=groups)

    def turn_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor | None:
        """Each turn's reward on its last token (``env.credit: turn``), rows summing to ``scores``;
        None when every policy token of an episode is credited with the whole episode."""
        if rollout.episodes is None or self.cfg.env is None or self.cfg.env.credit != "turn":
            return None
        rows = rollout.episodes
        if rollout.batch.episode_of is not None:  # each part of a split episode a row; padding rows train nothing
            rows, _ = episode_rows(rows)
            rows += [Trajectory([], [], [], [], "", 0.0)] * (rollout.batch.size - len(rows))
        return turn_reward_tensor([t.turns for t in rows], [t.observations for t in rows],
                                  [t.turn_rewards for t in rows], rollout.batch, scores)


def _in_order(groups: dict[int, Scores]) -> Scores:
    """Groups' (sum, values per term) scored in arrival order, as one batch's in prompt order."""
    ordered = [groups[g] for g in sorted(groups)]
    return (torch.cat([total for total, _ in ordered]),
            {name: torch.cat([parts[name] for _, parts in ordered]) for name in ordered[0][1]})
