"""Batch filters and score shaping of DAPO: dynamic sampling and the soft overlong penalty."""

from __future__ import annotations

import torch


def dynamic_sampling_mask(
    scores: torch.Tensor,
    group_size: int,
    atol: float = 0.0,
) -> tuple[torch.Tensor, int]:
    """DAPO dynamic sampling: keep only the groups whose scores are not all identical.

    ``scores`` is ``[B]`` with the ``group_size`` samples of a prompt consecutive.
    A group whose scores all lie within ``atol`` of each other
    (``max - min <= atol``) has zero GRPO advantage everywhere and carries no
    gradient; it is dropped. Returns ``(keep [B] bool, number of kept groups)``.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"batch of {scores.numel()} scores does not split into groups of {group_size}")
    # as float: bool scores (pass/fail) cannot be subtracted, and min/max of ints is exact in float
    g = (scores.detach() if scores.is_floating_point() else scores.detach().float()).view(-1, group_size)
    spread = g.amax(dim=1) - g.amin(dim=1)
    keep_group = spread > atol
    keep = keep_group.repeat_interleave(group_size)
    return keep, int(keep_group.sum().item())


def overlong_penalty(
    lengths: torch.Tensor,
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment ``[B]`` (float), to add to the task scores.

    With ``L`` the response length, ``L_max = max_len`` and ``L_buf = buffer_len``::

        0                                          if L <= L_max - L_buf
        (L_max - L_buf - L) / L_buf * factor       if L_max - L_buf < L <= L_max   (0 down to -factor)
        -factor                                    if L > L_max
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    expected = max_len - buffer_len
    lengths = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    ramp = (expected - lengths) / buffer_len * penalty_factor
    return ramp.clamp(min=-penalty_factor, max=0.0)
