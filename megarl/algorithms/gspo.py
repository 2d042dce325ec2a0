"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clipping applied to one
importance ratio per sequence, with GRPO's group-relative advantages.

The reward belongs to the whole response, and a token's ratio ``pi(y_t) / pi_old(y_t)`` is a single
noisy sample (more so on long responses and MoE models, whose routing changes between updates). GSPO
weighs each response by the geometric mean of its token ratios instead, which is length-normalised
so that responses of any length share one clip range::

    s_i = exp(mean over the valid tokens t of i of (log pi(y_i,t) - log pi_old(y_i,t)))
    l_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_low, 1 + clip_high))

The loss is the mean of ``l_i`` over the sequences (aggregation "seq-mean-token-mean", the default
here; "token-mean" weighs each sequence by its length instead). An unclipped sequence's gradient is
``-A_i * s_i * mean_t grad log pi(y_i,t)``: all its tokens weigh the same, and a clipped sequence
gives none. ``s_i`` moves far less than a token ratio, so the clip range is small: the paper's
3e-4 / 4e-4 are the defaults (``megarl.config.schema.ALGORITHM_DEFAULTS``).
"""

from __future__ import annotations

import torch

from megarl.algorithms.base import PolicyMicroBatch, local_mean
from megarl.algorithms.grpo import GRPO
from megarl.algorithms.masked import _zero_masked, aggregate
from megarl.config.schema import AlgorithmConfig


def _per_sequence(advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[b]`` advantages: as given, or a ``[b, T]`` broadcast read at each row's first valid token
    (exactly the sequence's value, where a mean would round); 0 for a row without valid tokens."""
    if advantages.dim() == 2:
        first = valid.to(torch.uint8).argmax(dim=-1, keepdim=True)
        advantages = advantages.gather(-1, first).squeeze(-1)
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(valid.any(dim=-1), advantages.detach(), zero)


class GSPO(GRPO):
    name = "gspo"
    turn_credit = False  # one ratio and one advantage per sequence

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        errors = []
        if cfg.dual_clip is not None:
            errors.append(f"algorithm.dual_clip={cfg.dual_clip}: gspo clips its sequence ratio only, dual clip bounds "
                          "token ratios (PPO)")
        if cfg.aggregation == "seq-mean-token-sum":
            errors.append("algorithm.aggregation='seq-mean-token-sum': gspo's sequence ratio is already "
                          "length-normalised; use seq-mean-token-mean (or token-mean)")
        if cfg.off_policy_correction in ("tis", "icepop"):
            errors.append(f"algorithm.off_policy_correction={cfg.off_policy_correction!r} weighs single tokens, gspo "
                          "weighs whole sequences; use seq_tis, mis or token_mask")
        return errors

    def policy_loss(self, cfg: AlgorithmConfig, mb: PolicyMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        valid = mb.mask.bool()
        # 0 on padding before any arithmetic: garbage there must reach neither the sum nor a gradient
        log_ratio = _zero_masked(mb.logprobs - mb.old_logprobs.detach(), valid)
        count = valid.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
        seq_ratio = torch.exp(log_ratio.sum(dim=-1) / count)
        adv = _per_sequence(mb.advantages, valid)
        pg1 = -adv * seq_ratio
        pg2 = -adv * seq_ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        per_sequence = torch.maximum(pg1, pg2)
        # each sequence's loss on every one of its tokens: "seq-mean-token-mean" then averages sequences
        loss = aggregate(per_sequence[:, None].expand(valid.shape), mb.mask, cfg.aggregation, norm_len=mb.norm_len,
                         denom=mb.denom)
        with torch.no_grad():
            token_ratio = torch.exp(log_ratio)
            metrics = {
                "clip_fraction": local_mean((pg2 > pg1).to(log_ratio.dtype)[:, None].expand(valid.shape), mb.mask,
                                            cfg.aggregation),
                # k3 estimate of KL(pi_old || pi) from the tokens, as PPO's
                "approx_kl": local_mean(token_ratio - 1.0 - log_ratio, mb.mask, cfg.aggregation),
                "ratio_mean": local_mean(seq_ratio[:, None].expand(valid.shape), mb.mask, cfg.aggregation),
            }
        return loss, metrics
