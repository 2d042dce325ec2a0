"""DeepSeek-V3 (HF ``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``; Kimi-K2 has the same
layout): multi-latent attention (MLA), the first ``first_k_dense_replace`` layers with a dense SwiGLU
MLP, every later layer a mixture of routed SwiGLU experts plus shared experts, routed by a sigmoid
with a per-expert bias (auxiliary-loss-free balancing) over a group-limited top k.

Attention, HF -> megatron-core (``MLASelfAttention``, local spec; per tensor-parallel rank r of tp):
- ``q_a_proj`` [q_lora, H] -> ``linear_q_down_proj`` (rows of r: a column-parallel linear whose
  output megatron-core gathers), ``q_a_layernorm`` -> ``q_layernorm``, ``q_b_proj``
  [n * (nope + rope), q_lora] -> ``linear_q_up_proj`` (heads of r); without a q_lora_rank,
  ``q_proj`` -> ``linear_q_proj`` (heads of r);
- ``kv_a_proj_with_mqa`` [kv_lora + rope, H] -> ``linear_kv_down_proj`` (rows of r, gathered),
  ``kv_a_layernorm`` -> ``kv_layernorm``, ``kv_b_proj`` [n * (nope + v), kv_lora] ->
  ``linear_kv_up_proj`` (heads of r); ``o_proj`` -> ``linear_proj`` (columns of r).
Both sides take the rope part of q and k as interleaved pairs and de-interleave it before
rotating (megatron-core's ``multi_latent_attention`` rope, transformers' ``rope_interleave``), so
no weight is permuted.

MLP: a dense layer's ``mlp.gate_proj/up_proj/down_proj`` (``intermediate_size`` wide) as the
Llama-style layer's; a MoE layer's ``mlp.gate.weight`` -> ``mlp.router.weight``,
``mlp.gate.e_score_correction_bias`` -> ``mlp.router.expert_bias`` (a float32 buffer that
megatron-core moves towards balance after each step, ``moe_router_bias_update_rate``),
``mlp.experts.E.*`` (``moe_intermediate_size`` wide) as ``megarl.models.families.moe``'s, and
``mlp.shared_experts.*`` (``n_shared_experts * moe_intermediate_size`` wide) ->
``mlp.shared_experts.linear_fc1/fc2`` (split over tp like a dense MLP).

Routing (both sides): s = sigmoid(router logits); the groups (``n_group``) ranked by the sum of
their best two s + bias, the best ``topk_group`` kept; the top k experts by s + bias among them;
their weights are s (without the bias), renormalised, times ``routed_scaling_factor``.
megatron-core ranks a group by its best topk / topk_group experts, so topk must be twice
topk_group (as in DeepSeek-V3: 8 and 4), and it always renormalises a top k above one, so
``norm_topk_prob`` must be true.
"""

from __future__ import annotations

from typing import Any

from megarl.models.arch import ArchError, BlockOptions, ModelArch, RopeConfig, positive_count, rope_from_config
from megarl.models.families.base import DecoderFamily
from megarl.models.families.moe import VLLM_W2, VLLM_W13, ExpertNames, RoutedExperts
from megarl.models.recipes import Piece, Recipe, ShardLayout, block_name, chunk, swiglu_fc1, swiglu_fc2, whole

_ATTN = "self_attention."
_SHARED = "mlp.shared_experts."  # HF's and megatron-core's prefix of the shared experts
# vLLM's attention tensors split as megatron-core's are -> megatron-core's name inside the attention
_VLLM_AS_MCORE = {"self_attn.q_b_proj.weight": "linear_q_up_proj.weight",
                  "self_attn.q_proj.weight": "linear_q_proj.weight",
                  "self_attn.kv_b_proj.weight": "linear_kv_up_proj.weight",
                  "self_attn.o_proj.weight": "linear_proj.weight"}
# the latent norms are built with transformers' default eps, megatron-core's with the model's
_LATENT_NORM_EPS = 1e-6


def layer_index(prefix: str) -> int:
    """The layer of an HF layer prefix (``model.layers.3.`` -> 3)."""
    return int(prefix.rstrip(".").rsplit(".", 1)[1])


def mla(arch: ModelArch) -> dict[str, Any]:
    """The attention's widths (q_lora_rank may be None: queries projected directly)."""
    return arch.extra["mla"]


def is_moe_layer(arch: ModelArch, layer: int) -> bool:
    return layer >= int(arch.extra["first_k_dense"])


