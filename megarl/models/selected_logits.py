"""Logits at chosen positions only: the output layer runs on the hidden states that matter.

An RL step needs log-probabilities of the response tokens alone, yet a plain forward
projects every position (prompt and padding included) onto the vocabulary: for a
small model with a large vocabulary that projection and its log-softmax are a fifth
or more of the forward and backward (SmolLM2-135M: 576 x 49152 against ~106M
parameters in the layers). Here a forward pre-hook on megatron's output layer picks
the rows first, so the chunk returns ``[1, n, vocab/tp]`` logits for ``n`` positions.

The hook lives for one call (it is registered and removed around it), so the
model's modules, state dict and checkpoints are untouched, and any pipeline stage
without the output layer simply runs as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def output_layer(chunk) -> torch.nn.Module | None:
    """The vocabulary projection of a (possibly DDP-wrapped) chunk; None off the last stage."""
    from megatron.core.utils import get_attr_wrapped_model

    if not get_attr_wrapped_model(chunk, "post_process", allow_none=True):
        return None
    return get_attr_wrapped_model(chunk, "output_layer", allow_none=True)


@contextlib.contextmanager
def logits_at(chunk, positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``chunk``'s output layer sees only the hidden states at ``positions``
    (long [n], indices into the rows x width of its input flattened in row-major order) and
    the chunk returns their logits as ``[1, n, vocab/tp]``.

    Under sequence parallelism each rank holds a slice of the sequence; the slices are
    gathered first (as megatron does for last-token logits at inference) and the layer runs
    without its own gather until the block ends (it is the model's last module, and its
    backward keeps the setting it ran with). The gather's backward keeps each rank's own
    slice, because the output layer has already all-reduced the input gradient over the group.
    """
    layer = output_layer(chunk) if positions is not None else None
    if layer is None:
        yield
        return
    restore_sp = []

    def pick(module, args, kwargs):
        hidden = args[0]  # [s, b, h]
        if module.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            module.sequence_parallel = False
            restore_sp.append(module)
        rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
        return (rows.index_select(0, positions.to(rows.device)).unsqueeze(1), *args[1:]), kwargs

    hook = layer.register_forward_pre_hook(pick, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
        while restore_sp:
            restore_sp.pop().sequence_parallel = True
