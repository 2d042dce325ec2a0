"""Reward-model training on preference pairs (Bradley-Terry): -log sigmoid(r_chosen - r_rejected - margin).

A pair's scores are the reward model's outputs (its value head at the last token) for the same
prompt with the chosen and the rejected answer. ``margin`` (per pair, optional) asks for a
larger gap where the data says one answer is much better (Llama 2's margin loss). The loss is
the mean over the step's pairs; TRL's ``RewardTrainer`` computes the same (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, denom: float,
                       margin: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the step's loss over ``denom`` pairs (the step's count), and
    metrics as shares of the step's means: ``rm/accuracy`` (chosen scored higher), ``rm/margin``
    (r_chosen - r_rejected), ``rm/chosen`` and ``rm/rejected`` (mean scores)."""
    gap = chosen - rejected
    per_pair = -F.logsigmoid(gap - margin if margin is not None else gap)
    loss = per_pair.sum() / denom
    with torch.no_grad():
        metrics = {"rm_loss": loss.detach().clone(), "rm/accuracy": (gap > 0).float().sum() / denom,
                   "rm/margin": gap.sum() / denom, "rm/chosen": chosen.sum() / denom,
                   "rm/rejected": rejected.sum() / denom}
    return loss, metrics
