"""A scalar head on the GPT backbone: per-token values (critic) or scores (reward model).

It takes the place of GPTModel's ``output_layer`` so megatron-core's forward,
pipeline schedules and checkpointing are used unchanged. The weight is
replicated across tensor-parallel ranks: every TP rank sees the same final
hidden states (gathered first under sequence parallelism), so each computes the
same values and the same gradient.
"""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    def __init__(self, config, hidden_size: int):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype))
        # Same init scale as the HF score heads (normal with std=initializer_range=0.02).
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Each TP rank computes the full-sequence gradient itself, so the backward of the
            # gather only has to take this rank's slice (no reduce-scatter).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return torch.nn.functional.linear(hidden_states, self.weight), None
