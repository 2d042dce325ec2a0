"""Direct preference optimisation: the policy learns from preference pairs against a frozen reference.

A pair's implicit rewards are ``beta * (log pi(y|x) - log pi_ref(y|x))`` for the chosen and the
rejected answer (log-probs summed over the answer's tokens), and ``delta`` is their difference
over beta. Losses (``DpoConfig.loss_type``):

- ``sigmoid`` (Rafailov et al. 2023): -log sigmoid(beta * delta). With ``label_smoothing`` eps > 0
  it is conservative DPO (Mitchell 2023): the label is trusted with probability 1 - eps,
  -(1 - eps) log sigmoid(beta * delta) - eps log sigmoid(-beta * delta);
- ``ipo`` (Azar et al. 2023): (delta' - 1 / (2 beta))^2, where delta' uses each answer's
  log-ratio averaged over its tokens (the length normalisation the IPO authors used; TRL's too).

With ``rpo_alpha`` > 0 each pair's loss adds ``rpo_alpha`` times its chosen answer's
per-token NLL (RPO, Pang et al. 2024: :mod:`megarl.algorithms.rpo`), inside ``dpo_loss``.

The loss is the mean over the step's pairs. ``sigmoid`` and ``ipo`` equal TRL's ``DPOTrainer``
losses on the same model and batch (``tests/test_preference.py``). ``kto`` scores answers one by
one, not in pairs: ``megarl.algorithms.kto``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megarl.algorithms.rpo import chosen_nll
from megarl.config.supervised import DpoConfig


@dataclass
class PairLogprobs:
    """Summed log-probs of each pair's answers [P] under the policy and the reference, and the
    answers' token counts [P] (IPO's normaliser)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def dpo_loss(pairs: PairLogprobs, settings: DpoConfig, denom: float) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the step's loss over ``denom`` pairs (the step's count), and
    metrics as shares of the step's means: implicit rewards of the chosen and rejected answers,
    their margin, and the fraction of pairs where the chosen one's is higher (``dpo/accuracy``)."""
    chosen_ratio = pairs.chosen - pairs.ref_chosen
    rejected_ratio = pairs.rejected - pairs.ref_rejected
    beta = settings.beta
    if settings.loss_type == "sigmoid":
        delta = chosen_ratio - rejected_ratio
        eps = settings.label_smoothing
        per_pair = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif settings.loss_type == "ipo":
        delta = (chosen_ratio / pairs.chosen_tokens.clamp(min=1) - rejected_ratio / pairs.rejected_tokens.clamp(min=1))
        per_pair = (delta - 1 / (2 * beta)) ** 2
    else:  # kto scores each answer alone, against a batch-wide reference point
        raise ValueError(f"dpo_loss has no pairwise loss_type {settings.loss_type!r} (kto: megarl.algorithms.kto)")
    if settings.rpo_alpha:
        per_pair = per_pair + settings.rpo_alpha * chosen_nll(pairs.chosen, pairs.chosen_tokens)
    loss = per_pair.sum() / denom
    with torch.no_grad():
        reward_chosen, reward_rejected = beta * chosen_ratio, beta * rejected_ratio
        metrics = {"dpo_loss": loss.detach().clone(),
                   "dpo/accuracy": (reward_chosen > reward_rejected).float().sum() / denom,
                   "dpo/margin": (reward_chosen - reward_rejected).sum() / denom,
                   "dpo/reward_chosen": reward_chosen.sum() / denom,
                   "dpo/reward_rejected": reward_rejected.sum() / denom}
    return loss, metrics
