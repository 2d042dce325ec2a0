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

    # megatron's kernel views its input flat: callers' slices (logits[:, :-1]) must be copied
    masked = mask_padded_vocab(logits.float(), vocab_size).contiguous()
    return -vocab_parallel_cross_entropy(masked, labels.contiguous())