def _rope(cfg: dict[str, Any], source: str) -> tuple[RopeConfig, dict[str, float] | None]:
    """(the rope, YaRN's parameters or None). DeepSeek-V3 extends its context with YaRN (factor 40
    over 4096 positions, mscale and mscale_all_dim 1), which megatron-core's MLA has built in."""
    field_name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(field_name) or {}
    if (params.get("rope_type") or params.get("type")) != "yarn":
        return rope_from_config(cfg, source), None
    try:
        yarn = {"factor": float(params["factor"]),
                "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
                "beta_fast": float(params.get("beta_fast", 32)), "beta_slow": float(params.get("beta_slow", 1)),
                "mscale": float(params.get("mscale", 1)), "mscale_all_dim": float(params.get("mscale_all_dim", 0))}
    except (KeyError, TypeError, ValueError) as e:
        raise ArchError(f"{source}: {field_name} of rope type yarn needs a numeric factor and "
                        f"original_max_position_embeddings ({e})") from None
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return RopeConfig(theta=theta, kind="yarn", factor=yarn["factor"],
                      original_max_position_embeddings=yarn["original_max_position_embeddings"]), yarn


def _rope_kwargs(arch: ModelArch) -> dict[str, Any]:
    """megatron-core's MLA rotary fields: plain rope, or YaRN with its scaling and attention factors."""
    yarn = arch.extra.get("yarn")
    if not yarn:
        return {"rope_type": "rope"}
    return {"rope_type": "yarn", "rotary_scaling_factor": yarn["factor"],
            "original_max_position_embeddings": yarn["original_max_position_embeddings"],
            "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"], "mscale": yarn["mscale"],
            "mscale_all_dim": yarn["mscale_all_dim"]}


