"""Rotary embeddings at given positions, for rows that hold several sequences.

megatron-core's GPTModel rotates every row by its column index (0..s-1) and uses
``position_ids`` only for learned absolute embeddings. A packed row needs each
sequence's own positions; a row with a shared prompt needs more, since its responses
sit after one another yet each continues from the prompt's last position, so the
distance from a response token to the prompt is not its distance in the row.

A forward hook on the model's rotary module swaps its ``[s, 1, 1, dim]`` angles for
``[s, b, 1, dim]`` angles taken at ``positions`` (rows of one micro-batch may differ);
the local attention's rotation broadcasts over the batch dim as it does over heads. The
hook lives for one call, so nothing in the model changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def rope_at(chunk, positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``chunk`` rotates token ``[b, s]`` by angle ``positions[b, s]`` (long [b, s],
    each below the angles' length: ``s``, or the whole sequence's under context parallelism), for
    every row separately (a ``[1, s]`` ``positions`` serves every row)."""
    from megatron.core.utils import get_attr_wrapped_model

    rope = get_attr_wrapped_model(chunk, "rotary_pos_emb", allow_none=True) if positions is not None else None
    if rope is None:
        yield
        return

    def at_positions(module, args, output):
        angles = output[:, 0, 0, :]  # [s, dim]: the angles of positions 0..s-1
        if int(positions.max()) >= angles.shape[0]:
            raise ValueError(f"rotary angles for {angles.shape[0]} positions, a token at {int(positions.max())}")
        return angles[positions.t().to(angles.device)].unsqueeze(2)  # [s, b, 1, dim]

    hook = rope.register_forward_hook(at_positions)
    try:
        yield
    finally:
        hook.remove()
