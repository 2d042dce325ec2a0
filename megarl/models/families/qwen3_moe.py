"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (QK-norm, explicit head_dim)
with every layer's MLP a mixture of routed SwiGLU experts (``megarl.models.families.moe``), no
shared expert.

HF: ``mlp.gate`` (router) and ``mlp.experts.E.gate_proj/up_proj/down_proj``; the experts are
``moe_intermediate_size`` wide. Routing: a softmax over all experts, the top k kept, and with
``norm_topk_prob`` (true in the released models) renormalised over them, which equals
megatron-core's default (top-k logits, then their softmax); without it the top-k probabilities
are used as they are (megatron-core's ``moe_router_pre_softmax``). Dense layers among sparse ones
(``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused: megatron-core builds one MLP kind
for every layer of a spec.
"""

from __future__ import annotations

from typing import Any

from megarl.models.arch import ModelArch
from megarl.models.families.moe import ExpertNames, RoutedExperts, qwen_moe_fields
from megarl.models.families.qwen3 import Qwen3Family


class Qwen3MoeFamily(RoutedExperts, Qwen3Family):
    names = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{e}.", gate="gate_proj.weight",
                        up="up_proj.weight", down="down_proj.weight")

    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        return {**super().read_hf_config(cfg, source), **qwen_moe_fields(cfg, source),
                "extra": {"norm_topk_prob": bool(cfg.get("norm_topk_prob", True))}}

    def moe_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        # softmax over all experts before the top k, unless the top k are renormalised (equal then)
        return {**super().moe_config_kwargs(arch),
                "moe_router_pre_softmax": not arch.extra.get("norm_topk_prob", True)}


FAMILY = Qwen3MoeFamily("qwen3_moe")
