"""Advantage estimators: GAE (PPO), GRPO / Dr.GRPO, RLOO, REINFORCE++; token-reward shaping.

Shapes follow :mod:`megarl.algorithms.masked`: token tensors ``[B, T]``,
``mask`` ``[B, T]`` of valid (right-padded) response tokens, per-sequence
scalars ``[B]``. Group estimators (GRPO, RLOO) take ``B = n_groups * group_size``
with the samples of one prompt *consecutive*: group g is rows
``[g * group_size, (g + 1) * group_size)``.

Advantages and returns are targets, never differentiated: every function here
runs under ``torch.no_grad()``. Masked positions of every ``[B, T]`` result are 0.
"""

from __future__ import annotations

import torch

from megarl.algorithms.masked import whiten


def _zeros_like_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B]`` -> ``[B // group_size, group_size]`` (float), with a clear error when B does not
    divide or a score is not finite (one NaN or inf would turn its whole group's advantages into NaN)."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"batch of {scores.numel()} scores does not split into groups of {group_size}")
    s = scores if scores.is_floating_point() else scores.float()
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"scores must be finite, got {s[~torch.isfinite(s)].unique().tolist()}")
    return s.view(-1, group_size)


def _centred(g: torch.Tensor) -> torch.Tensor:
    """``g - mean`` per row, in at least float32, computed from ``g - g[:, :1]``: a row of equal
    values then gives exact zeros. Subtracting the rounded mean directly does not (eight fp32
    scores of 0.7 have a mean 6e-8 off, which the division by ``std + eps`` turns into 0.056)."""
    d = g.to(torch.promote_types(g.dtype, torch.float32))
    d = d - d[:, :1]
    return d - d.mean(dim=1, keepdim=True)


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each sequence.

    For valid token t, with V_{t+1} the value of the next *valid* token (0 after
    the last one: the end of the response is terminal)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}      (A after the last valid token = 0)
        R_t     = A_t + V_t

    Masked positions are skipped (their rewards and values are ignored, they
    break nothing in between) and get ``A = R = 0``. Returns ``(advantages, returns)``, both ``[B, T]``.
    """
    valid = mask.bool()
    zero = torch.zeros_like(values[:, 0])
    next_value, next_adv = zero, zero
    advantages = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        v = valid[:, t]
        advantages[:, t] = torch.where(v, adv, zero)
        next_value = torch.where(v, values[:, t], next_value)
        next_adv = torch.where(v, adv, next_adv)
    returns = _zeros_like_masked(advantages + values, mask)
    return advantages, returns


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens (``G`` after the last one = 0); ``[B, T]``.

    Masked positions are skipped (their rewards ignored) and get 0.
    """
    valid = mask.bool()
    zero = torch.zeros_like(rewards[:, 0])
    running = zero
    out = torch.zeros_like(rewards)
    for t in range(rewards.shape[1] - 1, -1, -1):
        g = rewards[:, t] + gamma * running
        v = valid[:, t]
        out[:, t] = torch.where(v, g, zero)
        running = torch.where(v, g, running)
    return out


