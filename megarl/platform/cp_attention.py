"""Context-parallel core attention for the local (CPU) layer spec.

Under context parallelism (cp ranks) each rank holds 2 of the sequence's ``2 * cp`` equal
chunks: chunk ``r`` and chunk ``2 * cp - 1 - r`` (megatron-core's load-balanced split, the
one Transformer Engine's attention expects: under a causal mask an early chunk sees few keys
and a late one many, so each rank gets one of each). Transformer Engine does the attention
itself on GPU; megatron-core's local ``DotProductAttention`` refuses ``cp > 1``. This module
is the local spec's: every rank all-gathers the keys and values of the whole sequence over
the context-parallel group, puts the chunks back in sequence order and attends its own
queries to them with the causal (and sliding-window) mask of their global positions. That
is the all-gather form of context parallelism (Llama 3's): keys and values cross the group
once per layer, activations and scores stay split ``cp`` ways. Backward, each rank's key
and value gradients are summed over the group, since every rank's queries read every key.

Packed (THD) input is not handled here: megarl refuses packing under context parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.platform.cp_chunks import global_positions, own_share, to_sequence_order
from megarl.platform.sdpa_attention import SDPAttention


class _GatherKeys(torch.autograd.Function):
    """Each rank's keys (or values) ``[s_local, ...]`` -> the whole sequence's ``[s, ...]``; backward,
    the gradient of every rank's use of the rank's share is summed over the group."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, group) -> torch.Tensor:
        cp = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(share) for _ in range(cp)]
        torch.distributed.all_gather(parts, share.contiguous(), group=group)
        ctx.group, ctx.cp, ctx.rank = group, cp, torch.distributed.get_rank(group)
        return to_sequence_order(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return own_share(grad, ctx.cp, ctx.rank, dim=0), None


class ContextParallelAttention(SDPAttention):
    """``DotProductAttention`` (its parameters, state dict and settings) whose queries are this
    rank's share of the sequence and whose keys are the whole sequence's, gathered."""

    def __init__(self, config, *args, **kwargs):
        cp = config.context_parallel_size
        config.context_parallel_size = 1  # the parent refuses cp > 1: it cannot split the sequence
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import parallel_state as ps

        if packed_seq_params is not None or attention_bias is not None or attention_mask is not None:
            raise ValueError("context-parallel attention runs on right-padded rows under the causal mask only "
                             "(no packing, attention bias or explicit mask)")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("context-parallel attention has no attention dropout")
        group = ps.get_context_parallel_group()
        cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        sq, b = query.shape[0], query.shape[1]
        keys, values = _GatherKeys.apply(key, group), _GatherKeys.apply(value, group)
        q_pos = global_positions(sq, cp, rank, device=query.device)
        k_pos = torch.arange(keys.shape[0], device=query.device)
        masked = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [sq, s]: True = not attended
        window = self.scale_mask_softmax.window_size
        if window is not None:  # (left, 0): the ``left`` tokens before a query, and itself
            masked |= k_pos.unsqueeze(0) < q_pos.unsqueeze(1) - window[0]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, keys, values))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, scale=self.softmax_scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
