"""GRPO (Shao et al. 2024, DeepSeekMath): each sample's score against its group's, no critic.

``A_i = (s_i - mean_g) / (std_g + eps)`` over the ``rollout.n`` samples of a prompt, the same on
every token of the response (:func:`~megarl.algorithms.advantages.grpo_advantages`); PPO's clipped
policy loss. ``algorithm.norm_std=false`` keeps only the mean (with "seq-mean-token-sum", that is
Dr. GRPO's recipe, also reachable as ``algorithm.name=dr_grpo``).
"""

from __future__ import annotations

from megarl.algorithms.advantages import group_std_scale, grpo_advantages
from megarl.algorithms.base import Algorithm, Estimate, ScoredBatch
from megarl.config.schema import AlgorithmConfig


class GRPO(Algorithm):
    name = "grpo"
    min_group_size = 2

    def advantages(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        # over the group's episodes; each row (an episode may train as several) gets its episode's
        scores = batch.episode_scores
        seq = batch.to_rows(grpo_advantages(scores, batch.group_size, norm_std=bool(cfg.norm_std)))
        scale = batch.to_rows(group_std_scale(scores, batch.group_size)) if cfg.norm_std else 1.0
        return Estimate(self.spread(seq, batch, scale), batch.mask)
