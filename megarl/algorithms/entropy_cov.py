"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv:2505.22617, Sec. 5): entropy-preserving policy losses that hold
back the few tokens whose updates drive the policy's entropy down, with GRPO's advantages.

Under a policy-gradient update the entropy changes by about minus the covariance, over the
sampled tokens, between a token's log-probability and its advantage: confident tokens with a
high advantage collapse the entropy. Both losses score every valid token of the micro-batch by

    cov_t = (log pi(y_t) - mean log pi) * (A_t - mean A)      (means over the valid tokens)

and restrain a small fraction of them (``algorithm.cov_fraction`` of the valid tokens, at least
one):

- ``clip_cov``: PPO's clipped surrogate, and ``max(1, int(cov_fraction * N))`` tokens drawn at
  random among those PPO did not clip whose covariance lies in ``(clip_cov_low, clip_cov_high)``
  lose their gradient (their term is set to 0);
- ``kl_cov``: the unclipped ``-A_t * r_t`` on every token, plus ``kl_cov_coef * |log r_t|``
  (a KL penalty toward pi_old) on the ``max(1, int(cov_fraction * N))`` tokens of highest
  covariance.

As the authors' implementation (PRIME-RL/Entropy-Mechanism-of-RL, upstreamed as verl's
``clip_cov`` / ``kl_cov`` policy losses), the selection is per micro-batch and its defaults are
verl's: ``cov_fraction`` 2e-4, the band (1, 5), ``kl_cov_coef`` 1 (the paper tunes the fraction
per model). Clip-Cov's draw uses torch's default generator on the tokens' device (seeded from
the run's seed when the ranks start), so a run repeats with its seed. The selection reads detached values only.
"""

from __future__ import annotations

import torch

from megarl.algorithms.base import Metric, PolicyMicroBatch, local_mean
from megarl.algorithms.grpo import GRPO
from megarl.algorithms.masked import _zero_masked, aggregate, masked_mean
from megarl.config.schema import AlgorithmConfig


@torch.no_grad()
def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each valid token's ``(log pi - mean log pi) * (A - mean A)``, the means over the
    valid tokens; 0 where masked."""
    valid = mask.bool()
    lp, adv = _zero_masked(logprobs.detach(), valid), _zero_masked(advantages.detach(), valid)
    cov = (lp - masked_mean(lp, valid)) * (adv - masked_mean(adv, valid))
    return _zero_masked(cov, valid)


def selected_count(fraction: float, mask: torch.Tensor) -> int:
    """``max(1, int(fraction * N))`` of the ``N`` valid tokens; 0 when there is none."""
    n = int(mask.bool().sum())
    return max(1, int(fraction * n)) if n else 0


@torch.no_grad()
def random_selection(candidates: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B, T]`` bool: ``count`` of the ``candidates`` drawn at random (all of them when fewer)."""
    where = torch.nonzero(candidates.reshape(-1)).squeeze(-1)
    if where.numel() > count:
        where = where[torch.randperm(where.numel(), generator=generator, device=where.device)[:count]]
    picked = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    picked[where] = True
    return picked.view_as(candidates)


@torch.no_grad()
def top_selection(cov: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, T]`` bool: the ``count`` valid tokens of highest covariance."""
    scores = torch.where(mask.bool(), cov, torch.full((), -torch.inf, dtype=cov.dtype, device=cov.device))
    picked = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    picked[torch.topk(scores.reshape(-1), count).indices] = True
    return picked.view_as(cov)


def _tokens(mb: PolicyMicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid, advantages [b, T] 0 on padding, log ratio 0 on padding, ratio)."""
    valid = mb.mask.bool()
    adv = mb.advantages[:, None] if mb.advantages.dim() == 1 else mb.advantages
    # padding to 0 before any arithmetic: NaN * 0 is NaN, in the value and in the backward
    adv = _zero_masked(adv.detach().expand(valid.shape), valid)
    log_ratio = _zero_masked(mb.logprobs - mb.old_logprobs.detach(), valid)
    return valid, adv, log_ratio, torch.exp(log_ratio)


class ClipCov(GRPO):
    name = "clip_cov"
    metrics = (Metric("clip_fraction"), Metric("cov_fraction"), Metric("approx_kl"), Metric("ratio_mean"))

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        errors = []
        if cfg.dual_clip is not None:
            errors.append(f"algorithm.dual_clip={cfg.dual_clip}: clip_cov draws among the tokens PPO's clip leaves; "
                          "it takes no dual clip")
        if not cfg.clip_cov_low < cfg.clip_cov_high:
            errors.append(f"algorithm.clip_cov_low={cfg.clip_cov_low} must be below "
                          f"clip_cov_high={cfg.clip_cov_high}: the covariance band is empty")
        return errors

    def policy_loss(self, cfg: AlgorithmConfig, mb: PolicyMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        valid, adv, log_ratio, ratio = _tokens(mb)
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        clipped = (pg2 > pg1) & valid
        cov = token_covariance(mb.logprobs, adv, valid)
        band = valid & ~clipped & (cov > cfg.clip_cov_low) & (cov < cfg.clip_cov_high)
        picked = random_selection(band, selected_count(cfg.cov_fraction, valid))
        loss_tokens = torch.where(picked, torch.zeros_like(pg1), torch.maximum(pg1, pg2))
        loss = aggregate(loss_tokens, mb.mask, cfg.aggregation, norm_len=mb.norm_len, denom=mb.denom)
        with torch.no_grad():
            metrics = {
                "clip_fraction": local_mean(clipped.to(ratio.dtype), mb.mask, cfg.aggregation),
                "cov_fraction": local_mean(picked.to(ratio.dtype), mb.mask, cfg.aggregation),  # gradients detached
                "approx_kl": local_mean(ratio - 1.0 - log_ratio, mb.mask, cfg.aggregation),
                "ratio_mean": local_mean(ratio, mb.mask, cfg.aggregation),
            }
        return loss, metrics


class KLCov(GRPO):
    name = "kl_cov"
    metrics = (Metric("cov_fraction"), Metric("approx_kl"), Metric("ratio_mean"))

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        if cfg.dual_clip is not None:
            return [f"algorithm.dual_clip={cfg.dual_clip}: kl_cov has no clipped objective for a dual clip to bound; "
                    "its high-covariance tokens are held by kl_cov_coef"]
        return []

    def policy_loss(self, cfg: AlgorithmConfig, mb: PolicyMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        valid, adv, log_ratio, ratio = _tokens(mb)
        count = selected_count(cfg.cov_fraction, valid)
        cov = token_covariance(mb.logprobs, adv, valid)
        picked = top_selection(cov, valid, count) if count else torch.zeros_like(valid)
        penalty = torch.where(picked, cfg.kl_cov_coef * log_ratio.abs(), torch.zeros_like(log_ratio))
        loss = aggregate(-adv * ratio + penalty, mb.mask, cfg.aggregation, norm_len=mb.norm_len, denom=mb.denom)
        with torch.no_grad():
            metrics = {
                "cov_fraction": local_mean(picked.to(ratio.dtype), mb.mask, cfg.aggregation),  # penalised
                "approx_kl": local_mean(ratio - 1.0 - log_ratio, mb.mask, cfg.aggregation),
                "ratio_mean": local_mean(ratio, mb.mask, cfg.aggregation),
            }
        return loss, metrics
