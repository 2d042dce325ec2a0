"""The transformer layer a family's ``BlockOptions`` describe, as megatron-core modules.

The platform's layer spec (``megarl.platform.gpt_layer_spec``) is the Llama-style layer. Where
a family's options differ, megatron-core's own modules are swapped or subclassed inside that
spec, so the layer, its attention and its MLP stay megatron-core's:
- zero-centred norms: every RMSNorm of the layer (input, pre-MLP, q/k, sandwich) and the final one is
  ``RMSNorm1p``, whose stored weight w is applied as (1 + w), in fp32 and cast back, as HF's
  Gemma norms compute it (the local spec's torch norms refuse megatron's zero-centred gamma);
- sandwich norms: ``linear_proj`` and the MLP's ``linear_fc2`` normalise their own output
  (``post_norm``) before the residual add, which megatron-core's layer has no slot for;
- windowed layers with a rotary base of their own: their self-attention turns the model's
  rotary angles into its own (``LocalRopeSelfAttention``).
The rest are TransformerConfig fields (``config_kwargs``): the activation, the window and
which layers it applies to (``window_attn_skip_freq``), the score scale (``softmax_scale``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import is_layer_window_attention

from megarl.models.arch import ArchError, BlockOptions

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


def config_kwargs(options: BlockOptions, num_layers: int, fuses_kernels: bool) -> dict[str, Any]:
    """megatron-core TransformerConfig fields of ``options``."""
    kwargs: dict[str, Any] = {
        "normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": ACTIVATIONS[options.activation],
        # megatron-core fuses bias + activation for silu (SwiGLU) and erf-GELU only
        "bias_activation_fusion": fuses_kernels and options.activation == "silu",
        "qk_layernorm": options.qk_norm, "softmax_scale": options.softmax_scale,
        # sliding window over the W most recent tokens, self included (HF semantics)
        "window_size": (options.window - 1, 0) if options.window else None,
    }
    if options.window and options.global_layers is not None:
        kwargs["window_attn_skip_freq"] = [0 if i in options.global_layers else 1 for i in range(num_layers)]
    return kwargs


class RMSNorm1p(torch.nn.Module):
    """RMSNorm whose weight w is applied as (1 + w) (zero-centred, initialised to 0), in fp32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # under sequence parallelism each rank sees its tokens only: megatron-core sums these grads over TP
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class PostNormRowParallelLinear(RowParallelLinear):
    """A row-parallel linear whose (bias-free) output goes through ``post_norm``: a sandwich norm."""

    def __init__(self, *args: Any, post_norm: ModuleSpec | type, config, **kwargs: Any) -> None:
        super().__init__(*args, config=config, **kwargs)
        self.post_norm = build_module(post_norm, config=config, hidden_size=config.hidden_size,
                                      eps=config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any):
        out, bias = super().forward(*args, **kwargs)
        if bias is not None:  # the norm must see the biased output; no family here has one
            raise ValueError("a sandwich norm after a linear layer with a bias is not supported")
        return self.post_norm(out), None


class LocalRopeSelfAttention(SelfAttention):
    """Self-attention whose windowed layers rotate by their own rotary base.

    megatron-core's GPTModel computes one set of angles (position * inv_freq, concatenated twice)
    and hands it to every layer, possibly re-indexed per row (``megarl.models.rope_positions``).
    A windowed layer recovers each token's position from the first angle (its frequency is
    inv_freq[0], a power of the scaling factor) and multiplies by its own frequencies, the same
    fp32 product transformers forms. ``set_local_rope`` gives it both frequencies."""

    def __init__(self, config, submodules, layer_number: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.first_inv_freq: float | None = None
        self.register_buffer("local_inv_freq", None, persistent=False)

    def forward(self, *args: Any, rotary_pos_emb=None, **kwargs: Any):
        if self.windowed and rotary_pos_emb is not None:
            if self.first_inv_freq is None:
                raise RuntimeError("LocalRopeSelfAttention: set_local_rope was not called after the model was built")
            positions = torch.round(rotary_pos_emb[..., :1].float() / self.first_inv_freq)
            freqs = positions * self.local_inv_freq.to(positions.device)
            rotary_pos_emb = torch.cat((freqs, freqs), dim=-1).to(rotary_pos_emb.dtype)
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Unscaled rotary frequencies, as transformers computes them."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def set_local_rope(model, options: BlockOptions, head_dim: int) -> None:
    """Gives each windowed layer its own rotary frequencies (after the model's are final)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if options.local_rope_theta is None or rope is None:
        return
    local = default_inv_freq(options.local_rope_theta, head_dim)
    for module in model.modules():
        if isinstance(module, LocalRopeSelfAttention):
            module.first_inv_freq = float(rope.inv_freq[0])
            module.local_inv_freq = local.to(rope.inv_freq.device)


def finish_block(model, options: BlockOptions) -> None:
    """What a layer spec does not reach: the decoder's final norm (megatron-core builds it from its
    own default) is zero-centred too where the layers' are; call before any weight is loaded."""
    final = getattr(getattr(model, "decoder", None), "final_layernorm", None)  # last pipeline stage only
    if options.zero_centred_norms and final is not None:
        config = model.config
        model.decoder.final_layernorm = RMSNorm1p(config, config.hidden_size, config.layernorm_epsilon)


def layer_spec(options: BlockOptions, spec: ModuleSpec, te: bool, moe: bool) -> ModuleSpec:
    """The platform's layer ``spec`` changed (in place) to build what ``options`` describe."""
    custom = options.zero_centred_norms or options.sandwich_norms or options.local_rope_theta is not None
    if not custom:
        return spec
    if te:  # its norms are fused into the next linear: none of the swaps below would take
        raise ArchError("zero-centred norms, sandwich norms and per-layer rotary bases need the local layer "
                        "spec; the Transformer Engine spec is not supported for this family yet")
    if options.sandwich_norms and moe:
        raise ArchError("sandwich norms on a mixture-of-experts layer are not supported")
    layer, attention = spec.submodules, spec.submodules.self_attention
    norm = RMSNorm1p if options.zero_centred_norms else layer.input_layernorm
    if options.zero_centred_norms:
        layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm1p
        if options.qk_norm:
            attention.submodules.q_layernorm = attention.submodules.k_layernorm = RMSNorm1p
    if options.sandwich_norms:
        attention.submodules.linear_proj = ModuleSpec(module=PostNormRowParallelLinear, params={"post_norm": norm})
        layer.mlp.submodules.linear_fc2 = ModuleSpec(module=PostNormRowParallelLinear, params={"post_norm": norm})
    if options.local_rope_theta is not None:
        attention.module = LocalRopeSelfAttention
    return spec
