"""Masked reductions over response tokens, and the loss-aggregation modes.

Conventions (the whole ``megarl.algorithms`` package):

- token tensors are ``[B, T]``: B sequences, T response-token positions;
- ``mask`` is ``[B, T]`` (bool or float 0/1), 1 on valid response tokens; a
  float mask is read as ``mask != 0`` (it is a selection, not a weighting);
  sequences are right-padded, so the valid tokens of a row are a prefix;
- per-sequence scalars are ``[B]``.

Masked positions never contribute to a value (they are replaced by 0 with
``torch.where``, so even NaN/inf padding does not leak into the result) and
receive exactly zero gradient.
"""

from __future__ import annotations

from typing import get_args

import torch

from megarl.config.schema import AggregationMode

AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)


def _count(mask: torch.Tensor, like: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of valid elements, counted in at least float32 (bf16 cannot count past 256 exactly)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    m = mask.bool().to(dtype)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all elements when ``dim`` is None); masked elements count as 0."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim`` (all elements when ``dim`` is None).

    Where a reduced slice has no valid element the result is 0 (the count is
    clamped to 1), never NaN.
    """
    return (masked_sum(x, mask, dim) / _count(mask, x, dim).clamp(min=1.0)).to(x.dtype)


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with its masked positions replaced by 0. Done *before* any arithmetic: ``NaN * 0`` is
    NaN, and so is the gradient of ``(NaN - m)^2`` even where a later ``where`` drops its value."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _shifted(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - ref, ref)`` with ``ref`` the first valid element (0 when there is none, detached) and
    masked positions 0. Moments of the shifted values are the same, but a constant input shifts to
    exact zeros: its deviations from the mean are then exactly 0 in any dtype, where
    ``x - mean(x)`` leaves rounding noise (eight fp32 0.7 have a mean 6e-8 off) that a division
    by a near-zero spread blows up."""
    valid = mask.bool().expand_as(x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return x.clone(), zero
    flat = valid.reshape(-1)
    first = flat.to(torch.uint8).argmax()  # index of the first valid element (0 when none)
    ref = torch.where(flat.any(), x.detach().reshape(-1)[first], zero)  # no host sync
    return _zero_masked(x - ref, valid), ref


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid elements of ``x`` (over all of them, a 0-dim tensor).

    ``var = sum(mask * (x - mean)^2) / (n - 1)`` with ``n = sum(mask)`` when
    ``unbiased`` (Bessel's correction, the default, as ``torch.var``), else
    divided by ``n``. With ``n <= 1`` (unbiased) or ``n == 0`` the divisor is
    clamped to 1, which gives 0. Valid elements that are all equal give exactly 0.
    """
    shifted, _ = _shifted(x, mask)
    n = _count(mask, x)
    divisor = n - 1.0 if unbiased else n
    deviation = shifted - masked_mean(shifted, mask)
    return (masked_sum(deviation.square(), mask) / divisor.clamp(min=1.0)).to(x.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise the valid elements of ``x`` to mean 0 and variance 1 (global, over the whole batch).

    ``(x - mean) / sqrt(var + eps)``, with mean and *unbiased* variance
    (:func:`masked_var`) over all valid tokens. With ``shift_mean=False`` the
    mean is added back: only the scale changes, ``mean + (x - mean) / sqrt(var + eps)``.
    Valid elements that are all equal give exactly 0 (``x`` itself with ``shift_mean=False``).
    Masked positions of the result are 0.
    """
    shifted, ref = _shifted(x, mask)
    mean = masked_mean(shifted, mask)
    var = masked_var(shifted, mask, unbiased=True)
    out = (shifted - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + (mean + ref)
    return _zero_masked(out, mask)


def aggregate(
    loss_tokens: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode = "token-mean",
    norm_len: float | None = None,
    denom: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    With ``m`` the mask, ``n_b = sum_t m[b, t]`` the valid tokens of sequence b
    and ``S`` the sequences with ``n_b > 0``:

    - ``"token-mean"`` (DAPO token-level): ``sum_{b,t} m*l / sum_{b,t} m``;
      every token of the batch weighs the same, long sequences weigh more.
    - ``"seq-mean-token-mean"`` (original GRPO): ``mean_{b in S} (sum_t m*l / n_b)``;
      every sequence weighs the same, its tokens share that weight.
    - ``"seq-mean-token-sum"`` (Dr.GRPO-like): ``mean_{b in S} (sum_t m*l / norm_len)``
      where ``norm_len`` is a constant (e.g. the maximum response length) or 1
      when None; no per-sequence length normalisation.

    ``denom`` replaces the batch's own normaliser (the token count for
    "token-mean", ``|S|`` for the seq modes) with a global one, e.g. the valid
    tokens of all micro-batches and data-parallel ranks of one optimizer step,
    so that summing the micro-batch losses gives the global aggregate.
    An empty batch gives 0.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    if denom is not None and denom <= 0:
        raise ValueError(f"denom must be > 0, got {denom}")
    if mode == "token-mean":
        total = masked_sum(loss_tokens, mask)
        return (total / (_count(mask, loss_tokens).clamp(min=1.0) if denom is None else float(denom))).to(
            loss_tokens.dtype)
    seq_sum = masked_sum(loss_tokens, mask, dim=-1)
    n_tokens = _count(mask, loss_tokens, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / n_tokens.clamp(min=1.0)
    else:
        if norm_len is not None and norm_len <= 0:
            raise ValueError(f"norm_len must be > 0, got {norm_len}")
        per_seq = seq_sum / (1.0 if norm_len is None else float(norm_len))
    has_tokens = (n_tokens > 0).to(n_tokens.dtype)
    n_seqs = has_tokens.sum().clamp(min=1.0) if denom is None else float(denom)
    return ((per_seq * has_tokens).sum() / n_seqs).to(loss_tokens.dtype)
