"""Token log-probabilities from tensor-parallel logits, without gathering the vocabulary.

The output layer is padded to a multiple of the TP size (see ``padded_vocab_size``);
the padded rows produce logits too. Left in, they would take probability mass
from the real tokens, so every loss and log-probability masks them first.
"""

from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """TP-local logits [..., vocab/tp] with entries of ids >= ``vocab_size`` set to the dtype's minimum."""
    from megatron.core import parallel_state as ps

    per_rank = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * per_rank
    real = vocab_size - start
    if real >= per_rank:
        return logits
    # masked_fill leaves no gradient on the filled entries; the minimum (not -inf) keeps the
    # softmax's max-subtraction finite even on a rank whose whole slice is padding.
    mask = torch.arange(per_rank, device=logits.device) >= max(real, 0)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(labels) [...] from TP-local logits [..., vocab/tp], differentiable."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    masked = mask_padded_vocab(logits.float(), vocab_size)
    # megatron's kernel works in place on its input (subtracts the max, exponentiates) and
    # views it flat: it must get a private, contiguous copy, never the caller's logits.
    if masked.data_ptr() == logits.data_ptr() or not masked.is_contiguous():
        masked = masked.clone(memory_format=torch.contiguous_format)
    return -vocab_parallel_cross_entropy(masked, labels.contiguous())


def token_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Entropy [...] of the softmax over the real vocabulary, from TP-local logits [..., vocab/tp].

    H = log Z - E_p[logit]: the max and the two sums are all-reduced over the
    tensor-parallel group, so no rank ever holds more than its slice of the vocabulary.
    Differentiable: the sums' all-reduce passes gradients straight through.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    masked = mask_padded_vocab(logits.float(), vocab_size)
    # The max only stabilises the exponentials; it carries no gradient.
    shift = masked.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    shifted = masked - shift
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    sum_exp_logit = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return sum_exp.log() - sum_exp_logit / sum_exp
