"""What crosses from the driver to the Megatron ranks when they score or update: one typed batch.

Token tensors are ``[B, L]``; label-position tensors ``[B, L-1]`` (position k predicts token k+1).
Scoring passes need the first four fields; an update adds what its loss reads. The ranks split
every tensor over data-parallel shards and micro-batches alike (``megarl.workers.rl_fns``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass
class RankBatch:
    tokens: torch.Tensor  # [B, L] prompt + response, right-padded
    mask: torch.Tensor  # [B, L-1] the label positions a loss (or a response-only forward) covers
    seq_lens: torch.Tensor | None = None  # [B]; without it, each row ends at its mask's last position
    temperature: float = 1.0  # the sampling temperature: the ranks score softmax(logits / T)
    # [B, L, layers, k]: the experts the rollout engine routed each token to; a role built with
    # moe.routing_replay routes there (R3), any other role ignores them
    routes: torch.Tensor | None = None
    # -- policy updates ---------------------------------------------------------------------------
    advantages: torch.Tensor | None = None  # [B, L-1], or [B] for per-sequence advantages
    old_logprobs: torch.Tensor | None = None  # absent: on-policy (the update's own forward is pi_old)
    select_mask: torch.Tensor | None = None  # on-policy: positions whose log-probs/entropy come back
    ref_logprobs: torch.Tensor | None = None  # KL term in the loss
    rollout_logprobs: torch.Tensor | None = None  # the engine's, for the off-policy corrections
    # -- value updates ----------------------------------------------------------------------------
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # -- the loss normalisers of every minibatch (megarl.trainer.update_batches.denominators) ----
    denoms: list[float] | None = None
    norm_len: float | None = None

    def present(self) -> dict[str, Any]:
        """The fields that are set, by name: the ranks slice these, tensor by tensor, into shards
        and micro-batches."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}


def placeholder_routes(rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """R3 routes ``[rows, width, layers, k]`` for padding and placeholder tokens: experts 0..k-1 in
    every layer (a valid routing that no loss reads), with ``like``'s layers, k and dtype."""
    layers, k = like.shape[-2:]
    return torch.arange(k, dtype=like.dtype).expand(rows, width, layers, k).clone()
