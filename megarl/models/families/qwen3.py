"""Qwen3 (dense): a Llama-style decoder with QK-norm, no q/k/v biases and an explicit head_dim.

QK-norm is an RMSNorm over each attention head's query and key (one weight of head_dim
each, shared by all heads), applied after the projections and before RoPE:
- HF: ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight``;
- megatron-core: ``qk_layernorm=True`` in the config and the layer spec (``BlockOptions.qk_norm``), giving
  ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight``, replicated over
  tensor-parallel ranks (each rank normalises its own heads with the whole weight;
  megatron-core sums the weight's gradients over them when the config says qk_layernorm);
- vLLM: ``self_attn.q_norm.weight`` / ``k_norm.weight``, replicated.
``head_dim`` may differ from hidden_size / num_heads: it is megatron-core's kv_channels,
read for every family by ``megarl.models.hf_arch``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megarl.models.arch import BlockOptions, ModelArch
from megarl.models.families.base import DecoderFamily
from megarl.models.families.qwen2 import qwen_sliding_window
from megarl.models.recipes import Recipe, ShardLayout, whole

# megatron-core name -> HF name (the same in vLLM), inside self-attention
_QK_NORMS = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}


class Qwen3Family(DecoderFamily):
    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        # attention_bias (on o_proj too) is refused as for Llama; the window is Qwen's
        qwen_sliding_window(cfg, source, "Qwen3")
        return {**super().read_hf_config(cfg, source), "sliding_window": None}

    def block_options(self, arch: ModelArch) -> BlockOptions:
        # qk_norm also makes megatron-core reduce the norms' grads over TP (its qk_layernorm)
        return replace(super().block_options(arch), qk_norm=True)

    def hf_attention_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().hf_attention_shapes(arch, prefix),
                **{prefix + hf: (arch.head_dim,) for hf in _QK_NORMS.values()}}

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        if rest in _QK_NORMS:
            return whole(prefix + _QK_NORMS[rest], (arch.head_dim,))
        return super().layer_recipe(arch, rest, prefix, layout)

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        return super().vllm_layer_names(arch, prefix) + [prefix + hf for hf in _QK_NORMS.values()]

    def vllm_layer_recipe(self, arch: ModelArch, rest: str, prefix: str, tp_rank: int, tp: int) -> Recipe | None:
        if rest in _QK_NORMS.values():
            return whole(prefix + rest, (arch.head_dim,))
        return super().vllm_layer_recipe(arch, rest, prefix, tp_rank, tp)

    def attention_params(self, arch: ModelArch, tp: int) -> list[int]:
        return super().attention_params(arch, tp) + [arch.head_dim, arch.head_dim]  # q and k norms, replicated


FAMILY = Qwen3Family("qwen3")
