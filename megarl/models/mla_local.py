"""What megatron-core 0.16.1's multi-latent attention needs on the local layer spec (no Transformer
Engine): to build, and to train at tp > 1.

Building: ``megatron/core/transformer/multi_latent_attention.py`` imports Transformer Engine's
linears from ``megatron.core.extensions.transformer_engine``, which without TE still imports and
binds them to placeholder objects; it then sets ``HAVE_TE = True`` and ``MultiLatentAttention``'s
constructor calls ``isinstance(self.linear_proj, TELinear)``: "TypeError: isinstance() arg 2 must be
a type" for every MLA model on the local spec. Without TE the module's own flag must say so.

Training at tp > 1: the local spec splits ``linear_kv_down_proj`` (kv_lora_rank + the rope key)
over tensor-parallel ranks and gathers its output; the gather's backward keeps each rank's own
columns of the gradient. The latent part's gradient is complete on every rank (the up-projection
after it sums its input gradient over tp), but the rope key is used as it is by every rank's heads:
each rank's gradient of it holds its own heads' share only, and the split drops the others' (the
step-0 gradient norm of a tiny model came out 4.1300 at tp2 against transformers' 4.1459).
``SharedRopeKeyMLA`` sums the rope key's gradient over tp before that split.
"""

from __future__ import annotations

import contextvars
import importlib.util

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

# the config of the MLA layer whose query/key/value projections are running (None: none is)
_RUNNING = contextvars.ContextVar("megarl_mla_config", default=None)
_MEGATRON_GATHER = multi_latent_attention.gather_from_tensor_model_parallel_region


class _GatherWithSharedRopeKey(torch.autograd.Function):
    """All-gather along the last dimension; backward: the last ``rope`` columns' gradient summed over
    the group (the rope key every rank's heads use), then this rank's columns kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rope: int, group) -> torch.Tensor:
        ctx.rope, ctx.group = rope, group
        return mappings._gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rope = grad[..., -ctx.rope:].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        grad = torch.cat((grad[..., :-ctx.rope], rope), dim=-1)
        return mappings._split_along_last_dim(grad, ctx.group), None, None


def _gather(input_: torch.Tensor, group=None) -> torch.Tensor:
    """megatron-core's gather, except for the kv down-projection of a ``SharedRopeKeyMLA`` layer."""
    config = _RUNNING.get()
    group = mappings.get_tensor_model_parallel_group_if_none(group)
    if config is not None and input_.size(-1) * group.size() == config.kv_lora_rank + config.qk_pos_emb_head_dim:
        return _GatherWithSharedRopeKey.apply(input_, config.qk_pos_emb_head_dim, group)
    return _MEGATRON_GATHER(input_, group)


class SharedRopeKeyMLA(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` whose rope key gets its whole gradient at tp > 1."""

    def __init__(self, config, *args, **kwargs) -> None:
        if config.q_lora_rank == config.kv_lora_rank + config.qk_pos_emb_head_dim:
            # the two gathers would be told apart by width only
            raise ValueError(f"q_lora_rank={config.q_lora_rank} equal to kv_lora_rank + qk_rope_head_dim is not "
                             "supported on the local layer spec")
        super().__init__(config, *args, **kwargs)

    def get_query_key_value_tensors(self, *args, **kwargs):
        token = _RUNNING.set(self.config)
        try:
            return super().get_query_key_value_tensors(*args, **kwargs)
        finally:
            _RUNNING.reset(token)


def allow_local_mla() -> None:
    """Sets megatron-core's MLA module's ``HAVE_TE`` to whether Transformer Engine is installed, and
    routes its gathers through ``_gather`` (which changes nothing outside ``SharedRopeKeyMLA``)."""
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    multi_latent_attention.gather_from_tensor_model_parallel_region = _gather
