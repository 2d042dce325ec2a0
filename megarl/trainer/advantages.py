"""From scores and log-probabilities to advantages (and PPO returns): the trainer's entry points,
delegating to the algorithm of ``algorithm.name`` (:mod:`megarl.algorithms.registry`). New code can
call ``get_algorithm(cfg.name)`` directly; these keep the trainer's dict-based signatures."""

from __future__ import annotations

import torch

from megarl.algorithms.base import ScoredBatch
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.registry import ALGORITHMS, get_algorithm
from megarl.config.schema import AlgorithmConfig

__all__ = ["ALGORITHMS", "estimate", "kl_mean", "needs_old_logprobs"]


def needs_old_logprobs(algo: AlgorithmConfig) -> bool:
    """Whether the step scores the rollout under the actor before updating it (see ``Algorithm.needs_old_logprobs``)."""
    return get_algorithm(algo.name).needs_old_logprobs(algo)


def estimate(algo: AlgorithmConfig, scores: torch.Tensor, mask: torch.Tensor, group_size: int,
             old: dict[str, torch.Tensor] | None, ref_logprobs: torch.Tensor | None = None,
             values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Returns ``advantages`` [B, T], the (possibly reduced) ``mask``, and ``returns`` for PPO.
    ``old`` (the actor's ``logprobs`` before the update) is needed for KL in the reward only."""
    batch = ScoredBatch(scores, mask, group_size, old_logprobs=None if old is None else old["logprobs"],
                        ref_logprobs=ref_logprobs, values=values)
    return get_algorithm(algo.name).estimate(algo, batch).as_dict()


def kl_mean(kl: torch.Tensor | None, mask: torch.Tensor) -> float:
    return float(masked_mean(kl, mask)) if kl is not None else 0.0
