"""Where every megatron-core parameter shard comes from in a Hugging Face checkpoint.

A shard is described as a *recipe* (``megarl.models.recipes``): pieces of HF tensors
(a range along one dimension), concatenated along that same dimension, plus zero
padding. From a recipe, loading is reading the pieces, and exporting is writing them
back, so one description serves HF→Megatron, Megatron→HF and the weight converter's
shard-to-shard plans.

The tensors every family shares are laid out here (per tensor-parallel rank r of tp):
- word embeddings / output layer: rows of r of the vocabulary padded to
  ``padded_vocab`` (rows past the real vocabulary are zeros);
- the final norm and the value head: replicated.
Each transformer layer's tensors are the family's (``Family.layer_recipe``: the shared
Llama-style layer in ``megarl.models.families.base``, experts in ``mixtral``, ...).

Parameters are named canonically: megatron-core's names with the *global*
layer and expert index, and the local spec's norm names (the Transformer Engine
spec fuses the norms into the next linear; ``canonical_name`` maps both).
"""

from __future__ import annotations

import re

from megarl.models.arch import family_of
from megarl.models.hf_arch import ModelArch

# The recipe vocabulary, re-exported: megarl.convert is where most callers import it from.
from megarl.models.recipes import Piece, Recipe, ShardLayout, chunk, hf_layer, whole

__all__ = ["IGNORED_HF_TENSORS", "Piece", "Recipe", "ShardLayout", "canonical_name", "hf_layer", "hf_tensor_shapes",
           "recipe"]


def hf_tensor_shapes(arch: ModelArch, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of ``arch``, with its shape, in checkpoint order."""
    h = arch.hidden_size
    family = family_of(arch)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        shapes.update(family.hf_layer_shapes(arch, hf_layer(i)))
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


def recipe(arch: ModelArch, canonical: str, layout: ShardLayout, value_head: bool = False) -> Recipe:
    """The recipe of ``canonical`` on the rank at ``layout``; KeyError for an unknown name."""
    h = arch.hidden_size
    r, tp = layout.tp_rank, layout.tp

    if canonical in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if canonical == "output_layer.weight" and value_head:
            return Recipe(0, (Piece("score.weight", 0, 1),), (1, h))
        if layout.padded_vocab < arch.vocab_size or layout.padded_vocab % tp:
            raise ValueError(f"padded vocab {layout.padded_vocab} must be >= the vocab "
                             f"({arch.vocab_size}) and divisible by tp={tp}")
        source = ("model.embed_tokens.weight"
                  if canonical.startswith("embedding") or arch.tie_embeddings else "lm_head.weight")
        start, stop = chunk(layout.padded_vocab, tp, r)
        real_stop = min(stop, arch.vocab_size)
        pieces = []
        if start < real_stop:
            pieces.append(Piece(source, start, real_stop))
        if stop > max(start, real_stop):
            pieces.append(Piece(None, max(start, real_stop), stop))
        return Recipe(0, tuple(pieces), (stop - start, h))
    if canonical == "decoder.final_layernorm.weight":
        return whole("model.norm.weight", (h,))

    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", canonical)
    if m:
        found = family_of(arch).layer_recipe(arch, m.group(2), hf_layer(int(m.group(1))), layout)
        if found is not None:
            return found
    raise KeyError(canonical)
