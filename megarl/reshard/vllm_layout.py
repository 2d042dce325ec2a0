"""vLLM's tensor-parallel layout of Llama-family weights, as HF-piece recipes.

Per rank r of TP size T (vLLM's conventions, which the worker checks against
its live model before any byte moves):
- ``embed_tokens`` / ``lm_head``: the vocabulary padded to a multiple of 64 and
  split evenly; rows past the real vocabulary are zeros vLLM keeps;
- ``qkv_proj``: ``[q heads of r; k heads; v heads]``; when T exceeds the KV
  heads, each rank holds one KV head, replicated over T / num_kv_heads ranks;
- ``gate_up_proj``: ``[gate rows of r; up rows of r]``;
- ``o_proj`` / ``down_proj``: columns of r;
- norms: replicated. Tied embeddings have no separate ``lm_head`` parameter.
"""

from __future__ import annotations

from megarl.convert.mapping import Piece, Recipe, hf_layer
from megarl.models.hf_arch import ModelArch

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_param_names(arch: ModelArch) -> list[str]:
    if arch.is_moe:
        raise NotImplementedError("weight sync into vLLM's fused MoE experts is not supported yet")
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p = hf_layer(i)
        names += [p + "self_attn.qkv_proj.weight"]
        if arch.qkv_bias:
            names += [p + "self_attn.qkv_proj.bias"]
        names += [p + "self_attn.o_proj.weight", p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight",
                  p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not arch.tie_embeddings:
        names.append("lm_head.weight")
    return names


def vllm_kv_heads(arch: ModelArch, tp_rank: int, tp: int) -> tuple[int, int]:
    """The KV heads [first, stop) held by ``tp_rank``."""
    if tp >= arch.num_kv_heads:
        replicas = tp // arch.num_kv_heads
        head = tp_rank // replicas
        return head, head + 1
    per_rank = arch.num_kv_heads // tp
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def vllm_recipe(arch: ModelArch, name: str, tp_rank: int, tp: int) -> Recipe:
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        source = "model.embed_tokens.weight" if arch.tie_embeddings else name
        per_rank = vllm_padded_vocab(arch.vocab_size) // tp
        start, stop = tp_rank * per_rank, (tp_rank + 1) * per_rank
        real_stop = min(stop, arch.vocab_size)
        pieces = [Piece(source, start, real_stop)] if start < real_stop else []
        if stop > max(start, real_stop):
            pieces.append(Piece(None, max(start, real_stop), stop))
        return Recipe(0, tuple(pieces), (per_rank, h))
    if name == "model.norm.weight" or name.endswith("layernorm.weight"):
        return Recipe(0, (Piece(name, 0, h),), (h,))
    layer, rest = name[len("model.layers."):].split(".", 1)
    p = hf_layer(int(layer))
    if rest in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
        kind = rest.rsplit(".", 1)[1]
        q_heads = arch.num_heads // tp
        kv_first, kv_stop = vllm_kv_heads(arch, tp_rank, tp)
        pieces = (
            Piece(f"{p}self_attn.q_proj.{kind}", tp_rank * q_heads * d, (tp_rank + 1) * q_heads * d),
            Piece(f"{p}self_attn.k_proj.{kind}", kv_first * d, kv_stop * d),
            Piece(f"{p}self_attn.v_proj.{kind}", kv_first * d, kv_stop * d),
        )
        rows = (q_heads + 2 * (kv_stop - kv_first)) * d
        return Recipe(0, pieces, (rows, h) if kind == "weight" else (rows,))
    if rest == "self_attn.o_proj.weight":
        width = arch.num_heads * d // tp
        return Recipe(1, (Piece(p + "self_attn.o_proj.weight", tp_rank * width, (tp_rank + 1) * width),), (h, width))
    if rest == "mlp.gate_up_proj.weight":
        rows = f // tp
        start, stop = tp_rank * rows, (tp_rank + 1) * rows
        return Recipe(0, (Piece(p + "mlp.gate_proj.weight", start, stop), Piece(p + "mlp.up_proj.weight", start, stop)),
                      (2 * rows, h))
    if rest == "mlp.down_proj.weight":
        width = f // tp
        return Recipe(1, (Piece(p + "mlp.down_proj.weight", tp_rank * width, (tp_rank + 1) * width),), (h, width))
    raise KeyError(name)
