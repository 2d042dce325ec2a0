"""Routed SwiGLU experts, as the MoE families share them: a replicated router and E experts per
MoE layer, each expert split over tensor-parallel ranks like a dense MLP, the experts spread over
expert-parallel ranks (canonical names carry the *global* expert index).

megatron-core: ``mlp.router.weight`` and ``mlp.experts.local_experts.E.linear_fc1`` (gate then up,
stacked) / ``linear_fc2`` (down). A family names its HF tensors with ``ExpertNames``.

vLLM: the router is ``<router>`` (replicated), the experts one fused module per layer,
``<experts>routed_experts.w13_weight`` ``[E, 2 * I / tp, H]`` (per expert its TP rank's gate rows,
then its up rows) and ``w2_weight`` ``[E, H, I / tp]`` (per expert its TP rank's columns of down).
The weight sync sees each expert's block as a tensor of its own (``recipes.block_name``): the
same pieces as megatron-core's ``linear_fc1`` / ``linear_fc2`` of that expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megarl.models.arch import ArchError, ModelArch, required
from megarl.models.recipes import (
    Recipe,
    ShardLayout,
    block_name,
    split_block,
    swiglu_fc1,
    swiglu_fc2,
    whole,
)

_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# vLLM's fused expert tensors, after the family's experts prefix (``ExpertNames.expert`` less "{e}.")
VLLM_W13, VLLM_W2 = "routed_experts.w13_weight", "routed_experts.w2_weight"
# vLLM's dense MLP tensors, which a MoE layer does not have
_DENSE_MLP = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def qwen_moe_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The routed-expert fields of a Qwen-MoE config (Qwen2-MoE, Qwen3-MoE): every layer sparse."""
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ArchError(f"{source}: dense layers among the MoE layers (mlp_only_layers, decoder_sparse_step) "
                        "are not supported")
    # the released configs say num_experts; transformers 5 writes num_local_experts
    experts = cfg.get("num_experts") or required(cfg, "num_local_experts", source)
    return {"num_experts": int(experts), "moe_topk": int(required(cfg, "num_experts_per_tok", source)),
            "ffn_hidden_size": int(required(cfg, "moe_intermediate_size", source))}


@dataclass(frozen=True)
class ExpertNames:
    """HF tensor names inside a layer: the router, and an expert's gate / up / down ({e}: its index)."""

    router: str
    expert: str
    gate: str
    up: str
    down: str


class RoutedExperts:
    """Mixed into a DecoderFamily (before it) whose every layer's MLP is routed experts."""

    names: ExpertNames

    def moe_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {
            "num_moe_experts": arch.num_experts,
            "moe_router_topk": arch.moe_topk,
            "moe_ffn_hidden_size": arch.ffn_hidden_size,
            "moe_router_load_balancing_type": "none",
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
            "moe_router_dtype": "fp32",
        }

    def transformer_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {**super().transformer_config_kwargs(arch), **self.moe_config_kwargs(arch)}

    def layer_spec_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {**super().layer_spec_kwargs(arch), "num_experts": arch.num_experts}

    def hf_mlp_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = arch.hidden_size, arch.ffn_hidden_size, self.names
        shapes = {prefix + n.router: (arch.num_experts, h)}
        for e in range(arch.num_experts):
            q = prefix + n.expert.format(e=e)
            shapes |= {q + n.gate: (f, h), q + n.down: (h, f), q + n.up: (f, h)}
        return shapes

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        n = self.names
        if rest == "mlp.router.weight":
            return whole(prefix + n.router, (arch.num_experts, arch.hidden_size))
        m = _EXPERT.match(rest)
        if m:
            return self._expert_recipe(arch, prefix, int(m.group(1)), m.group(2) == "linear_fc1",
                                       *layout.expert_tp)
        return super().layer_recipe(arch, rest, prefix, layout)

    def _expert_recipe(self, arch: ModelArch, prefix: str, expert: int, fc1: bool, tp_rank: int,
                       tp: int) -> Recipe:
        """Expert ``expert``'s tp-split SwiGLU: fc1 (megatron-core) and w13 (vLLM) alike."""
        n, q = self.names, prefix + self.names.expert.format(e=expert)
        if fc1:
            return swiglu_fc1(q + n.gate, q + n.up, arch.ffn_hidden_size, arch.hidden_size, tp_rank, tp)
        return swiglu_fc2(q + n.down, arch.ffn_hidden_size, arch.hidden_size, tp_rank, tp)

    def _vllm_experts(self, prefix: str) -> str:
        return prefix + self.names.expert.replace("{e}.", "")

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        dense = {prefix + rest for rest in _DENSE_MLP}
        names = [n for n in super().vllm_layer_names(arch, prefix) if n not in dense]
        experts = self._vllm_experts(prefix)
        names.append(prefix + self.names.router)
        for fused in (VLLM_W13, VLLM_W2):
            names += [block_name(experts + fused, e) for e in range(arch.num_experts)]
        return names

    def vllm_layer_recipe(self, arch: ModelArch, rest: str, prefix: str, tp_rank: int, tp: int) -> Recipe | None:
        n, h = self.names, arch.hidden_size
        if rest == n.router:
            return whole(prefix + rest, (arch.num_experts, h))
        fused, expert = split_block(prefix + rest)
        experts = self._vllm_experts(prefix)
        if expert is not None and fused in (experts + VLLM_W13, experts + VLLM_W2):
            return self._expert_recipe(arch, prefix, expert, fused.endswith(VLLM_W13), tp_rank, tp)
        if rest in _DENSE_MLP:
            return None
        return super().vllm_layer_recipe(arch, rest, prefix, tp_rank, tp)

    def mlp_params(self, arch: ModelArch, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
        # the router (replicated) is dense; each of this rank's experts is an etp-split SwiGLU
        h, ffn = arch.hidden_size, arch.ffn_hidden_size // (tp if etp is None else etp)
        return [arch.num_experts * h], [2 * ffn * h, ffn * h] * (arch.num_experts // ep)
