"""Sequence-level truncated importance sampling (``algorithm.off_policy_correction: seq_tis``):
one importance weight per sequence for the rollout/trainer mismatch, length-normalised as GSPO's
sequence ratio.

The reward belongs to the whole response, and a single token's ratio ``pi_old(y_t) / mu(y_t)``
is one noisy sample; GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization") weighs each
response by the geometric mean of its token ratios instead, so that responses of any length
share one scale. Applied to the engine/trainer gap (mu: the rollout engine's policy, pi_old: the
trainer's), with TIS's truncation (Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training")::

    s_i = exp(mean over the valid tokens t of i of (log pi_old(y_i,t) - log mu(y_i,t)))
    w_i = min(s_i, is_cap)              (clip(s_i, is_floor, is_cap) with algorithm.is_floor)

and every policy-gradient term of sequence i is weighted by ``w_i``; nothing is dropped. This is
the weighting counterpart of ``mis`` (the same geometric ratio as a keep-or-drop mask). verl's
``rollout_is: sequence`` and ms-swift's ``sequence_truncate`` weigh by the product of the token
ratios (``exp(sum_t log r_t)``) instead, which over long responses leaves any fixed band: with the
mean, a response whose every token is off by the same ratio r gets weight r, whatever its length.
Weights are targets (no gradient); padding gets weight 0.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def sequence_tis_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float,
                         floor: float | None = None) -> torch.Tensor:
    """``[B, T]``: each sequence's truncated geometric-mean ratio on its valid tokens, 0 elsewhere
    (0 on a sequence without valid tokens). ``log_ratio``: ``log pi_old - log mu``, 0 where masked
    (``megarl.algorithms.off_policy.log_ratios``)."""
    valid = mask.bool()
    counts = valid.sum(dim=1)
    geometric = torch.exp(log_ratio.sum(dim=1) / counts.clamp(min=1).to(log_ratio.dtype))
    weight = geometric.clamp(min=floor, max=cap)
    return torch.where(valid, weight[:, None], torch.zeros((), dtype=weight.dtype, device=weight.device))
