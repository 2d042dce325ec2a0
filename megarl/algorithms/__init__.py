"""RL algorithms: one module each behind one interface, built on pure tensor functions.

:mod:`~megarl.algorithms.base` is the interface (:class:`Algorithm`, the typed micro-batch, the
metrics' reductions), :mod:`~megarl.algorithms.registry` finds an algorithm by name
(:func:`get_algorithm`), and grpo.py, dr_grpo.py, rloo.py, ... are the algorithms. They compose the
functions of advantages.py, losses.py, kl.py, filters.py, masked.py and off_policy.py.
No megatron, no torch.distributed: tensors in, tensors out.
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
from megarl.algorithms.base import Algorithm, Metric, PolicyMicroBatch
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
from megarl.algorithms.registry import ALGORITHMS, get_algorithm

__all__ = [
    "AGGREGATION_MODES",
    "ALGORITHMS",
    "KL_ESTIMATORS",
    "AggregationMode",
    "Algorithm",
    "KLEstimator",
    "Metric",
    "PolicyMicroBatch",
    "aggregate",
    "broadcast",
    "discounted_returns",
    "dynamic_sampling_mask",
    "entropy_loss",
    "gae",
    "get_algorithm",
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
