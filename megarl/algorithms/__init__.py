"""RL algorithms as pure tensor functions: advantages, losses, KL estimators, filters.

No megatron, no torch.distributed, no global state: tensors in, tensors out.
Conventions (see :mod:`megarl.algorithms.masked`): token tensors ``[B, T]``,
``mask`` ``[B, T]`` of valid right-padded response tokens, per-sequence scalars ``[B]``,
group samples of one prompt consecutive.
"""

from megarl.algorithms.advantages import (
    broadcast,
    discounted_returns,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
)
from megarl.algorithms.filters import dynamic_sampling_mask, overlong_penalty
from megarl.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_estimate, kl_reward_penalty
from megarl.algorithms.losses import entropy_loss, kl_loss, policy_loss, value_loss
from megarl.algorithms.masked import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate,
    masked_mean,
    masked_sum,
    masked_var,
    whiten,
)

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "AggregationMode",
    "KLEstimator",
    "aggregate",
    "broadcast",
    "discounted_returns",
    "dynamic_sampling_mask",
    "entropy_loss",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_rewards",
    "value_loss",
    "whiten",
]
