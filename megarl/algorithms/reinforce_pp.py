"""REINFORCE++ (Hu 2025): per-token return-to-go, whitened over the whole batch, no critic.

The score sits on the last response token (minus the KL to the reference on every token with
``kl_in_reward``); ``A_t`` is the discounted return-to-go, normalised over all valid tokens of the
batch (:func:`~megarl.algorithms.advantages.reinforce_pp_advantages`); PPO's clipped policy loss.
Works with one sample per prompt.
"""

from __future__ import annotations

from megarl.algorithms.advantages import reinforce_pp_advantages
from megarl.algorithms.base import Algorithm, Estimate, ScoredBatch, token_level_rewards
from megarl.config.schema import AlgorithmConfig


class ReinforcePP(Algorithm):
    name = "reinforce_pp"
    per_token_rewards = True

    def advantages(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        rewards = token_level_rewards(cfg, batch)
        return Estimate(reinforce_pp_advantages(rewards, batch.mask, gamma=cfg.gamma), batch.mask)
