"""vLLM's layout of a model's weights: the destination layout the weight sync plans into.

``VLLM_LAYOUT`` is what the vLLM rollout backend hands the sync planner
(``megarl.reshard.plan.build_plan``): the planner knows no engine's layout itself.
The recipes are implemented in ``megarl.reshard.vllm_layout`` until the modules that
still import them from there switch to this one (see its docstring); import them from here.
"""

from __future__ import annotations

from megarl.reshard.plan import DestinationLayout
from megarl.reshard.vllm_layout import (
    VLLM_VOCAB_PADDING,
    vllm_kv_heads,
    vllm_padded_vocab,
    vllm_param_names,
    vllm_recipe,
)

__all__ = ["VLLM_LAYOUT", "VLLM_VOCAB_PADDING", "vllm_kv_heads", "vllm_padded_vocab", "vllm_param_names",
           "vllm_recipe"]

VLLM_LAYOUT = DestinationLayout(engine="vLLM", param_names=vllm_param_names, recipe=vllm_recipe)
