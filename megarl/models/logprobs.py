"""Token log-probabilities from tensor-parallel logits, without gathering the vocabulary.

The output layer is padded to a multiple of the TP size (see ``padded_vocab_size``);
the padded rows produce logits too. Left in, they would take probability mass
from the real tokens, so every loss and log-probability leaves them out.
"""

from __future__ import annotations

import torch

from megarl.models.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_stats


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(labels) [...] in float32 from TP-local logits [..., vocab/tp], differentiable.

    Chunked over tokens (see ``megarl.models.vocab_parallel``): beyond the logits it
    allocates a few chunk-sized buffers and per-token vectors, in forward and backward,
    and never writes to ``logits``.
    """
    return vocab_parallel_logprobs(logits, labels, vocab_size)


def token_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Entropy [...] in float32 of the softmax over the real vocabulary, from TP-local logits [..., vocab/tp].

    H = log Z - E_p[logit], with the max and the sums all-reduced over the tensor-parallel
    group, so no rank ever holds more than its slice of the vocabulary. Differentiable
    (an entropy bonus backpropagates through it) with the same chunked, low-memory
    forward and backward as ``token_logprobs``; under ``torch.no_grad`` (metrics) it
    saves nothing.
    """
    return vocab_parallel_entropy(logits, vocab_size)


def next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, entropy: bool = False,
                        chunk_rows: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(tokens[..., 1:]) [..., s-1] in float32 from the logits [..., s, vocab/tp] of ``tokens`` [..., s];
    with ``entropy`` also the entropy of each of those predictions: ``(logprobs, entropy)``.

    The same numbers as ``token_logprobs(logits[..., :-1, :], tokens[..., 1:])`` and
    ``token_entropy(logits[..., :-1, :])``, for less memory in training: the last position is
    dropped inside (slicing first makes autograd allocate a logits-sized zero gradient
    for the slice), and log-probs and entropy share one pass and one gradient buffer.
    ``chunk_rows`` overrides the tokens per chunk (default: a 16 MiB float32 buffer's worth).
    """
    lp, ent = vocab_parallel_stats(logits, tokens[..., 1:], vocab_size, entropy=entropy, drop_last=True,
                                   chunk_rows=chunk_rows)
    return (lp, ent) if entropy else lp
