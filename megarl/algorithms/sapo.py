"""SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a soft,
temperature-gated ratio in place of PPO's hard clip, with GRPO's group-relative advantages.

PPO's clip gives a token whose ratio left ``[1 - eps, 1 + eps]`` (in its advantage's direction) no
gradient at all, and one just inside it the full gradient. SAPO replaces the clipped term by a
smooth gate of the token ratio ``r_t = pi(y_t) / pi_old(y_t)`` (the paper's Eqs. 5-6)::

    f(r) = (4 / tau) * sigmoid(tau * (r - 1)),   tau_t = tau_pos if A_t > 0 else tau_neg
    l_t  = -f(r_t) * A_t

averaged per sequence, then over sequences (the paper's ``1/G sum_i 1/|y_i| sum_t``:
"seq-mean-token-mean", sapo's default aggregation). Its gradient is
``-A_t * w_t * r_t * grad log pi(y_t)`` with ``w_t = 4 s (1 - s)``, ``s = sigmoid(tau (r_t - 1))``:
``w = 1`` at ``r = 1`` (on-policy it is the plain policy gradient) and it decays smoothly as the
token drifts off-policy, faster for a larger temperature, never to exactly 0. Negative advantages
get the higher temperature (``tau_neg > tau_pos``: the paper finds their updates the less stable,
as they push probability onto the rest of the vocabulary). Defaults ``tau_pos = 1.0``,
``tau_neg = 1.05`` (``algorithm.sapo_tau_pos`` / ``sapo_tau_neg``), as the paper's experiments
and verl's ``compute_policy_loss_sapo``. ``clip_low`` / ``clip_high`` are unused; the log ratio
is clamped to [-20, 20] before the exponential (its gate's gradient is 0 there anyway), so an
exploding ratio gives no inf * 0 = NaN in the backward.
"""

from __future__ import annotations

import torch

from megarl.algorithms.base import Metric, PolicyMicroBatch, local_mean
from megarl.algorithms.grpo import GRPO
from megarl.algorithms.masked import _zero_masked, aggregate
from megarl.config.schema import AlgorithmConfig

_MAX_LOG_RATIO = 20.0


def soft_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """SAPO's gate ``f(r) = 4 / tau * sigmoid(tau * (r - 1))``, elementwise."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


class SAPO(GRPO):
    name = "sapo"
    # gate_weight: the mean of w = 4 s (1 - s), the share of the on-policy gradient the tokens keep
    metrics = (Metric("gate_weight"), Metric("approx_kl"), Metric("ratio_mean"))

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        if cfg.dual_clip is not None:
            return [f"algorithm.dual_clip={cfg.dual_clip}: sapo has no clipped objective for a dual clip to bound; "
                    "its soft gate is set by sapo_tau_pos and sapo_tau_neg"]
        return []

    def policy_loss(self, cfg: AlgorithmConfig, mb: PolicyMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        valid = mb.mask.bool()
        adv = mb.advantages[:, None] if mb.advantages.dim() == 1 else mb.advantages
        # padding to 0 before any arithmetic: NaN * 0 is NaN, in the value and in the backward
        adv = _zero_masked(adv.detach().expand(valid.shape), valid)
        log_ratio = _zero_masked(mb.logprobs - mb.old_logprobs.detach(), valid).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        pos = torch.tensor(cfg.sapo_tau_pos, dtype=ratio.dtype, device=ratio.device)
        neg = torch.tensor(cfg.sapo_tau_neg, dtype=ratio.dtype, device=ratio.device)
        tau = torch.where(adv > 0, pos, neg)
        loss = aggregate(-soft_gate(ratio, tau) * adv, mb.mask, cfg.aggregation, norm_len=mb.norm_len,
                         denom=mb.denom)
        with torch.no_grad():
            s = torch.sigmoid(tau * (ratio - 1.0))
            metrics = {
                "gate_weight": local_mean(4.0 * s * (1.0 - s), mb.mask, cfg.aggregation),
                # k3 estimate of KL(pi_old || pi) from the tokens, as PPO's
                "approx_kl": local_mean(ratio - 1.0 - log_ratio, mb.mask, cfg.aggregation),
                "ratio_mean": local_mean(ratio, mb.mask, cfg.aggregation),
            }
        return loss, metrics
