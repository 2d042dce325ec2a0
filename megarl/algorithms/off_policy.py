"""Corrections for the gap between the policy that sampled (the rollout engine, mu) and the policy
the trainer scores (pi_old: the same weights, another kernel, precision, or an older version).

With ``r_t = pi_old(y_t) / mu(y_t)`` over the valid response tokens of each sequence:

- ``tis``: truncated importance sampling, per token: the policy-gradient term of token t is
  weighted by ``min(r_t, cap)`` (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"); with a ``floor`` (``algorithm.is_floor``, in (0, 1]) by
  ``clip(r_t, floor, cap)``, as slime's ``--tis-clip-low`` / ``--tis-clip`` (its GLM recipes use
  0.5 and 2): a token the engine over-sampled keeps at least that weight instead of nearly none,
  a bias traded for a bound on how little any sampled token can count.
- ``mis``: sequence-level masking: a sequence whose geometric-mean ratio ``exp(mean_t log r_t)``
  leaves ``[low, high]`` is dropped from the policy gradient whole; the kept ones keep weight 1.
  This is the length-normalised (geometric) sequence mask, not sequence-level masked IS with the
  product ratio as weight: over long responses the product leaves any fixed band.
- ``icepop``: IcePop as published (Ling team 2025), per token: the masking function
  ``M(r) = r`` inside ``[low, high]`` and 0 outside, i.e. a kept token's policy-gradient term is
  weighted by its ratio, a token outside the band is dropped.
- ``token_mask``: the same band per token, the kept tokens weighted 1 (a pure mask: what megarl
  called ``icepop`` before it followed the paper).
- ``seq_tis``: sequence-level truncated importance sampling: every term of a sequence weighted
  by its truncated geometric-mean ratio ``min(exp(mean_t log r_t), cap)`` (``floor`` as for
  ``tis``): :mod:`megarl.algorithms.seq_tis`.
- ``none``: weight 1 everywhere, nothing dropped.

Weights and keep-masks are targets, never differentiated (computed under ``no_grad``); dropped and
masked positions get weight 0 in ``keep``. Shapes follow :mod:`megarl.algorithms.masked`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from megarl.algorithms.masked import masked_mean
from megarl.algorithms.seq_tis import sequence_tis_weights
from megarl.config.schema import OffPolicyCorrection

OFF_POLICY_CORRECTIONS: tuple[str, ...] = get_args(OffPolicyCorrection)


@dataclass(frozen=True)
class Correction:
    weights: torch.Tensor  # [B, T]: multiplies each token's policy-gradient term (1 where not weighted)
    keep: torch.Tensor  # [B, T] float: 1 where the token stays in the policy gradient, 0 dropped or masked


@torch.no_grad()
def log_ratios(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi_old - log mu`` at valid tokens, 0 elsewhere (non-finite padding never leaks)."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    return torch.where(valid, old_logprobs, zero) - torch.where(valid, rollout_logprobs.to(old_logprobs.dtype), zero)


@torch.no_grad()
def off_policy_correction(kind: OffPolicyCorrection, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                          mask: torch.Tensor, cap: float = 2.0, low: float = 0.5, high: float = 2.0,
                          floor: float | None = None) -> Correction:
    """The weights and keep-mask of ``kind`` (see the module docstring); ``cap`` and ``floor``
    (None: no lower bound) for ``tis`` and ``seq_tis``, ``[low, high]`` for ``mis``, ``icepop`` and
    ``token_mask``."""
    if kind not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {kind!r}; expected one of {OFF_POLICY_CORRECTIONS}")
    if not 0 < low <= 1 <= high or cap < 1:
        raise ValueError(f"need 0 < low <= 1 <= high and cap >= 1, got low={low}, high={high}, cap={cap}")
    if floor is not None and not 0 < floor <= 1:
        raise ValueError(f"need 0 < floor <= 1, got floor={floor}")
    valid = mask.bool()
    log_r = log_ratios(old_logprobs, rollout_logprobs, mask)
    ratio = torch.exp(log_r)  # 1 at masked positions
    weights = torch.ones_like(ratio)
    keep = valid
    if kind == "tis":
        weights = torch.where(valid, ratio.clamp(min=floor, max=cap), torch.zeros_like(ratio))
    elif kind == "seq_tis":
        weights = sequence_tis_weights(log_r, mask, cap, floor)
    elif kind in ("icepop", "token_mask"):
        keep = valid & (ratio >= low) & (ratio <= high)
        if kind == "icepop":  # M(r) = r in the band (the dropped tokens' weight is moot: keep is 0)
            weights = torch.where(keep, ratio, torch.zeros_like(ratio))
    elif kind == "mis":
        counts = valid.sum(dim=1)
        geometric = torch.exp(log_r.sum(dim=1) / counts.clamp(min=1))
        inside = (geometric >= low) & (geometric <= high) & (counts > 0)
        keep = valid & inside[:, None]
    return Correction(weights=weights, keep=keep.to(ratio.dtype))


@torch.no_grad()
def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                     correction: Correction) -> dict[str, float]:
    """How far the trainer's and the engine's policies are apart on the sampled tokens:

    - ``mismatch/kl_k3``: k3 estimate of KL(mu || pi_old) from mu's samples, ``mean(r - 1 - log r)``;
    - ``mismatch/is_ratio_mean`` / ``_max``: of ``r`` over valid tokens;
    - ``mismatch/dropped_fraction``: valid tokens the correction drops from the policy gradient.
    All 0 when no token is valid.
    """
    valid = mask.bool()
    if not valid.any():
        return {"mismatch/kl_k3": 0.0, "mismatch/is_ratio_mean": 0.0, "mismatch/is_ratio_max": 0.0,
                "mismatch/dropped_fraction": 0.0}
    log_r = log_ratios(old_logprobs, rollout_logprobs, mask).double()
    ratio = torch.exp(log_r)
    return {
        "mismatch/kl_k3": float(masked_mean(ratio - 1 - log_r, mask)),
        "mismatch/is_ratio_mean": float(masked_mean(ratio, mask)),
        "mismatch/is_ratio_max": float(ratio[valid].max()),
        "mismatch/dropped_fraction": float(masked_mean(1.0 - correction.keep.double(), mask)),
    }