@torch.no_grad()
def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl_per_token: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]`` from sequence scores (PPO / REINFORCE++ shaping).

    ``r[b, t] = scores[b] * [t == last valid token of b] - beta * kl_per_token[b, t]``
    on valid tokens, 0 on masked ones. A sequence with no valid token gets no reward.
    """
    valid = mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(valid)
    last = torch.where(valid, positions, -1).amax(dim=1, keepdim=True)  # -1 when the row is empty
    s = scores if scores.is_floating_point() else scores.float()
    rewards = torch.where(positions == last, s[:, None], torch.zeros((), dtype=s.dtype, device=s.device))
    if kl_per_token is not None and beta != 0.0:
        rewards = rewards - beta * kl_per_token
    return _zeros_like_masked(rewards, mask)


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor,
    group_size: int,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantages ``[B]``: each score against its group's statistics.

    ``A_i = (s_i - mean_g) / (std_g + eps)`` where mean and std are over the
    ``group_size`` samples of i's group and std is the *unbiased* sample
    standard deviation (Bessel, divisor k - 1), as in ``torch.std`` and the
    common GRPO implementations. With ``norm_std=False`` (Dr.GRPO) only the mean
    is removed: ``A_i = s_i - mean_g``. A group of identical scores gives 0.
    ``group_size == 1`` gives 0 (the sample is its own baseline).
    Broadcast over tokens with :func:`broadcast`.
    """
    g = _groups(scores, group_size)
    centred = _centred(g)
    if norm_std and group_size > 1:
        # std from the exact deviations: 0 for a group of equal scores, which keeps its zeros
        std = (centred.square().sum(dim=1, keepdim=True) / (group_size - 1)).sqrt()
        centred = centred / (std + eps)
    return centred.to(g.dtype).reshape(-1)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages ``[B]``: ``A_i = s_i - mean_{j != i in group} s_j``.

    Equal to ``k / (k - 1) * (s_i - mean_g)`` for group size k; needs ``k >= 2``.
    A group of identical scores gives 0.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
    g = _groups(scores, group_size)
    # the identity above, on exact deviations (s_i - (sum - s_i) / (k - 1) leaves rounding noise)
    return (_centred(g) * (group_size / (group_size - 1))).to(g.dtype).reshape(-1)


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ advantages ``[B, T]``: return-to-go, whitened over the whole batch.

    ``G = discounted_returns(token_rewards, mask, gamma)``, then
    ``A = (G - mean) / sqrt(var + eps)`` with mean and unbiased variance over all
    valid tokens of the batch (global whitening, :func:`~megarl.algorithms.masked.whiten`).
    """
    return whiten(discounted_returns(token_rewards, mask, gamma), mask, shift_mean=True, eps=eps)


@torch.no_grad()
def group_std_scale(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``[B]``: what :func:`grpo_advantages` divides each score's deviation by (its group's
    unbiased std + eps), 1 where the group's scores are all equal (there the episode advantage
    is 0 and per-turn differences keep their own scale, instead of one divided by eps)."""
    g = _groups(scores, group_size)
    if group_size < 2:
        return torch.ones_like(g).reshape(-1)
    centred = _centred(g)
    std = (centred.square().sum(dim=1, keepdim=True) / (group_size - 1)).sqrt()
    scale = torch.where(std > 0, std + eps, torch.ones_like(std))
    return scale.expand_as(g).to(g.dtype).reshape(-1)


@torch.no_grad()
def turn_advantages(
    seq_adv: torch.Tensor,
    scores: torch.Tensor,
    turn_rewards: torch.Tensor,
    mask: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Per-turn credit for a group estimator's episode advantages ``[B]``: ``[B, T]``.

    ``turn_rewards`` holds each turn's reward on that turn's last policy token (their row sum
    is the episode's score). A token in turn k gets the rewards from turn k on,
    ``G_k = sum_{j >= k} r_j``, against the same group baseline as the episode::

        A_t = seq_adv + (G_k - score) / scale

    Turn 1 has ``G_1 = score``: its tokens get exactly the episode advantage; a later turn loses
    the rewards given before it, which it could not have earned. ``scale`` is what the estimator
    divided the episode deviation by (GRPO: the group's std, :func:`group_std_scale`; RLOO, Dr.
    GRPO: 1). Masked tokens get 0.
    """
    to_go = discounted_returns(turn_rewards, mask, gamma=1.0)
    s = scores if scores.is_floating_point() else scores.float()
    scale = scale[:, None] if isinstance(scale, torch.Tensor) else scale
    return _zeros_like_masked(seq_adv[:, None] + (to_go - s[:, None]) / scale, mask)


def per_episode(values: torch.Tensor, episode_of: torch.Tensor) -> torch.Tensor:
    """``[E]``: the value of each episode's first row, for per-row values ``[B]`` an episode's rows
    share (its score), ``episode_of[b]`` the episode of row b (every episode has a row)."""
    rows = torch.arange(values.shape[0], device=values.device)
    first = torch.full((int(episode_of.max()) + 1,), values.shape[0], device=values.device)
    return values[first.scatter_reduce(0, episode_of, rows, "amin")]


def broadcast(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence values ``[B]`` copied onto every valid token: ``[B, T]``, 0 on masked tokens."""
    out = seq_adv[:, None].expand(mask.shape)
    return _zeros_like_masked(out, mask)
