"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with every
layer's MLP a mixture of routed SwiGLU experts (``megarl.models.families.moe``) plus one shared
expert that every token goes through, scaled by a sigmoid gate.

HF: ``mlp.gate`` (router), ``mlp.experts.E.gate_proj/up_proj/down_proj`` (``moe_intermediate_size``
wide), ``mlp.shared_expert.gate_proj/up_proj/down_proj`` (``shared_expert_intermediate_size``
wide) and ``mlp.shared_expert_gate`` ``[1, H]``: out = experts(x) + sigmoid(x . g) * shared(x).
megatron-core: ``mlp.shared_experts.linear_fc1`` (gate then up) / ``linear_fc2``, split over
tensor-parallel ranks like a dense MLP, and ``mlp.shared_experts.gate_weight`` (replicated),
its ``moe_shared_expert_gate``. vLLM: ``mlp.shared_expert.gate_up_proj`` / ``down_proj`` (a
dense MLP's layout) and ``mlp.shared_expert_gate``. Routing: the released models do not
renormalise the top k (``norm_topk_prob`` false: megatron-core's pre-softmax router).
"""

from __future__ import annotations

from typing import Any

from megarl.models.arch import ArchError, ModelArch, required
from megarl.models.families.moe import ExpertNames, RoutedExperts, qwen_moe_fields
from megarl.models.families.qwen2 import Qwen2Family
from megarl.models.recipes import Recipe, ShardLayout, swiglu_fc1, swiglu_fc2, whole

_SHARED = "mlp.shared_expert."  # HF and vLLM
_SHARED_GATE = "mlp.shared_expert_gate.weight"  # HF and vLLM
_MCORE_SHARED = "mlp.shared_experts."


class Qwen2MoeFamily(RoutedExperts, Qwen2Family):
    names = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{e}.", gate="gate_proj.weight",
                        up="up_proj.weight", down="down_proj.weight")

    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        shared = int(required(cfg, "shared_expert_intermediate_size", source))
        if shared <= 0:
            raise ArchError(f"{source}: shared_expert_intermediate_size={shared}: a Qwen2-MoE without its shared "
                            "expert is not supported")
        return {**super().read_hf_config(cfg, source), **qwen_moe_fields(cfg, source),
                "extra": {"norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
                          "shared_expert_intermediate_size": shared}}

    @staticmethod
    def _shared_width(arch: ModelArch) -> int:
        return int(arch.extra["shared_expert_intermediate_size"])

    def moe_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {**super().moe_config_kwargs(arch),
                "moe_router_pre_softmax": not arch.extra.get("norm_topk_prob", False),
                "moe_shared_expert_intermediate_size": self._shared_width(arch),
                "moe_shared_expert_gate": True}

    def hf_mlp_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        h, s = arch.hidden_size, self._shared_width(arch)
        p = prefix + _SHARED
        return {**super().hf_mlp_shapes(arch, prefix), p + "gate_proj.weight": (s, h), p + "up_proj.weight": (s, h),
                p + "down_proj.weight": (h, s), prefix + _SHARED_GATE: (1, h)}

    def _shared_recipe(self, arch: ModelArch, prefix: str, up_or_down: str, tp_rank: int, tp: int) -> Recipe:
        h, p, width = arch.hidden_size, prefix + _SHARED, self._shared_width(arch)
        if up_or_down == "up":
            return swiglu_fc1(p + "gate_proj.weight", p + "up_proj.weight", width, h, tp_rank, tp)
        return swiglu_fc2(p + "down_proj.weight", width, h, tp_rank, tp)

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        if rest == _MCORE_SHARED + "linear_fc1.weight":
            return self._shared_recipe(arch, prefix, "up", layout.tp_rank, layout.tp)
        if rest == _MCORE_SHARED + "linear_fc2.weight":
            return self._shared_recipe(arch, prefix, "down", layout.tp_rank, layout.tp)
        if rest == _MCORE_SHARED + "gate_weight":
            return whole(prefix + _SHARED_GATE, (1, arch.hidden_size))
        return super().layer_recipe(arch, rest, prefix, layout)

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        return [*super().vllm_layer_names(arch, prefix), prefix + _SHARED + "gate_up_proj.weight",
                prefix + _SHARED + "down_proj.weight", prefix + _SHARED_GATE]

    def vllm_layer_recipe(self, arch: ModelArch, rest: str, prefix: str, tp_rank: int, tp: int) -> Recipe | None:
        if rest == _SHARED + "gate_up_proj.weight":
            return self._shared_recipe(arch, prefix, "up", tp_rank, tp)
        if rest == _SHARED + "down_proj.weight":
            return self._shared_recipe(arch, prefix, "down", tp_rank, tp)
        if rest == _SHARED_GATE:
            return whole(prefix + rest, (1, arch.hidden_size))
        return super().vllm_layer_recipe(arch, rest, prefix, tp_rank, tp)

    def mlp_params(self, arch: ModelArch, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
        # the shared expert is a tp-split SwiGLU every rank holds (megatron-core splits it over tp,
        # not etp), its gate replicated
        dense, expert = super().mlp_params(arch, tp, ep, etp)
        h, s = arch.hidden_size, self._shared_width(arch) // tp
        return [*dense, 2 * s * h, s * h, h], expert


FAMILY = Qwen2MoeFamily("qwen2_moe")
