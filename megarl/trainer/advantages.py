"""From scores and log-probabilities to advantages (and PPO returns), per algorithm.

Pure: tensors in, tensors out (see ``megarl.algorithms``). GRPO and RLOO use the
sequence score; REINFORCE++ and PPO put it on the last token and, with
``kl_in_reward``, subtract the per-token KL to the reference (k1) first.
"""

from __future__ import annotations

import torch

from megarl.algorithms import (
    broadcast,
    dynamic_sampling_mask,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)
from megarl.config.schema import AlgorithmConfig

ALGORITHMS = ("grpo", "rloo", "reinforce_pp", "ppo")


def needs_old_logprobs(algo: AlgorithmConfig) -> bool:
    """Whether the step scores the rollout under the actor before updating it. Not when the update
    is one optimizer step over the whole batch (it is on-policy: its own forward is the behaviour
    policy's) unless the reward needs the actor-reference KL first."""
    return algo.ppo_epochs > 1 or algo.minibatches > 1 or algo.kl_in_reward


def estimate(algo: AlgorithmConfig, scores: torch.Tensor, mask: torch.Tensor, group_size: int,
             old: dict[str, torch.Tensor] | None, ref_logprobs: torch.Tensor | None = None,
             values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Returns ``advantages`` [B, T], the (possibly reduced) ``mask``, and ``returns`` for PPO.
    ``old`` (the actor's ``logprobs`` before the update) is needed for KL in the reward only."""
    out: dict[str, torch.Tensor] = {}
    if algo.dynamic_sampling:
        keep, _ = dynamic_sampling_mask(scores, group_size)
        mask = mask * keep.to(mask.dtype).unsqueeze(1)  # groups with one reward teach nothing
    out["mask"] = mask
    kl = None
    if algo.kl_in_reward and ref_logprobs is not None:
        if old is None:
            raise ValueError("algorithm.kl_in_reward needs the actor's log-probs before the update")
        # where, not * mask: garbage log-probs at padding would survive as NaN (NaN * 0)
        kl = torch.where(mask != 0, kl_estimate(old["logprobs"], ref_logprobs, estimator="k1"), 0.0)
    if algo.name == "grpo":
        out["advantages"] = broadcast(grpo_advantages(scores, group_size, norm_std=algo.norm_std), mask)
    elif algo.name == "rloo":
        out["advantages"] = broadcast(rloo_advantages(scores, group_size), mask)
    elif algo.name in ("reinforce_pp", "ppo"):
        beta = algo.kl_coef if (algo.kl_in_reward and kl is not None) else 0.0
        rewards = token_rewards(scores, mask, kl_per_token=kl if beta else None, beta=beta)
        if algo.name == "reinforce_pp":
            out["advantages"] = reinforce_pp_advantages(rewards, mask, gamma=algo.gamma)
        else:
            if values is None:
                raise ValueError("PPO needs critic values")
            advantages, returns = gae(rewards, values, mask, gamma=algo.gamma, lam=algo.lam)
            out["advantages"] = whiten(advantages, mask) * mask
            out["returns"] = returns
    else:
        raise ValueError(f"algorithm.name={algo.name!r} must be one of {', '.join(ALGORITHMS)}")
    return out


def kl_mean(kl: torch.Tensor | None, mask: torch.Tensor) -> float:
    return float(masked_mean(kl, mask)) if kl is not None else 0.0
