"""Mixtral: a Llama-style decoder whose MLP is a top-k routed mixture of SwiGLU experts.

HF: ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.E.w1/w2/w3``
(gate / down / up). megatron-core: ``mlp.router`` (replicated) and
``mlp.experts.local_experts.E.linear_fc1/linear_fc2``, with E the *global* expert index
in canonical names; each expert is split over tensor-parallel ranks like a dense MLP.
vLLM fuses all experts of a layer into one tensor, which the weight sync cannot fill yet.
"""

from __future__ import annotations

import re
from typing import Any

from megarl.models.arch import ModelArch, required
from megarl.models.families.base import DecoderFamily
from megarl.models.recipes import Piece, Recipe, ShardLayout, chunk, whole

_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


class MixtralFamily(DecoderFamily):
    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        return {**super().read_hf_config(cfg, source),
                "num_experts": int(required(cfg, "num_local_experts", source)),
                "moe_topk": int(required(cfg, "num_experts_per_tok", source))}

    def transformer_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {
            "num_moe_experts": arch.num_experts,
            "moe_router_topk": arch.moe_topk,
            "moe_ffn_hidden_size": arch.ffn_hidden_size,
            "moe_router_load_balancing_type": "none",
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
            "moe_router_dtype": "fp32",
        }

    def layer_spec_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {"num_experts": arch.num_experts}

    def hf_mlp_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f = arch.hidden_size, arch.ffn_hidden_size
        shapes = {prefix + "block_sparse_moe.gate.weight": (arch.num_experts, h)}
        for e in range(arch.num_experts):
            q = f"{prefix}block_sparse_moe.experts.{e}."
            shapes |= {q + "w1.weight": (f, h), q + "w2.weight": (h, f), q + "w3.weight": (f, h)}
        return shapes

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        if rest == "mlp.router.weight":
            return whole(prefix + "block_sparse_moe.gate.weight", (arch.num_experts, arch.hidden_size))
        m = _EXPERT.match(rest)
        if m:
            q = f"{prefix}block_sparse_moe.experts.{int(m.group(1))}."
            h = arch.hidden_size
            start, stop = chunk(arch.ffn_hidden_size, layout.tp, layout.tp_rank)
            if m.group(2) == "linear_fc1":  # gate (w1), then up (w3)
                return Recipe(0, (Piece(q + "w1.weight", start, stop), Piece(q + "w3.weight", start, stop)),
                              (2 * (stop - start), h))
            return Recipe(1, (Piece(q + "w2.weight", start, stop),), (h, stop - start))
        return super().layer_recipe(arch, rest, prefix, layout)

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        raise NotImplementedError("weight sync into vLLM's fused MoE experts is not supported yet")

    def mlp_params(self, arch: ModelArch, tp: int, ep: int) -> tuple[list[int], list[int]]:
        # the router (replicated) is dense; each of this rank's experts is a tp-split SwiGLU
        h, ffn = arch.hidden_size, arch.ffn_hidden_size // tp
        expert: list[int] = []
        for _ in range(arch.num_experts // ep):
            expert += [2 * ffn * h, ffn * h]
        return [arch.num_experts * h], expert


FAMILY = MixtralFamily("mixtral")
