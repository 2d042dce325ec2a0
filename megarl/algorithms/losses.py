"""Losses: clipped policy gradient (PPO / DAPO clip-higher / dual-clip), clipped value, entropy, KL.

Every loss is a per-token ``[B, T]`` quantity reduced with
:func:`~megarl.algorithms.masked.aggregate` (``aggregation``, ``norm_len``,
``denom`` are passed through; see there for the modes). Masked tokens
contribute nothing and get zero gradient.

Metrics are 0-dim *detached* tensors (no host sync here; call ``.item()`` when
logging), averaged over the valid tokens of the batch ("token-mean"),
whatever the loss aggregation.
"""

from __future__ import annotations

import torch

from megarl.algorithms.kl import KLEstimator, kl_estimate
from megarl.algorithms.masked import AggregationMode, _zero_masked, aggregate, masked_mean, masked_var


def _fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition.float(), mask).detach()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: AggregationMode = "token-mean",
    norm_len: float | None = None,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, per token, then aggregated.

    ``logprobs`` (differentiated) and ``old_logprobs`` (behaviour policy, no
    gradient) are ``[B, T]``; ``advantages`` is ``[B, T]``, or ``[B]`` (outcome
    advantages, broadcast over tokens). With ``A`` the advantage::

        ratio = exp(logprobs - old_logprobs)
        pg1   = -A * ratio
        pg2   = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)
        l     = max(pg1, pg2)
        l     = min(l, -A * dual_clip)    only where A < 0, when dual_clip (c > 1) is given

    ``clip_high > clip_low`` is DAPO's "clip-higher". Dual clip (Ye et al. 2020)
    bounds the loss of a negative-advantage token whose ratio exploded: beyond
    ``ratio > c`` its loss stays ``-A * c`` (zero gradient).

    Metrics: ``clip_fraction`` (valid tokens where the clipped branch is the
    loss, ``pg2 > pg1``: their gradient is 0), ``dual_clip_fraction`` (valid
    tokens with ``A < 0`` where the dual bound is the loss, ``-A * c < max(pg1, pg2)``),
    ``approx_kl`` (k3 estimate of ``KL(pi_old || pi)`` from tokens sampled by
    pi_old: ``mean(ratio - 1 - log ratio)``, >= 0), ``ratio_mean``, ``ratio_max``
    (over valid tokens; every metric is 0 when there is none).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    valid = mask.bool()
    # padding advantages to 0: NaN there would give NaN * 0 = NaN in the backward of -A * ratio
    adv = _zero_masked(adv.detach().expand(valid.shape), valid)
    # 0 on padding *before* exp: garbage padding log-probs must not overflow (inf * 0 = NaN in backward).
    log_ratio = _zero_masked(logprobs - old_logprobs.detach(), valid)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tokens = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (bound < loss_tokens)
        loss_tokens = torch.where(dual, bound, loss_tokens)
    loss = aggregate(loss_tokens, mask, aggregation, norm_len=norm_len, denom=denom)

    with torch.no_grad():
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        metrics = {
            "clip_fraction": _fraction(clipped, mask),
            "dual_clip_fraction": _fraction(dual, mask),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).detach(),
            "ratio_mean": masked_mean(ratio, mask).detach(),
            # ratios are > 0, so a 0 fill leaves the max of a non-empty batch as it is and
            # makes an empty one 0 like the other metrics (not -inf)
            "ratio_max": torch.where(valid, ratio, zero).max().detach(),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = None,
    aggregation: AggregationMode = "token-mean",
    norm_len: float | None = None,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic regression loss, per token ``0.5 * (V - R)^2``, optionally PPO-clipped.

    With ``clip`` given::

        V_clip = old_values + clamp(values - old_values, -clip, clip)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)

    Metrics: ``clip_fraction`` (valid tokens where the clipped term is the loss,
    ``(V_clip - R)^2 > (V - R)^2``), ``explained_variance``
    ``1 - Var[R - V] / Var[R]`` over valid tokens (unbiased variances; 0 when the
    returns have no variance), ``value_mean``.
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    # padding to 0 before any arithmetic: the gradient of (NaN - R)^2 is NaN even though
    # aggregate() drops its value (NaN * 0 = NaN)
    values = _zero_masked(values, mask)
    returns = _zero_masked(returns.detach(), mask)
    unclipped = (values - returns).square()
    clipped_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    if clip is None:
        loss_tokens = 0.5 * unclipped
    else:
        old = _zero_masked(old_values.detach(), mask)
        v_clip = old + (values - old).clamp(-clip, clip)
        clipped_sq = (v_clip - returns).square()
        loss_tokens = 0.5 * torch.maximum(unclipped, clipped_sq)
        clipped_frac = _fraction(clipped_sq > unclipped, mask)
    loss = aggregate(loss_tokens, mask, aggregation, norm_len=norm_len, denom=denom)

    with torch.no_grad():
        v = values.detach()
        var_r = masked_var(returns, mask)
        var_res = masked_var(returns - v, mask)
        explained = torch.where(var_r > 0, 1.0 - var_res / var_r.clamp(min=torch.finfo(var_r.dtype).tiny),
                                torch.zeros_like(var_r))
        metrics = {
            "clip_fraction": clipped_frac,
            "explained_variance": explained,
            "value_mean": masked_mean(v, mask),
        }
    return loss, metrics


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    aggregation: AggregationMode = "token-mean",
    norm_len: float | None = None,
    denom: float | None = None,
) -> torch.Tensor:
    """Entropy bonus as a loss to *add* (times a coefficient): ``-aggregate(entropy)``.

    ``entropy`` ``[B, T]`` is the policy's per-token entropy (computed from the logits elsewhere).
    """
    return -aggregate(entropy, mask, aggregation, norm_len=norm_len, denom=denom)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k3",
    aggregation: AggregationMode = "token-mean",
    clamp: float | None = None,
    norm_len: float | None = None,
    denom: float | None = None,
) -> torch.Tensor:
    """KL in the loss: ``aggregate(kl_estimate(logprobs, ref_logprobs, estimator, clamp))``.

    Differentiated through ``logprobs`` only (the reference is detached). k3
    (GRPO's choice) and k2 give useful gradients; k1's expected gradient is 0
    (see :mod:`megarl.algorithms.kl`).
    """
    # padding reads as "policy == reference == 0" (KL 0), so garbage in either cannot reach a gradient
    ref = _zero_masked(ref_logprobs.detach(), mask)
    kl = kl_estimate(_zero_masked(logprobs, mask), ref, estimator, clamp)
    return aggregate(kl, mask, aggregation, norm_len=norm_len, denom=denom)
