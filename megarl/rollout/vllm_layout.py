"""vLLM's layout of a model's weights: the destination layout the weight sync plans into.

``VLLM_LAYOUT`` is what the vLLM rollout backend hands the sync planner
(``megarl.reshard.plan.build_plan``): the planner knows no engine's layout itself.

Per rank r of TP size T:
- ``embed_tokens`` / ``lm_head``: the vocabulary padded to a multiple of 64 and
  split evenly; rows past the real vocabulary are zeros vLLM keeps;
- the final norm: replicated. Tied embeddings have no separate ``lm_head`` parameter;
- each layer's tensors: the family's (``Family.vllm_layer_recipe``; the Llama-style
  ``qkv_proj`` / ``gate_up_proj`` / ``o_proj`` / ``down_proj`` layout is in
  ``megarl.models.families.base``).
"""

from __future__ import annotations

from megarl.models.arch import family_of
from megarl.models.families.base import vllm_kv_heads
from megarl.models.hf_arch import ModelArch
from megarl.models.recipes import Piece, Recipe, hf_layer, whole
from megarl.reshard.plan import DestinationLayout

__all__ = ["VLLM_VOCAB_PADDING", "vllm_kv_heads", "vllm_padded_vocab", "vllm_param_names", "vllm_recipe"]

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_param_names(arch: ModelArch) -> list[str]:
    """vLLM's parameters of ``arch``; NotImplementedError where the sync cannot fill them."""
    family = family_of(arch)
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        names += family.vllm_layer_names(arch, hf_layer(i))
    names.append("model.norm.weight")
    if not arch.tie_embeddings:
        names.append("lm_head.weight")
    return names


def vllm_recipe(arch: ModelArch, name: str, tp_rank: int, tp: int) -> Recipe:
    """The recipe of vLLM's parameter ``name`` on TP rank ``tp_rank`` of ``tp``; KeyError if unknown."""
    h = arch.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        source = "model.embed_tokens.weight" if arch.tie_embeddings else name
        per_rank = vllm_padded_vocab(arch.vocab_size) // tp
        start, stop = tp_rank * per_rank, (tp_rank + 1) * per_rank
        real_stop = min(stop, arch.vocab_size)
        pieces = [Piece(source, start, real_stop)] if start < real_stop else []
        if stop > max(start, real_stop):
            pieces.append(Piece(None, max(start, real_stop), stop))
        return Recipe(0, tuple(pieces), (per_rank, h))
    if name == "model.norm.weight":
        return whole(name, (h,))
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers."):].split(".", 1)
        found = family_of(arch).vllm_layer_recipe(arch, rest, hf_layer(int(layer)), tp_rank, tp)
        if found is not None:
            return found
    raise KeyError(name)


VLLM_LAYOUT = DestinationLayout(engine="vLLM", param_names=vllm_param_names, recipe=vllm_recipe)
