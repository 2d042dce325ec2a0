"""Per-token KL estimators between the policy and the reference model, and the KL-in-reward penalty.

Tokens are sampled from the policy pi; ``logprobs = log pi(y_t | ...)`` and
``ref_logprobs = log pi_ref(y_t | ...)`` of those tokens, both ``[B, T]``. With
``d = logprobs - ref_logprobs`` (so ``r = pi_ref / pi = exp(-d)``), Schulman's
estimators of ``KL(pi || pi_ref) = E_pi[d]`` are

- ``k1 = d``                       unbiased, high variance, can be negative;
- ``k2 = d^2 / 2``                 biased (low bias when pi ~ pi_ref), low variance, >= 0;
- ``k3 = (r - 1) - log r = exp(-d) + d - 1``
  unbiased, low variance, >= 0 (since ``e^x >= 1 + x``).

As a *loss* (differentiated with respect to logprobs, samples not reweighted)
their expected gradients differ: k1's is 0 (it only adds noise), k2's is the
gradient of ``KL(pi || pi_ref)``, k3's is the gradient of ``KL(pi_ref || pi)``.
KL-in-loss is :func:`megarl.algorithms.losses.kl_loss`; KL-in-reward is
:func:`kl_reward_penalty` here (or ``token_rewards(..., kl_per_token, beta)``).
"""

from __future__ import annotations

from typing import get_args

import torch

from megarl.config.schema import KLEstimator

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# exp(20) ~ 4.9e8: k3's exponential is evaluated on a log ratio capped here so that
# float32/bf16 never overflow to inf (an inf would turn the backward pass into NaN).
_K3_MAX_EXPONENT = 20.0


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (see the module docstring for k1/k2/k3).

    ``clamp``: when given, the estimate is clamped to ``[-clamp, clamp]`` (k2 and
    k3 are never negative, so only their upper side applies). k3's exponent
    ``-d`` is always capped at 20 before ``exp``. No masking here: padding
    positions hold whatever their inputs give; mask them when reducing.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    elif estimator == "k3":
        kl = torch.exp((-d).clamp(max=_K3_MAX_EXPONENT)) + d - 1.0
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"clamp must be > 0, got {clamp}")
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


def kl_reward_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    estimator: KLEstimator = "k1",
    clamp: float | None = None,
) -> torch.Tensor:
    """KL in the reward: the per-token reward term ``-beta * kl_t`` ``[B, T]``, 0 on masked tokens.

    It is part of the reward, not of the loss: the result is detached. Add it to
    the task rewards (e.g. ``token_rewards(scores, mask)``) before computing
    returns/advantages. k1 is the classic choice here (its sum over a sequence
    is an unbiased estimate of the sequence KL).
    """
    kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), estimator, clamp)
    return torch.where(mask.bool(), -beta * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
