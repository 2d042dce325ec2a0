"""Core attention for the local (CPU) layer spec through torch's fused SDPA kernel.

megatron-core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]``
scores and walks them several times per layer: a scaled copy, a masked fill, the
softmax, a dropout that runs (mask fill and multiply) even at p = 0, and the same
again backwards. On a CPU those memory-bound passes cost more than the attention
matmuls themselves (measured on SmolLM2-135M with 4 rows of 352 tokens: about a third
of a training step). ``torch.nn.functional.scaled_dot_product_attention`` computes the
same softmax(QK^T * scale + mask) V in blocks, with grouped-query heads read in place.

Only the arithmetic changes: same module, parameters, state dict and masks
(megatron's ``True`` = masked out, a sliding window where the config sets one). Cases
this path does not cover (attention dropout while training, softmax offsets, query-key
layer scaling, packed THD input) run megatron's own forward.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` whose forward runs torch's SDPA kernel."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        # multi-latent attention names its query/key and value widths (which differ); megatron-core's
        # local attention takes neither, while SDPA reads both off the tensors (the config's
        # kv_channels is the value width, which sizes the output)
        super().__init__(*args, **kwargs)

    def _sdpa_applies(self, attention_bias, packed_seq_params) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return (dropout == 0.0 and self.softmax_offset is None and self.scale_mask_softmax.scale is None
                and attention_bias is None and packed_seq_params is None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._sdpa_applies(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        masked = attention_mask  # [b or 1, 1, sq, sk] bool, True = masked out
        causal = False
        window = self.scale_mask_softmax.window_size
        if window is not None:
            from megatron.core.transformer.utils import get_sliding_window_causal_mask

            slide = get_sliding_window_causal_mask(sq, sk, window).to(q.device)
            masked = slide if masked is None else masked | slide
        elif masked is None and self.attn_mask_type == AttnMaskType.causal and sq > 1:
            causal = True
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if masked is None else ~masked, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
