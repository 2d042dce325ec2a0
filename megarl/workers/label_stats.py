"""The model's outputs on a micro-batch's rows, read at each of its sequences' label positions.

Per-token results come back ``[b, T]``, as the padded batch would hold them (0 past a sequence's
end); under context parallelism each rank computes its share of the positions and the group
gathers the numbers, never the logits (``megarl.models.context_parallel``).
"""

from __future__ import annotations

import torch

from megarl.models.context_parallel import CpSplit
from megarl.models.logprobs import next_token_logprobs
from megarl.models.vocab_parallel import vocab_parallel_stats
from megarl.workers.microbatches import MicroBatch


def per_label(x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Per-position outputs of the rows, ``[rows, width-1, ...]`` -> each sequence's label
    positions ``[b, T, ...]`` (what the padded batch would have; 0 past a sequence's end)."""
    picked = x.reshape(-1, *x.shape[2:])[mb.gather]
    valid = mb.valid.reshape(*mb.valid.shape, *([1] * (picked.dim() - 2)))
    return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def label_stats(logits: torch.Tensor, mb: MicroBatch, vocab: int, entropy: bool = False):
    """log p(next token) [b, T] of each sequence (and, with ``entropy``, each prediction's entropy),
    computed on the rows in one pass, where a packed sequence's last position predicts the next
    one's first token: never gathered. Passing the whole logits (not ``logits[:, :-1]``) spares
    autograd a logits-sized gradient for the slice. Logits of selected positions only
    (``[1, n, vocab/tp]``) give results there and 0 at the other label positions.

    ``mb.temperature`` (the rollout's): the distribution the tokens were sampled from is
    softmax(logits / T), and so is the one scored and trained here."""
    if mb.temperature != 1.0:  # skipped at 1: the division would copy the logits for nothing
        logits = logits / mb.temperature
    if (split := cp_split(mb)) is not None:  # this rank's positions: gather the numbers
        lp, ent = vocab_parallel_stats(logits, split.next_tokens(mb.tokens), vocab, entropy=entropy)
        keep = mb.cp_keep if mb.cp_keep is not None else mb.valid

        def place(gathered):
            x = per_label(gathered[:, :-1], mb)
            return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

        if not entropy:
            return place(split.gather(lp))
        both = split.gather(torch.stack((lp, ent), dim=-1))  # one all-gather for the two
        return place(both[..., 0]), place(both[..., 1])
    if mb.selected_at is not None:
        lp, ent = vocab_parallel_stats(logits[0], mb.selected_labels, vocab, entropy=entropy)
        b, t = mb.valid.shape

        def place(x):
            out = x.new_zeros(b * t).index_copy(0, mb.selected_at, x).view(b, t)
            return out * 0 if mb.selected_zero else out

        return (place(lp), place(ent)) if entropy else place(lp)
    if not entropy:
        return per_label(next_token_logprobs(logits, mb.tokens, vocab), mb)
    lp, ent = next_token_logprobs(logits, mb.tokens, vocab, entropy=True)
    return per_label(lp, mb), per_label(ent, mb)


def cp_split(mb: MicroBatch) -> CpSplit | None:
    """The micro-batch's context-parallel split (None: each rank has whole rows)."""
    return mb.inputs.cp


def positions(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """A per-position output ``[rows, width, ...]`` (a value head's): under context parallelism the
    model gives each rank its share, gathered here (logits never are: ``label_stats``)."""
    split = cp_split(mb)
    return output if split is None else split.gather(output)
