"""PPO (Schulman et al. 2017) with a critic: GAE advantages, whitened, and the critic's returns.

Rewards per token as REINFORCE++'s (score on the last token, KL to the reference with
``kl_in_reward``); ``A = whiten(GAE(rewards, values; gamma, lam))`` and the critic regresses
``R = GAE + V`` (:meth:`Algorithm.value_loss`). Needs a critic role.
"""

from __future__ import annotations

from megarl.algorithms.advantages import gae
from megarl.algorithms.base import Algorithm, Estimate, ScoredBatch, token_level_rewards
from megarl.algorithms.masked import whiten
from megarl.config.schema import AlgorithmConfig


class PPO(Algorithm):
    name = "ppo"
    needs_critic = True
    per_token_rewards = True

    def advantages(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        if batch.values is None:
            raise ValueError("PPO needs critic values")
        rewards = token_level_rewards(cfg, batch)
        advantages, returns = gae(rewards, batch.values, batch.mask, gamma=cfg.gamma, lam=cfg.lam)
        return Estimate(whiten(advantages, batch.mask) * batch.mask, batch.mask, returns)
