"""Kahneman-Tversky optimisation (Ethayarajh et al. 2024): preference learning from unpaired
examples, each completion labelled desirable or undesirable, against a frozen reference.

An example's log-ratio is ``r = log pi(y|x) - log pi_ref(y|x)`` (log-probs summed over the
completion's tokens). Its value is measured against a reference point ``z``: the batch's estimate
of KL(pi || pi_ref), the mean log-ratio of mismatched pairs (each prompt with another example's
completion), clamped at 0 and not differentiated (:func:`kl_reference_point`). Losses:

- desirable: ``w_d * (1 - sigmoid(beta * (r - z)))``;
- undesirable: ``w_u * (1 - sigmoid(beta * (z - r)))``,

and the step's loss is their mean over the step's examples, as in TRL's ``KTOTrainer`` (its
``loss_type="kto"``, ``tests/test_preference.py``). ``z`` needs the whole step's mismatched pairs
before any micro-batch's loss, so the caller computes it first and passes it in.
"""

from __future__ import annotations

import torch

from megarl.config.supervised import DpoConfig


def kl_reference_point(policy_logps: torch.Tensor, ref_logps: torch.Tensor) -> float:
    """KTO's ``z``: the mean over the step's mismatched pairs of their summed log-ratio [N], at
    least 0 (a negative estimate of a KL divergence is noise; TRL clamps it too)."""
    return max(float((policy_logps.float() - ref_logps.float()).mean()), 0.0)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: float | torch.Tensor,
             settings: DpoConfig, denom: float, desirable_count: float | None = None) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the step's loss over ``denom`` examples (the step's count).

    ``policy_logps`` / ``ref_logps`` [n] are each example's completion log-prob sums, ``desirable``
    [n] its label, ``kl`` the step's reference point (:func:`kl_reference_point`). Metrics are
    shares of step means, so that they add up over micro-batches and data-parallel shards:
    ``kto_loss``, the implicit rewards ``beta * r`` of desirable and undesirable examples,
    averaged over the step's ``desirable_count`` and ``denom - desirable_count`` examples of each
    kind (default: all examples, when the caller does not know the counts); and ``kto/kl``, ``z``
    itself (the same in every micro-batch).
    """
    beta = settings.beta
    kl = torch.as_tensor(kl, dtype=policy_logps.dtype, device=policy_logps.device).detach()
    good = desirable.to(device=policy_logps.device, dtype=torch.bool)
    ratio = policy_logps - ref_logps
    # 1 - sigmoid(x) = sigmoid(-x): the desirable examples' value rises with r above z, the
    # undesirable ones' with r below it
    per_example = torch.where(good, settings.desirable_weight * torch.sigmoid(-beta * (ratio - kl)),
                              settings.undesirable_weight * torch.sigmoid(-beta * (kl - ratio)))
    loss = per_example.sum() / denom
    with torch.no_grad():
        reward = beta * ratio
        n_good = denom if desirable_count is None else desirable_count
        n_bad = denom if desirable_count is None else denom - desirable_count
        metrics = {"kto_loss": loss.detach().clone(),
                   "kto/kl": kl.clone(),
                   "kto/reward_chosen": reward[good].sum() / max(n_good, 1),
                   "kto/reward_rejected": reward[~good].sum() / max(n_bad, 1)}
    return loss, metrics