class DeepseekV3Family(RoutedExperts, DecoderFamily):
    names = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{e}.", gate="gate_proj.weight",
                        up="up_proj.weight", down="down_proj.weight")

    # -- HF config ------------------------------------------------------------------------------

    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        base = super().read_hf_config(cfg, source)  # SwiGLU with silu, no attention bias
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if cfg.get(key, want) != want:
                raise ArchError(f"{source}: {key}={cfg[key]!r} is not supported (deepseek_v3: {want} only)")
        if int(cfg.get("moe_layer_freq", 1)) != 1:
            raise ArchError(f"{source}: moe_layer_freq={cfg['moe_layer_freq']!r} is not supported (1 only: "
                            "every layer after first_k_dense_replace is a MoE layer)")
        if float(cfg.get("rms_norm_eps", 1e-6)) != _LATENT_NORM_EPS:
            raise ArchError(f"{source}: rms_norm_eps={cfg['rms_norm_eps']!r} is not supported: transformers "
                            f"builds the latent norms with eps {_LATENT_NORM_EPS} whatever it says")
        rope, yarn = _rope(cfg, source)
        heads = positive_count(cfg, "num_attention_heads", source)
        q_lora = cfg.get("q_lora_rank")
        widths = {"q_lora_rank": positive_count(cfg, "q_lora_rank", source) if q_lora is not None else None,
                  "kv_lora_rank": positive_count(cfg, "kv_lora_rank", source),
                  "qk_nope_head_dim": positive_count(cfg, "qk_nope_head_dim", source),
                  "qk_rope_head_dim": positive_count(cfg, "qk_rope_head_dim", source),
                  "v_head_dim": positive_count(cfg, "v_head_dim", source)}
        if widths["qk_rope_head_dim"] % 2:
            raise ArchError(f"{source}: qk_rope_head_dim={widths['qk_rope_head_dim']} must be even")
        experts = positive_count(cfg, "n_routed_experts", source, default=cfg.get("num_local_experts"))
        topk = positive_count(cfg, "num_experts_per_tok", source)
        groups = positive_count(cfg, "n_group", source, default=1)
        topk_group = positive_count(cfg, "topk_group", source, default=1)
        if experts % groups or topk_group > groups:
            raise ArchError(f"{source}: n_routed_experts={experts} must split into n_group={groups} groups, "
                            f"topk_group={topk_group} of them chosen")
        if groups > 1 and topk != 2 * topk_group:
            raise ArchError(f"{source}: num_experts_per_tok={topk} must be twice topk_group={topk_group} "
                            "(megatron-core ranks a group by its best topk / topk_group experts, DeepSeek by its "
                            "best two)")
        if topk > 1 and not cfg.get("norm_topk_prob", True):
            raise ArchError(f"{source}: norm_topk_prob=false is not supported (megatron-core renormalises the "
                            "top k sigmoid weights)")
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        layers = positive_count(cfg, "num_hidden_layers", source)
        if not 0 <= first_dense <= layers:
            raise ArchError(f"{source}: first_k_dense_replace={first_dense} must lie in [0, {layers}]")
        moe_width = positive_count(cfg, "moe_intermediate_size", source)
        shared = int(cfg.get("n_shared_experts") or 0)
        if shared < 1:
            raise ArchError(f"{source}: n_shared_experts={cfg.get('n_shared_experts')!r}: a DeepSeek-V3 "
                            "without shared experts is not supported")
        return {**base, "sliding_window": None, "rope": rope, "num_experts": experts, "moe_topk": topk,
                "ffn_hidden_size": moe_width, "num_kv_heads": heads,
                "head_dim": widths["qk_nope_head_dim"] + widths["qk_rope_head_dim"],
                "extra": {"mla": widths, "first_k_dense": first_dense, "yarn": yarn,
                          "dense_ffn_hidden_size": positive_count(cfg, "intermediate_size", source),
                          "shared_expert_intermediate_size": shared * moe_width,
                          "n_group": groups, "topk_group": topk_group,
                          "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0))}}

    # -- megatron-core --------------------------------------------------------------------------

    def block_options(self, arch: ModelArch) -> BlockOptions:
        # qk_norm: the latent norms (q_layernorm, kv_layernorm), which the local spec builds only then
        return BlockOptions(qk_norm=True)

    def moe_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        x = arch.extra
        return {**super().moe_config_kwargs(arch),
                "moe_layer_freq": [0 if i < x["first_k_dense"] else 1 for i in range(arch.num_layers)],
                "moe_shared_expert_intermediate_size": x["shared_expert_intermediate_size"],
                "moe_router_score_function": "sigmoid",
                "moe_router_enable_expert_bias": True,
                # DeepSeek-V3's bias update speed (gamma = 0.001, its report section 2.1.2)
                "moe_router_bias_update_rate": 1e-3,
                "moe_router_num_groups": x["n_group"] if x["n_group"] > 1 else None,
                "moe_router_group_topk": x["topk_group"] if x["n_group"] > 1 else None,
                "moe_router_topk_scaling_factor": x["routed_scaling_factor"]}

    def transformer_config_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        m = mla(arch)
        return {**super().transformer_config_kwargs(arch),
                "multi_latent_attention": True, "q_lora_rank": m["q_lora_rank"], "kv_lora_rank": m["kv_lora_rank"],
                "qk_head_dim": m["qk_nope_head_dim"], "qk_pos_emb_head_dim": m["qk_rope_head_dim"],
                "v_head_dim": m["v_head_dim"], "rotary_base": arch.rope.theta, **_rope_kwargs(arch),
                # the core attention's output is n * v_head_dim wide (megatron-core sizes it by kv_channels)
                "kv_channels": m["v_head_dim"],
                "ffn_hidden_size": arch.extra["dense_ffn_hidden_size"]}

    def layer_spec_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {**super().layer_spec_kwargs(arch), "multi_latent_attention": True}

    # -- HF checkpoint tensors and megatron-core shards -----------------------------------------

    def hf_attention_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        m, h, n, p = mla(arch), arch.hidden_size, arch.num_heads, prefix + "self_attn."
        q_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        if m["q_lora_rank"] is None:
            shapes = {p + "q_proj.weight": (n * q_head, h)}
        else:
            shapes = {p + "q_a_proj.weight": (m["q_lora_rank"], h), p + "q_a_layernorm.weight": (m["q_lora_rank"],),
                      p + "q_b_proj.weight": (n * q_head, m["q_lora_rank"])}
        return {**shapes, p + "kv_a_proj_with_mqa.weight": (m["kv_lora_rank"] + m["qk_rope_head_dim"], h),
                p + "kv_a_layernorm.weight": (m["kv_lora_rank"],),
                p + "kv_b_proj.weight": (n * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]),
                p + "o_proj.weight": (h, n * m["v_head_dim"])}

    def hf_mlp_shapes(self, arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
        h, p = arch.hidden_size, prefix + "mlp."
        if not is_moe_layer(arch, layer_index(prefix)):
            f = arch.extra["dense_ffn_hidden_size"]
            return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h), p + "down_proj.weight": (h, f)}
        s, q = arch.extra["shared_expert_intermediate_size"], prefix + _SHARED
        return {**super().hf_mlp_shapes(arch, prefix), p + "gate.e_score_correction_bias": (arch.num_experts,),
                q + "gate_proj.weight": (s, h), q + "up_proj.weight": (s, h), q + "down_proj.weight": (h, s)}

    def _attention_recipe(self, arch: ModelArch, rest: str, prefix: str, r: int, tp: int) -> Recipe | None:
        m, h, n, p = mla(arch), arch.hidden_size, arch.num_heads, prefix + "self_attn."
        q_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        heads = chunk(n, tp, r)

        def rows(name: str, total: int, cols: int, per: int = 1) -> Recipe:
            # rank r's rows of ``name``: of its heads (per rows each), or an even chunk (per = 1)
            start, stop = (heads[0] * per, heads[1] * per) if per > 1 else chunk(total, tp, r)
            return Recipe(0, (Piece(p + name, start, stop),), (stop - start, cols))

        kv_down = m["kv_lora_rank"] + m["qk_rope_head_dim"]
        if rest == "linear_q_proj.weight":
            return rows("q_proj.weight", n * q_head, h, q_head)
        if rest == "linear_q_down_proj.weight":
            return rows("q_a_proj.weight", m["q_lora_rank"], h)
        if rest == "q_layernorm.weight":
            return whole(p + "q_a_layernorm.weight", (m["q_lora_rank"],))
        if rest == "linear_q_up_proj.weight":
            return rows("q_b_proj.weight", n * q_head, m["q_lora_rank"], q_head)
        if rest == "linear_kv_down_proj.weight":
            return rows("kv_a_proj_with_mqa.weight", kv_down, h)
        if rest == "kv_layernorm.weight":
            return whole(p + "kv_a_layernorm.weight", (m["kv_lora_rank"],))
        if rest == "linear_kv_up_proj.weight":
            return rows("kv_b_proj.weight", 0, m["kv_lora_rank"], m["qk_nope_head_dim"] + m["v_head_dim"])
        if rest == "linear_proj.weight":
            start, stop = heads[0] * m["v_head_dim"], heads[1] * m["v_head_dim"]
            return Recipe(1, (Piece(p + "o_proj.weight", start, stop),), (h, stop - start))
        return None

    def layer_recipe(self, arch: ModelArch, rest: str, prefix: str, layout: ShardLayout) -> Recipe | None:
        r, tp, h = layout.tp_rank, layout.tp, arch.hidden_size
        if rest.startswith(_ATTN):
            return self._attention_recipe(arch, rest[len(_ATTN):], prefix, r, tp)
        if not is_moe_layer(arch, layer_index(prefix)):
            f, p = arch.extra["dense_ffn_hidden_size"], prefix + "mlp."
            if rest == "mlp.linear_fc1.weight":
                return swiglu_fc1(p + "gate_proj.weight", p + "up_proj.weight", f, h, r, tp)
            if rest == "mlp.linear_fc2.weight":
                return swiglu_fc2(p + "down_proj.weight", f, h, r, tp)
            return DecoderFamily.layer_recipe(self, arch, rest, prefix, layout)  # the norms
        s, q = arch.extra["shared_expert_intermediate_size"], prefix + _SHARED
        if rest == "mlp.router.expert_bias":
            return whole(prefix + "mlp.gate.e_score_correction_bias", (arch.num_experts,))
        if rest == _SHARED + "linear_fc1.weight":
            return swiglu_fc1(q + "gate_proj.weight", q + "up_proj.weight", s, h, r, tp)
        if rest == _SHARED + "linear_fc2.weight":
            return swiglu_fc2(q + "down_proj.weight", s, h, r, tp)
        return super().layer_recipe(arch, rest, prefix, layout)

    # -- vLLM -----------------------------------------------------------------------------------

    def vllm_layer_names(self, arch: ModelArch, prefix: str) -> list[str]:
        p, moe = prefix + "self_attn.", is_moe_layer(arch, layer_index(prefix))
        q = ([p + "fused_qkv_a_proj.weight", p + "q_a_layernorm.weight", p + "q_b_proj.weight"]
             if mla(arch)["q_lora_rank"] is not None else [p + "q_proj.weight", p + "kv_a_proj_with_mqa.weight"])
        names = [*q, p + "kv_a_layernorm.weight", p + "kv_b_proj.weight", p + "o_proj.weight",
                 prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        if not moe:
            return names + [prefix + "mlp.gate_up_proj.weight", prefix + "mlp.down_proj.weight"]
        experts = self._vllm_experts(prefix)
        names += [prefix + self.names.router, prefix + "mlp.gate.e_score_correction_bias"]
        for fused in (VLLM_W13, VLLM_W2):
            names += [block_name(experts + fused, e) for e in range(arch.num_experts)]
        return names + [prefix + _SHARED + "gate_up_proj.weight", prefix + _SHARED + "down_proj.weight"]

    def vllm_layer_recipe(self, arch: ModelArch, rest: str, prefix: str, tp_rank: int, tp: int) -> Recipe | None:
        """vLLM's DeepSeek-V2/V3 layer: q_a_proj and kv_a_proj_with_mqa fused into one replicated
        ``fused_qkv_a_proj``; q_b_proj / kv_b_proj split by heads and o_proj by columns, as megatron-core's."""
        m, h, p = mla(arch), arch.hidden_size, prefix + "self_attn."
        kv_down = m["kv_lora_rank"] + m["qk_rope_head_dim"]
        if rest == "self_attn.fused_qkv_a_proj.weight":
            return Recipe(0, (Piece(p + "q_a_proj.weight", 0, m["q_lora_rank"]),
                              Piece(p + "kv_a_proj_with_mqa.weight", 0, kv_down)), (m["q_lora_rank"] + kv_down, h))
        if rest == "self_attn.kv_a_proj_with_mqa.weight":
            return whole(p + "kv_a_proj_with_mqa.weight", (kv_down, h))
        if rest in ("self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight"):
            return whole(prefix + rest, (m["q_lora_rank"] if rest.startswith("self_attn.q_") else m["kv_lora_rank"],))
        if rest in _VLLM_AS_MCORE:  # split as megatron-core splits them
            return self._attention_recipe(arch, _VLLM_AS_MCORE[rest], prefix, tp_rank, tp)
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return whole(prefix + rest, (h,))
        if not is_moe_layer(arch, layer_index(prefix)):
            f, q = arch.extra["dense_ffn_hidden_size"], prefix + "mlp."
            if rest == "mlp.gate_up_proj.weight":
                return swiglu_fc1(q + "gate_proj.weight", q + "up_proj.weight", f, h, tp_rank, tp)
            if rest == "mlp.down_proj.weight":
                return swiglu_fc2(q + "down_proj.weight", f, h, tp_rank, tp)
            return None
        s, q = arch.extra["shared_expert_intermediate_size"], prefix + _SHARED
        if rest == "mlp.gate.e_score_correction_bias":
            return whole(prefix + rest, (arch.num_experts,))
        if rest == _SHARED + "gate_up_proj.weight":
            return swiglu_fc1(q + "gate_proj.weight", q + "up_proj.weight", s, h, tp_rank, tp)
        if rest == _SHARED + "down_proj.weight":
            return swiglu_fc2(q + "down_proj.weight", s, h, tp_rank, tp)
        return RoutedExperts.vllm_layer_recipe(self, arch, rest, prefix, tp_rank, tp)

    # -- the planner's parameter count ----------------------------------------------------------

    def attention_params(self, arch: ModelArch, tp: int) -> list[int]:
        """Input norm, the MLA projections (the down projections split over tp as megatron-core's
        local spec splits them), the latent norms, the output projection, pre-MLP norm."""
        m, h, n = mla(arch), arch.hidden_size, arch.num_heads // tp
        q_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        kv = [(m["kv_lora_rank"] + m["qk_rope_head_dim"]) // tp * h, m["kv_lora_rank"],
              n * (m["qk_nope_head_dim"] + m["v_head_dim"]) * m["kv_lora_rank"]]
        q = ([n * q_head * h] if m["q_lora_rank"] is None
             else [m["q_lora_rank"] // tp * h, m["q_lora_rank"], n * q_head * m["q_lora_rank"]])
        return [h, *q, *kv, n * m["v_head_dim"] * h, h]

    def mlp_params(self, arch: ModelArch, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
        """A MoE layer's: the routed experts', the router's bias and the shared experts (``layer_params_at``
        counts the first, dense, layers)."""
        dense, expert = super().mlp_params(arch, tp, ep, etp)
        h, s = arch.hidden_size, arch.extra["shared_expert_intermediate_size"] // tp
        return [*dense, arch.num_experts, 2 * s * h, s * h], expert

    def layer_params_at(self, arch: ModelArch, layer: int, tp: int, ep: int,
                        etp: int | None = None) -> tuple[list[int], list[int]]:
        if is_moe_layer(arch, layer):
            return self.layer_params(arch, tp, ep, etp)
        # one of the first (dense) layers: attention and a SwiGLU MLP of intermediate_size
        f, h = arch.extra["dense_ffn_hidden_size"] // tp, arch.hidden_size
        return [*self.attention_params(arch, tp), 2 * f * h, f * h], []


FAMILY = DeepseekV3Family("deepseek_v3")

