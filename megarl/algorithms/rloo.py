"""RLOO (Ahmadian et al. 2024): REINFORCE with each sample's leave-one-out baseline, no critic.

``A_i = s_i - mean_{j != i} s_j`` over the samples of a prompt, on every token of the response
(:func:`~megarl.algorithms.advantages.rloo_advantages`); PPO's clipped policy loss.
"""

from __future__ import annotations

from megarl.algorithms.advantages import rloo_advantages
from megarl.algorithms.base import Algorithm, Estimate, ScoredBatch
from megarl.config.schema import AlgorithmConfig


class RLOO(Algorithm):
    name = "rloo"
    min_group_size = 2

    def advantages(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        seq = batch.to_rows(rloo_advantages(batch.episode_scores, batch.group_size))  # episodes compared
        return Estimate(self.spread(seq, batch), batch.mask)
