"""vLLM's layout of a model's weights: the destination layout the weight sync plans into.

``VLLM_LAYOUT`` is what the vLLM rollout backend hands the sync planner
(``megarl.reshard.plan.build_plan``): the planner knows no engine's layout itself.

Per rank r of TP size T:
- ``embed_tokens`` / ``lm_head``: the vocabulary padded to a multiple of 64 and
  split evenly; rows past the real vocabulary are zeros vLLM keeps;
- the final norm: replicated. Tied embeddings have no separate ``lm_head`` parameter;
- each layer's tensors: the family's (``Family.vllm_layer_recipe``; the Llama-style
  ``qkv_proj`` / ``gate_up_proj`` / ``o_proj`` / ``down_proj`` layout is in
  ``megarl.models.families.base``);
- with vLLM's expert parallelism (``enable_expert_parallel``, EP = the engine's TP size here):
  rank r holds experts [r * E / EP, (r + 1) * E / EP) of each layer, each expert whole (vLLM's
  default linear placement; the engine reports the experts it holds, and a sync against another
  placement is refused by name before any byte moves). Everything else stays split over TP.
"""

from __future__ import annotations

from megarl.models.arch import family_of
from megarl.models.families.base import vllm_kv_heads
from megarl.models.hf_arch import ModelArch
from megarl.models.recipes import Piece, Recipe, chunk, hf_layer, split_block, whole
from megarl.reshard.plan import DestinationLayout

__all__ = ["VLLM_VOCAB_PADDING", "vllm_kv_heads", "vllm_padded_vocab", "vllm_param_names", "vllm_recipe"]

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_param_names(arch: ModelArch, ep_rank: int = 0, ep: int = 1) -> list[str]:
    """vLLM's parameters of ``arch`` on expert-parallel rank ``ep_rank`` of ``ep`` (a fused MoE
    tensor's experts as blocks, ``recipes.block_name``); NotImplementedError where the sync cannot
    fill them."""
    family = family_of(arch)
    names = ["model.embed_tokens.weight"]
    first, stop = chunk(arch.num_experts or 1, ep, ep_rank)
    for i in range(arch.num_layers):
        names += [n for n in family.vllm_layer_names(arch, hf_layer(i))
                  if (expert := split_block(n)[1]) is None or first <= expert < stop]
    names.append("model.norm.weight")
    if not arch.tie_embeddings:
        names.append("lm_head.weight")
    return names


def vllm_recipe(arch: ModelArch, name: str, tp_rank: int, tp: int, ep: int = 1) -> Recipe:
    """The recipe of vLLM's parameter ``name`` on TP rank ``tp_rank`` of ``tp`` (with expert
    parallelism over ``ep`` ranks, a fused MoE tensor's expert blocks are whole); KeyError if unknown."""
    h = arch.hidden_size
    if ep > 1 and split_block(name)[1] is not None:
        tp_rank, tp = 0, 1
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
