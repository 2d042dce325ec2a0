"""Every score of a rollout, in one place: the reward terms on a group as it comes in, a batch's
scores (the environments', the terms', or a reward model's through the terms), the overlong
penalty, and each turn's reward for per-turn credit.

The batch's in-flight kinds only say when a group is ready; what it scores, and how the groups'
scores make a batch's, is decided here, so the rollout service (ahead of the trainer) and the
driver (a reward model's score, a term that needs the main thread) give the same numbers.
"""

from __future__ import annotations

import torch

from megarl.algorithms import overlong_penalty
from megarl.config.schema import RunConfig
from megarl.rewards.base import RewardInput
from megarl.rewards.combined import RunReward
from megarl.rollout_driver.batch import Rollout, turn_reward_tensor

Scores = tuple[torch.Tensor, dict[str, torch.Tensor]]  # every sample's reward [B], each term's values


class Scoring:
    def __init__(self, cfg: RunConfig, reward: RunReward):
        self.cfg, self.reward = cfg, reward

    @property
    def needs_model(self) -> bool:
        return self.reward.needs_model

    @property
    def ahead(self) -> bool:
        """Whether a batch is scored as it comes in: by the reward terms alone, off the main thread."""
        return not self.reward.needs_model and not self.reward.needs_main_thread

    def group(self, inputs: list[RewardInput]) -> Scores | None:
        """One group's reward terms as it comes in (None: it waits for the batch's scoring, which
        needs a reward model or the main thread, or the environments scored it)."""
        if not self.ahead or self.cfg.env is not None:
            return None
        return self.reward.score(inputs)

    def batch(self, rollout: Rollout, model_scores: torch.Tensor | None = None,
              groups: dict[int, Scores] | None = None) -> Scores:
        """The reward of every sample [B], and each term's values for the logs (the reward terms'
        own, when the batch was scored as it came in and no reward model's score is given).
        ``groups``: every group's terms by its index in the batch, scored as the groups came in."""
        if rollout.scored is not None and model_scores is None:
            return rollout.scored
        if rollout.episodes is not None:  # the environments scored their episodes
            scores = torch.tensor([t.reward for t in rollout.episodes], dtype=torch.float32)
            parts = {"reward/env": scores}
        elif groups:
            scores, parts = _in_order(groups)
        else:
            scores, parts = self.reward.score(rollout.reward_inputs, model_scores)
        algo = self.cfg.algorithm
        if algo.overlong_buffer > 0:
            penalty = overlong_penalty(rollout.batch.response_lens, self.cfg.rollout.max_tokens,
                                       algo.overlong_buffer, algo.overlong_penalty)
            scores = scores + penalty
            parts["reward/overlong_penalty"] = penalty
        return scores, parts

    def ahead_of_trainer(self, rollout: Rollout, groups: dict[int, Scores] | None = None) -> None:
        """Scores a batch where it was assembled, when nothing of the trainer's is needed."""
        if self.ahead:
            rollout.scored = self.batch(rollout, groups=groups)

    def turn_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor | None:
        """Each turn's reward on its last token (``env.credit: turn``), rows summing to ``scores``;
        None when every policy token of an episode is credited with the whole episode."""
        if rollout.episodes is None or self.cfg.env is None or self.cfg.env.credit != "turn":
            return None
        episodes = rollout.episodes
        return turn_reward_tensor([t.turns for t in episodes], [t.observations for t in episodes],
                                  [t.turn_rewards for t in episodes], rollout.batch, scores)


def _in_order(groups: dict[int, Scores]) -> Scores:
    """Groups' (sum, values per term) scored in arrival order, as one batch's in prompt order."""
    ordered = [groups[g] for g in sorted(groups)]
    return (torch.cat([total for total, _ in ordered]),
            {name: torch.cat([parts[name] for _, parts in ordered]) for name in ordered[0][1]})
