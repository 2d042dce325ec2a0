"""What the Megatron ranks send back to the driver, and how the driver puts shards together.

Every rank works on its data-parallel shard; one rank of each shard reports (``reporting``: last
pipeline stage, tensor and context rank 0), the others return None. Scoring passes report a
``ShardResult`` (its sequences' results in the shard's order), updates an ``UpdateResult``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algorithms.base import Reduce
from megarl.workers.megatron_model import HeldModel


@dataclass
class TokenStats:
    """Per-token results ``[n, L-1]`` at label positions: log-probs, and each prediction's entropy."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


@dataclass
class ShardResult:
    """One data-parallel shard's results, in the shard's order: log-probs (with their entropy:
    ``TokenStats``) or values ``[n, L-1]``, or scores ``[n]``."""

    dp_rank: int
    value: torch.Tensor | TokenStats


@dataclass
class UpdateResult:
    """An update's report from one shard."""

    steps: list[dict[str, float]]  # the metrics of each optimizer step
    reduce: dict[str, Reduce]  # how the shards' values of each metric combine (``megarl.algorithms.base.Metric``)
    # per-token outputs of the loss (the pre-update model's), when one step covered the shard once
    per_token: ShardResult | None = None


def gather_shards(results: list[ShardResult | None]) -> torch.Tensor | TokenStats:
    """The reporting ranks' results -> one value in data-parallel order (concatenated on dim 0)."""
    shards = sorted((r for r in results if r is not None), key=lambda r: r.dp_rank)
    values = [s.value for s in shards]
    if isinstance(values[0], TokenStats):
        entropy = None if values[0].entropy is None else torch.cat([v.entropy for v in values])
        return TokenStats(torch.cat([v.logprobs for v in values]), entropy)
    return torch.cat(values)


def reporting(model: HeldModel) -> bool:
    """Whether this rank reports its shard's results."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True) and model.info.tp_rank == model.info.cp_rank == 0
