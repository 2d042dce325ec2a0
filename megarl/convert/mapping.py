"""Where every megatron-core parameter shard comes from in a Hugging Face checkpoint.

A shard is described as a *recipe*: pieces of HF tensors (a range along one
dimension), concatenated along that same dimension, plus zero padding. From a
recipe, loading is reading the pieces, and exporting is writing them back, so
one description serves HF→Megatron, Megatron→HF and the weight converter's
shard-to-shard plans.

Megatron layouts encoded here (per tensor-parallel rank r of tp):
- ``linear_qkv``: the rank's query groups, each ``[q heads of the group; k; v]``;
- ``linear_fc1`` (SwiGLU): ``[gate rows of r; up rows of r]``;
- ``linear_proj`` / ``linear_fc2``: columns of r (row-parallel);
- word embeddings / output layer: rows of r of the vocabulary padded to
  ``padded_vocab`` (rows past the real vocabulary are zeros);
- norms, router, value head: replicated.

Parameters are named canonically: megatron-core's names with the *global*
layer and expert index, and the local spec's norm names (the Transformer Engine
spec fuses the norms into the next linear; ``canonical_name`` maps both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megarl.models.hf_arch import ModelArch


@dataclass(frozen=True)
class Piece:
    hf: str | None  # HF tensor name; None for zero padding
    start: int  # range along the recipe's dim (of the HF tensor; for padding, only the length counts)
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Recipe:
    dim: int
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]  # shape of the assembled shard

    def hf_names(self) -> list[str]:
        return sorted({p.hf for p in self.pieces if p.hf is not None})


@dataclass(frozen=True)
class ShardLayout:
    """The coordinates of one rank's shards."""

    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1
    padded_vocab: int = 0


def hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def hf_tensor_shapes(arch: ModelArch, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of ``arch``, with its shape, in checkpoint order."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = hf_layer(i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (arch.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (arch.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (arch.num_kv_heads * d, h)
        if arch.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (arch.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (arch.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (arch.num_kv_heads * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, arch.num_heads * d)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch.is_moe:
            shapes[p + "block_sparse_moe.gate.weight"] = (arch.num_experts, h)
            for e in range(arch.num_experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                shapes[q + "w1.weight"] = (f, h)
                shapes[q + "w2.weight"] = (h, f)
                shapes[q + "w3.weight"] = (f, h)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if value_head:
        shapes["score.weight"] = (1, h)
    elif not arch.tie_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


# Names a checkpoint may carry that are not parameters (old rotary buffers).
IGNORED_HF_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")

_TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def canonical_name(local_name: str, global_layer: int | None, ep_rank: int = 0,
                   experts_per_rank: int = 1) -> str:
    """Megatron local parameter name → canonical name (global layer and expert index)."""
    name = local_name
    if global_layer is not None:
        name = re.sub(r"^decoder\.layers\.\d+\.", f"decoder.layers.{global_layer}.", name)
    for te, local in _TE_NORM_NAMES.items():
        name = name.replace(te, local)
    m = re.search(r"\.local_experts\.(\d+)\.", name)
    if m:
        global_expert = ep_rank * experts_per_rank + int(m.group(1))
        name = name[: m.start()] + f".local_experts.{global_expert}." + name[m.end():]
    return name


def _chunk(total: int, parts: int, index: int) -> tuple[int, int]:
    size = total // parts
    return index * size, (index + 1) * size


def _rows(name: str, start: int, stop: int) -> Piece:
    return Piece(name, start, stop)


def recipe(arch: ModelArch, canonical: str, layout: ShardLayout, value_head: bool = False) -> Recipe:
    """The recipe of ``canonical`` on the rank at ``layout``; KeyError for an unknown name."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    r, tp = layout.tp_rank, layout.tp

    if canonical in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if canonical == "output_layer.weight" and value_head:
            return Recipe(0, (Piece("score.weight", 0, 1),), (1, h))
        if layout.padded_vocab < arch.vocab_size or layout.padded_vocab % tp:
            raise ValueError(f"padded vocab {layout.padded_vocab} must be >= the vocab "
                             f"({arch.vocab_size}) and divisible by tp={tp}")
        source = ("model.embed_tokens.weight"
                  if canonical.startswith("embedding") or arch.tie_embeddings else "lm_head.weight")
        start, stop = _chunk(layout.padded_vocab, tp, r)
        real_stop = min(stop, arch.vocab_size)
        pieces = []
        if start < real_stop:
            pieces.append(Piece(source, start, real_stop))
        if stop > max(start, real_stop):
            pieces.append(Piece(None, max(start, real_stop), stop))
        return Recipe(0, tuple(pieces), (stop - start, h))
    if canonical == "decoder.final_layernorm.weight":
        return Recipe(0, (Piece("model.norm.weight", 0, h),), (h,))

    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", canonical)
    if not m:
        raise KeyError(canonical)
    layer, rest = int(m.group(1)), m.group(2)
    p = hf_layer(layer)
    if rest == "input_layernorm.weight":
        return Recipe(0, (Piece(p + "input_layernorm.weight", 0, h),), (h,))
    if rest == "pre_mlp_layernorm.weight":
        return Recipe(0, (Piece(p + "post_attention_layernorm.weight", 0, h),), (h,))
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        groups_per_rank = arch.num_kv_heads // tp
        q_rows = arch.heads_per_group * d
        pieces = []
        for g in range(r * groups_per_rank, (r + 1) * groups_per_rank):
            pieces.append(_rows(f"{p}self_attn.q_proj.{kind}", g * q_rows, (g + 1) * q_rows))
            pieces.append(_rows(f"{p}self_attn.k_proj.{kind}", g * d, (g + 1) * d))
            pieces.append(_rows(f"{p}self_attn.v_proj.{kind}", g * d, (g + 1) * d))
        rows = groups_per_rank * (q_rows + 2 * d)
        return Recipe(0, tuple(pieces), (rows, h) if kind == "weight" else (rows,))
    if rest == "self_attention.linear_proj.weight":
        start, stop = _chunk(arch.num_heads * d, tp, r)
        return Recipe(1, (Piece(p + "self_attn.o_proj.weight", start, stop),), (h, stop - start))
    if rest == "mlp.linear_fc1.weight":
        start, stop = _chunk(f, tp, r)
        return Recipe(0, (Piece(p + "mlp.gate_proj.weight", start, stop),
                          Piece(p + "mlp.up_proj.weight", start, stop)), (2 * (stop - start), h))
    if rest == "mlp.linear_fc2.weight":
        start, stop = _chunk(f, tp, r)
        return Recipe(1, (Piece(p + "mlp.down_proj.weight", start, stop),), (h, stop - start))
    if rest == "mlp.router.weight":
        return Recipe(0, (Piece(p + "block_sparse_moe.gate.weight", 0, arch.num_experts),),
                      (arch.num_experts, h))
    m = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$", rest)
    if m:
        q = f"{p}block_sparse_moe.experts.{int(m.group(1))}."
        start, stop = _chunk(f, tp, r)
        if m.group(2) == "linear_fc1":
            return Recipe(0, (Piece(q + "w1.weight", start, stop), Piece(q + "w3.weight", start, stop)),
                          (2 * (stop - start), h))
        return Recipe(1, (Piece(q + "w2.weight", start, stop),), (h, stop - start))
    raise KeyError(canonical)
