"""The Llama-style decoder layer that every family here shares, as a ``Family`` to build on.

A layer is RMSNorm -> grouped-query attention with RoPE (fused q/k/v, optional q/k/v
biases) -> RMSNorm -> SwiGLU MLP. A family subclasses ``DecoderFamily`` and overrides
only what it changes (its config fields, its MLP, extra attention tensors).

Megatron layouts (per tensor-parallel rank r of tp):
- ``linear_qkv``: the rank's query groups, each ``[q heads of the group; k; v]``;
- ``linear_fc1`` (SwiGLU): ``[gate rows of r; up rows of r]``;
- ``linear_proj`` / ``linear_fc2``: columns of r (row-parallel);
- norms: replicated.

vLLM's layouts (its Llama-style models, which the worker checks against its live
model before any byte moves):
- ``qkv_proj``: ``[q heads of r; k heads; v heads]``; when tp exceeds the KV heads,
  each rank holds one KV head, replicated over tp / num_kv_heads ranks;
- ``gate_up_proj``: ``[gate rows of r; up rows of r]``;
- ``o_proj`` / ``down_proj``: columns of r; norms: replicated.
"""

from __future__ import annotations

from typing import Any

from megarl.models.arch import ArchError, BlockOptions, ModelArch
from megarl.models.recipes import Piece, Recipe, ShardLayout, chunk, swiglu_fc1, swiglu_fc2, whole

