"""Gemma-3 (text; HF ``Gemma3ForCausalLM``, model_type ``gemma3_text``): a decoder whose layer
differs from the Llama-style one in its block options (``megarl.models.block`` builds them):
- GeGLU: the gated MLP's activation is tanh-approximated GELU (``hidden_activation``
  ``gelu_pytorch_tanh``);
- every RMSNorm weight w is applied as (1 + w) (stored zero-centred), in fp32;
- four norms per layer: ``input_layernorm`` -> attention -> ``post_attention_layernorm`` ->
  residual add, ``pre_feedforward_layernorm`` -> MLP -> ``post_feedforward_layernorm`` ->
  residual add; and QK-norm (``self_attn.q_norm`` / ``k_norm``) as Qwen3's;
- windowed layers (``layer_types`` ``sliding_attention``, ``sliding_window`` tokens) and
  global ones (``full_attention``), each kind with its own rotary base (``rope_parameters``);
- attention scores scaled by ``query_pre_attn_scalar`` ** -0.5, not head_dim ** -0.5;
and, after the model is built (``finish_model``), embeddings multiplied by sqrt(hidden_size),
cast to the weights' dtype first, as transformers and vLLM do.

Names, megatron-core -> HF (vLLM's are HF's, q/k/v and gate/up fused as for Llama):
``self_attention.linear_proj.post_norm`` -> ``post_attention_layernorm``, ``pre_mlp_layernorm`` ->
``pre_feedforward_layernorm``, ``mlp.linear_fc2.post_norm`` -> ``post_feedforward_layernorm``,
``self_attention.q_layernorm`` / ``k_layernorm`` -> ``self_attn.q_norm`` / ``k_norm``; every norm
is replicated over tensor-parallel ranks. Soft-capping (``final_logit_softcapping``,
``attn_logit_softcapping``: Gemma-2's, null in Gemma-3) is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.models.arch import ArchError, BlockOptions, ModelArch, RopeConfig, required, rope_from_config
from megarl.models.families.base import DecoderFamily
from megarl.models.recipes import Recipe, ShardLayout, whole

# megatron-core name -> HF name (vLLM's too) inside a layer, and the norm's width ("h" or "d")
_NORMS = {"input_layernorm.weight": ("input_layernorm.weight", "h"),
          "self_attention.linear_proj.post_norm.weight": ("post_attention_layernorm.weight", "h"),
          "pre_mlp_layernorm.weight": ("pre_feedforward_layernorm.weight", "h"),
          "mlp.linear_fc2.post_norm.weight": ("post_feedforward_layernorm.weight", "h"),
          "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", "d"),
          "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", "d")}
_HF_NORMS = {hf: width for hf, width in _NORMS.values()}
_LAYER_KINDS = ("sliding_attention", "full_attention")


def _rope(cfg: dict[str, Any], source: str) -> tuple[RopeConfig, float]:
    """(the global layers' rope, the windowed layers' base). transformers 5 writes one
    ``rope_parameters`` per layer kind; older files ``rope_theta``, ``rope_scaling`` (global) and
    ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" not in params:
        return rope_from_config(cfg, source), float(cfg.get("rope_local_base_freq", 10000.0))
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ArchError(f"{source}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not "
                        "supported; supported: default")
    return (rope_from_config({"rope_parameters": params["full_attention"]}, f"{source} (full_attention)"),
            float(local.get("rope_theta", 10000.0)))


class Gemma3Family(DecoderFamily):
    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ArchError(f"{source}: hidden_activation {act!r} is not supported (Gemma-3: gelu_pytorch_tanh only)")
        for key in ("attention_bias", "use_bidirectional_attention", "final_logit_softcapping",
                    "attn_logit_softcapping"):
            if cfg.get(key):
                raise ArchError(f"{source}: {key}={cfg[key]!r} is not supported")
        layers = int(required(cfg, "num_hidden_layers", source))
        kinds = cfg.get("layer_types") or []
        if len(kinds) != layers or set(kinds) - set(_LAYER_KINDS):
            raise ArchError(f"{source}: layer_types must list one of {', '.join(_LAYER_KINDS)} for each of the "
                            f"{layers} layers, got {kinds!r}")
        rope, local_theta = _rope(cfg, source)
        windowed = "sliding_attention" in kinds
        return {"qkv_bias": False, "rope": rope,
                "sliding_window": int(required(cfg, "sliding_window", source)) if windowed else None,
                "extra": {"global_layers": [i for i, kind in enumerate(kinds) if kind == "full_attention"],
                          "local_rope_theta": local_theta,
                          "query_pre_attn_scalar": float(required(cfg, "query_pre_attn_scalar", source))}}

    def block_options(self, arch: ModelArch) -> BlockOptions:
        return BlockOptions(activation="gelu_tanh", zero_centred_norms=True, qk_norm=True, sandwich_norms=True,
                            window=arch.sliding_window, global_layers=tuple(arch.extra["global_layers"]),
                            local_rope_theta=arch.extra["local_rope_theta"],
                            softmax_scale=arch.extra["query_pre_attn_scalar"] ** -0.5)

    def finish_model(self, model: Any, arch: ModelArch) -> None:
        embedding = getattr(model, "embedding", None)  # the first pipeline stage only
        if embedding is None:
            return
        # sqrt(hidden) as an fp32 tensor cast to the weights' dtype, then multiplied (not sqrt(h) in fp32)
        scale = torch.tensor(arch.hidden_size ** 0.5, dtype=torch.float32)
        embedding.word_embeddings.register_forward_hook(lambda module, args, out: out * scale.to(out.dtype))

    def _width(self, arch: ModelArch, kind: str) -> tuple[int, ...]:
        return (arch.hidden_size if kind == "h" else arch.head_dim,)

    def hf_layer_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().hf_layer_shapes(arch, prefix),
                **{prefix + hf: self._width(arch, kind) for hf, kind in _HF_NORMS.items()}}

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        if rest in _NORMS:
            hf, kind = _NORMS[rest]
            return whole(prefix + hf, self._width(arch, kind))
        return super().layer_recipe(arch, rest, prefix, layout)

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        names = super().vllm_layer_names(arch, prefix)
        return names + [prefix + hf for hf in _HF_NORMS if prefix + hf not in names]

    def vllm_layer_recipe(self, arch: ModelArch, rest: str, prefix: str, tp_rank: int, tp: int) -> Recipe | None:
        if rest in _HF_NORMS:
            return whole(prefix + rest, self._width(arch, _HF_NORMS[rest]))
        return super().vllm_layer_recipe(arch, rest, prefix, tp_rank, tp)

    def attention_params(self, arch: ModelArch, tp: int) -> list[int]:
        # + the post-attention and post-MLP norms, and the q and k norms: all replicated
        h, d = arch.hidden_size, arch.head_dim
        return super().attention_params(arch, tp) + [h, h, d, d]


FAMILY = Gemma3Family("gemma3_text")
