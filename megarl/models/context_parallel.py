"""Context parallelism on the data side: each rank's share of a micro-batch's sequence, and
its per-position results put back together.

The model runs on ``[rows, width / cp]`` tokens per rank (``RowsInputs.cp_share``: chunks ``r``
and ``2 cp - 1 - r`` of ``2 cp``, see ``megarl.platform.cp_attention``), with each token's
rotary angle taken at its position in the whole row. The losses are the ones of ``cp = 1``:
each rank computes its positions' per-token statistics (log-probs, entropies, values), the
group all-gathers those ``[rows, width]`` numbers (never the ``[rows, width, vocab]``
logits) and every rank evaluates the same loss on them. Backward, a rank keeps the gradient
of its own positions only; the parameter gradients of the ranks add up to the whole
sequence's (megatron-core's data-parallel reduction averages over dp x cp and its schedule
multiplies each loss by cp, so the sum is what is applied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.platform.cp_chunks import global_positions, own_share, to_sequence_order


def sequence_multiple(tp: int, sequence_parallel: bool, cp: int) -> int:
    """What a row's width must divide by: the tp ranks' shares under sequence parallelism, times
    the 2 x cp load-balanced chunks under context parallelism."""
    return (tp if sequence_parallel else 1) * (2 * cp if cp > 1 else 1)


@dataclass(frozen=True)
class CpSplit:
    """This rank's share of rows ``width`` tokens wide."""

    cp: int
    rank: int
    width: int  # the whole row's

    @property
    def positions(self) -> torch.Tensor:
        """The row positions of this rank's tokens, ``[width / cp]``."""
        return global_positions(self.width // self.cp, self.cp, self.rank)

    def next_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token each of this rank's positions predicts, ``[rows, width / cp]``, from the whole
        rows ``tokens`` ``[rows, width]`` (the last position predicts nothing: token 0 stands in)."""
        following = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
        return following[:, self.positions.to(tokens.device)]

    def gather(self, share: torch.Tensor) -> torch.Tensor:
        """This rank's per-position results ``[rows, width / cp, ...]`` -> the whole rows'
        ``[rows, width, ...]``, the same on every rank of the group."""
        return _GatherPositions.apply(share, self.cp, self.rank)


class _GatherPositions(torch.autograd.Function):
    """Every rank computes the same loss from the gathered results, so each keeps the gradient of
    its own share (no sum: the other ranks' gradients of it are the same numbers)."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        parts = [torch.empty_like(share) for _ in range(cp)]
        torch.distributed.all_gather(parts, share.contiguous(), group=ps.get_context_parallel_group())
        ctx.cp, ctx.rank = cp, rank
        return to_sequence_order(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return own_share(grad, ctx.cp, ctx.rank, dim=1), None, None