_NORMS = {"input_layernorm.weight": "input_layernorm.weight",  # megatron name -> HF name
          "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}


def vllm_kv_heads(arch: ModelArch, tp_rank: int, tp: int) -> tuple[int, int]:
    """The KV heads [first, stop) vLLM's ``tp_rank`` holds."""
    if tp >= arch.num_kv_heads:
        replicas = tp // arch.num_kv_heads
        head = tp_rank // replicas
        return head, head + 1
    per_rank = arch.num_kv_heads // tp
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


class DecoderFamily:
    """A Llama-style decoder family; ``model_type`` is its HF name."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_type!r})"

    # -- HF config ------------------------------------------------------------------------------

    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ArchError(f"{source}: hidden_act {act!r} is not supported ({self.model_type}: SwiGLU with silu only)")
        # attention_bias puts biases on o_proj too, which megatron-core's linear_proj (no bias
        # with add_bias_linear=False) cannot hold.
        if cfg.get("attention_bias"):
            raise ArchError(f"{source}: attention_bias=true (biases on o_proj too) is not supported")
        sliding = cfg.get("sliding_window")
        return {"qkv_bias": False, "sliding_window": int(sliding) if sliding else None}

    # -- megatron-core --------------------------------------------------------------------------

    def block_options(self, arch: ModelArch) -> BlockOptions:
        # the Llama-style layer; a window (Mistral's) applies to every layer
        return BlockOptions(window=arch.sliding_window)

    def transformer_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {}

    def layer_spec_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {}

    def finish_model(self, model: Any, arch: ModelArch) -> None:
        return None

    # -- HF checkpoint tensors and megatron-core shards -----------------------------------------

    def hf_layer_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        h = arch.hidden_size
        return {prefix + "input_layernorm.weight": (h,), **self.hf_attention_shapes(arch, prefix),
                prefix + "post_attention_layernorm.weight": (h,), **self.hf_mlp_shapes(arch, prefix)}

    def hf_attention_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        h, d = arch.hidden_size, arch.head_dim
        p = prefix + "self_attn."
        shapes = {p + "q_proj.weight": (arch.num_heads * d, h), p + "k_proj.weight": (arch.num_kv_heads * d, h),
                  p + "v_proj.weight": (arch.num_kv_heads * d, h)}
        if arch.qkv_bias:
            shapes |= {p + "q_proj.bias": (arch.num_heads * d,), p + "k_proj.bias": (arch.num_kv_heads * d,),
                       p + "v_proj.bias": (arch.num_kv_heads * d,)}
        shapes[p + "o_proj.weight"] = (h, arch.num_heads * d)
        return shapes

    def hf_mlp_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f = arch.hidden_size, arch.ffn_hidden_size
        p = prefix + "mlp."
        return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h), p + "down_proj.weight": (h, f)}

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
        r, tp = layout.tp_rank, layout.tp
        if rest in _NORMS:
            return whole(prefix + _NORMS[rest], (h,))
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            groups_per_rank = arch.num_kv_heads // tp
            q_rows = arch.heads_per_group * d
            pieces = []
            for g in range(r * groups_per_rank, (r + 1) * groups_per_rank):
                pieces.append(Piece(f"{prefix}self_attn.q_proj.{kind}", g * q_rows, (g + 1) * q_rows))
                pieces.append(Piece(f"{prefix}self_attn.k_proj.{kind}", g * d, (g + 1) * d))
                pieces.append(Piece(f"{prefix}self_attn.v_proj.{kind}", g * d, (g + 1) * d))
            rows = groups_per_rank * (q_rows + 2 * d)
            return Recipe(0, tuple(pieces), (rows, h) if kind == "weight" else (rows,))
        if rest == "self_attention.linear_proj.weight":
            start, stop = chunk(arch.num_heads * d, tp, r)
            return Recipe(1, (Piece(prefix + "self_attn.o_proj.weight", start, stop),), (h, stop - start))
        if rest == "mlp.linear_fc1.weight":
            return swiglu_fc1(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight", f, h, r, tp)
        if rest == "mlp.linear_fc2.weight":
            return swiglu_fc2(prefix + "mlp.down_proj.weight", f, h, r, tp)
        return None

    # -- vLLM -----------------------------------------------------------------------------------

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        names = [prefix + "self_attn.qkv_proj.weight"]
        if arch.qkv_bias:
            names.append(prefix + "self_attn.qkv_proj.bias")
        return names + [prefix + "self_attn.o_proj.weight", prefix + "mlp.gate_up_proj.weight",
                        prefix + "mlp.down_proj.weight", prefix + "input_layernorm.weight",
                        prefix + "post_attention_layernorm.weight"]

    def vllm_layer_recipe(self, arch: ModelArch, rest: str, prefix: str, tp_rank: int, tp: int) -> Recipe | None:
        h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return whole(prefix + rest, (h,))
        if rest in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
            kind = rest.rsplit(".", 1)[1]
            q_heads = arch.num_heads // tp
            kv_first, kv_stop = vllm_kv_heads(arch, tp_rank, tp)
            pieces = (
                Piece(f"{prefix}self_attn.q_proj.{kind}", tp_rank * q_heads * d, (tp_rank + 1) * q_heads * d),
                Piece(f"{prefix}self_attn.k_proj.{kind}", kv_first * d, kv_stop * d),
                Piece(f"{prefix}self_attn.v_proj.{kind}", kv_first * d, kv_stop * d),
            )
            rows = (q_heads + 2 * (kv_stop - kv_first)) * d
            return Recipe(0, pieces, (rows, h) if kind == "weight" else (rows,))
        if rest == "self_attn.o_proj.weight":
            width = arch.num_heads * d // tp
            return Recipe(1, (Piece(prefix + "self_attn.o_proj.weight", tp_rank * width, (tp_rank + 1) * width),),
                          (h, width))
        if rest == "mlp.gate_up_proj.weight":
            return swiglu_fc1(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight", f, h, tp_rank, tp)
        if rest == "mlp.down_proj.weight":
            return swiglu_fc2(prefix + "mlp.down_proj.weight", f, h, tp_rank, tp)
        return None

    # -- the planner's parameter count ----------------------------------------------------------

    def layer_params(self, arch: ModelArch, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
        dense = self.attention_params(arch, tp)
        mlp_dense, expert = self.mlp_params(arch, tp, ep, etp)
        return dense + mlp_dense, expert

    def layer_params_at(self, arch: ModelArch, layer: int, tp: int, ep: int,
                        etp: int | None = None) -> tuple[list[int], list[int]]:
        """``layer_params`` of 0-based ``layer``: the same for every layer, except in a family whose
        layers differ (DeepSeek-V3's first dense layers)."""
        return self.layer_params(arch, tp, ep, etp)

    def attention_params(self, arch: ModelArch, tp: int) -> list[int]:
        """Input norm, fused qkv, output projection, pre-MLP norm[, qkv bias] on one rank."""
        h, d = arch.hidden_size, arch.head_dim
        qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * d // tp
        dense = [h, qkv_out * h, arch.num_heads * d // tp * h, h]
        if arch.qkv_bias:
            dense.append(qkv_out)
        return dense

    def mlp_params(self, arch: ModelArch, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
        """(dense, expert) tensors of the MLP on one rank: fc1 (gate and up fused), fc2."""
        if arch.is_moe:  # a hand-made arch: counting its experts as one dense MLP would be silently wrong
            raise ArchError(f"family {self.model_type!r} has a dense MLP, but num_experts={arch.num_experts}")
        h, ffn = arch.hidden_size, arch.ffn_hidden_size // tp
        return [2 * ffn * h, ffn * h], []
