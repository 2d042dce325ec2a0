"""CISPO (MiniMax-M1, 2025): clip the importance weight, never a token's gradient.

PPO's clip gives zero gradient to a token whose ratio left the clip range in its advantage's
direction, and the first tokens to leave it are the rare ones whose probability jumps (the
reflective "However", "Wait", ...), which long reasoning depends on. CISPO keeps every token's
policy gradient and bounds only the weight on it::

    w_t = sg(clip(r_t, 1 - clip_low, 1 + clip_high)),   r_t = pi(y_t) / pi_old(y_t)
    l_t = -w_t * A_t * log pi(y_t)

averaged over the tokens ("token-mean"). The gradient is ``-w_t * A_t * grad log pi(y_t)``:
REINFORCE with a truncated importance weight; the loss's value is no surrogate objective, only its
gradient means something. Advantages as GRPO's. Defaults (``megarl.config.schema.ALGORITHM_DEFAULTS``):
no lower bound on the weight (``clip_low`` unset), as MiniMax-M1, which tuned the upper bound only;
``clip_high=0.28`` (the paper does not publish its value; 0.28 is DAPO's clip-higher bound).
"""

from __future__ import annotations

import torch

from megarl.algorithms.base import PolicyMicroBatch, local_mean
from megarl.algorithms.grpo import GRPO
from megarl.algorithms.masked import _zero_masked, aggregate
from megarl.config.schema import AlgorithmConfig


class CISPO(GRPO):
    name = "cispo"

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        if cfg.dual_clip is not None:
            return [f"algorithm.dual_clip={cfg.dual_clip}: cispo has no clipped objective for a dual clip to bound; "
                    "its weights are capped by clip_high"]
        return []

    def policy_loss(self, cfg: AlgorithmConfig, mb: PolicyMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        valid = mb.mask.bool()
        adv = mb.advantages[:, None] if mb.advantages.dim() == 1 else mb.advantages
        # padding to 0 before any arithmetic: NaN * 0 is NaN, in the value and in the backward
        adv = _zero_masked(adv.detach().expand(valid.shape), valid)
        logprobs = _zero_masked(mb.logprobs, valid)
        with torch.no_grad():  # the weight is a constant: sg(.)
            log_ratio = _zero_masked(mb.logprobs.detach() - mb.old_logprobs, valid)
            ratio = torch.exp(log_ratio)
            low = None if cfg.clip_low is None else 1.0 - cfg.clip_low
            weight = ratio.clamp(min=low, max=1.0 + cfg.clip_high)
        loss = aggregate(-weight * adv * logprobs, mb.mask, cfg.aggregation, norm_len=mb.norm_len, denom=mb.denom)
        metrics = {
            "clip_fraction": local_mean((weight != ratio).to(ratio.dtype), mb.mask, cfg.aggregation),  # weight capped
            # k3 estimate of KL(pi_old || pi) from the tokens, as PPO's
            "approx_kl": local_mean(ratio - 1.0 - log_ratio, mb.mask, cfg.aggregation),
            "ratio_mean": local_mean(ratio, mb.mask, cfg.aggregation),
        }
        return loss, metrics
