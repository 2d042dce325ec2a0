"""Mixtral: a Llama-style decoder whose MLP is a top-k routed mixture of SwiGLU experts
(``megarl.models.families.moe``); routing is softmax over the top-k logits.

HF: ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.E.w1/w2/w3``
(gate / down / up).
"""

from __future__ import annotations

from typing import Any

from megarl.models.arch import required
from megarl.models.families.base import DecoderFamily
from megarl.models.families.moe import ExpertNames, RoutedExperts


class MixtralFamily(RoutedExperts, DecoderFamily):
    names = ExpertNames(router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{e}.",
                        gate="w1.weight", up="w3.weight", down="w2.weight")

    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        return {**super().read_hf_config(cfg, source),
                "num_experts": int(required(cfg, "num_local_experts", source)),
                "moe_topk": int(required(cfg, "num_experts_per_tok", source))}


FAMILY = MixtralFamily("mixtral")
