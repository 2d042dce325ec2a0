"""What crosses from the driver to the Megatron ranks when they score or update: one typed batch.

Token tensors are ``[B, L]``; label-position tensors ``[B, L-1]`` (position k predicts token k+1).
Scoring passes need the first four fields; an update adds what its loss reads. The ranks split
every per-row tensor over data-parallel shards and minibatches (``RankBatch.shard``,
``RankBatch.rows``), then into micro-batches (``megarl.workers.microbatches``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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
    ref_logprobs: torch.Tensor | None = None  # KL term in the loss (DPO, KTO: the reference's log-probs)
    rollout_logprobs: torch.Tensor | None = None  # the engine's, for the off-policy corrections
    # -- value updates ----------------------------------------------------------------------------
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # -- the supervised stages (megarl.workers.preference_fns) -------------------------------------
    margin: torch.Tensor | None = None  # [B] reward model: each pair's margin, on both its rows
    desirable: torch.Tensor | None = None  # [B] bool, KTO: each row's label
    kto_kl: float | None = None  # KTO: the step's reference point
    # -- the loss normalisers of every minibatch (megarl.trainer.update_batches.denominators) ----
    denoms: list[float] | None = None
    norm_len: float | None = None

    @property
    def size(self) -> int:
        """B, the batch's sequences."""
        return self.tokens.shape[0]

    def rows(self, start: int, stop: int) -> RankBatch:
        """Sequences ``start:stop``: every per-row tensor sliced, the rest as it is."""
        return self._per_row(lambda value: value[start:stop])

    def shard(self, dp: int, rank: int) -> RankBatch:
        """Data-parallel rank ``rank``'s shard of ``dp`` equal ones."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] % dp:
                raise ValueError(f"batch of {value.shape[0]} sequences does not split over {dp} data-parallel ranks")
        return self._per_row(lambda value: value.chunk(dp)[rank])

    def _per_row(self, cut) -> RankBatch:
        return replace(self, **{f.name: cut(value) for f in fields(self)
                                if isinstance(value := getattr(self, f.name), torch.Tensor) and value.dim() > 0})


# The per-sequence fields a micro-batch holds for its sequences (``megarl.workers.microbatches``):
# every tensor field but the tokens (laid out as the micro-batch's rows) and the routes (its
# rows' model input).
SEQUENCE_FIELDS = tuple(f.name for f in fields(RankBatch) if f.name not in ("tokens", "routes")
                        and f.type.startswith("torch.Tensor"))


def placeholder_routes(rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """R3 routes ``[rows, width, layers, k]`` for padding and placeholder tokens: experts 0..k-1 in
    every layer (a valid routing that no loss reads), with ``like``'s layers, k and dtype."""
    layers, k = like.shape[-2:]
    return torch.arange(k, dtype=like.dtype).expand(rows, width, layers, k).clone()
