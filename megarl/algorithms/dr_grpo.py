"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): GRPO without its two biases.

Dividing by the group's std favours prompts whose rewards barely vary, and dividing each sequence's
loss by its own length shrinks the penalty on long wrong answers. Dr. GRPO keeps ``s_i - mean_g``
and sums each sequence's token losses over a constant (the generation budget, ``rollout.max_tokens``):
aggregation "seq-mean-token-sum". Defaults: ``norm_std=false``, ``aggregation=seq-mean-token-sum``
(``megarl.config.schema.ALGORITHM_DEFAULTS``); other values are refused, since they make it GRPO.
"""

from __future__ import annotations

from megarl.algorithms.advantages import grpo_advantages
from megarl.algorithms.base import Estimate, ScoredBatch
from megarl.algorithms.grpo import GRPO
from megarl.config.schema import AlgorithmConfig


class DrGRPO(GRPO):
    name = "dr_grpo"

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        errors = []
        if cfg.norm_std:
            errors.append("algorithm.norm_std=True: dr_grpo does not divide by the group's std (that is grpo)")
        if cfg.aggregation != "seq-mean-token-sum":
            errors.append(f"algorithm.aggregation={cfg.aggregation!r}: dr_grpo sums each sequence's token losses over "
                          "a constant length, seq-mean-token-sum")
        return errors

    def advantages(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        seq = batch.to_rows(grpo_advantages(batch.episode_scores, batch.group_size, norm_std=False))
        return Estimate(self.spread(seq, batch), batch.mask)
