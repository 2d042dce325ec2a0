"""Supervised fine-tuning: the mean negative log-likelihood of the completion (assistant) tokens.

The mean is over every completion token of the optimizer step's batch (all micro-batches and
data-parallel ranks), not a mean of per-micro-batch means: a long answer weighs by its length,
as in TRL's ``SFTTrainer`` with ``num_items_in_batch`` (the equality is tested). Prompt, system
and user tokens stay in the context and are masked out.
"""

from __future__ import annotations

import torch


def sft_loss(token_logprobs: torch.Tensor, mask: torch.Tensor, denom: float) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the step's loss: -sum(log p * mask) / ``denom``, where
    ``denom`` is the step's completion-token count; the shares add up to the step's mean."""
    mask = mask.to(token_logprobs.dtype)
    loss = -(token_logprobs * mask).sum() / denom
    return loss, {"sft_loss": loss.detach().clone()}
