"""megatron-core GPTModel built from a ModelArch, for the current platform.

The model is always megatron-core's: its layer spec comes from the platform
(Transformer Engine on GPU, the local spec on CPU). A value head (critic /
reward) replaces the vocabulary projection with a scalar per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.config.schema import MoeConfig, ParallelConfig, PrecisionConfig, RecomputeConfig
from megarl.models.arch import family_of
from megarl.models.hf_arch import ModelArch
from megarl.models.layout import padded_vocab_size
from megarl.models.value_head import ValueHead
from megarl.platform import current_platform, gpt_layer_spec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build one role's model on every rank."""

    arch: ModelArch
    parallel: ParallelConfig
    precision: PrecisionConfig
    vocab_pad_multiple: int = 128
    value_head: bool = False
    # A checkpoint fixes its padded vocab; it is reused at any layout whose tp divides it.
    padded_vocab_override: int | None = None
    recompute: RecomputeConfig | None = None  # activation recompute in training (None: none)
    moe: MoeConfig | None = None  # a MoE model's routing in training (None: the defaults)

    @property
    def padded_vocab(self) -> int:
        if self.padded_vocab_override is not None:
            return self.padded_vocab_override
        return padded_vocab_size(self.arch.vocab_size, self.vocab_pad_multiple, self.parallel.tp)

    @property
    def params_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.precision.dtype]


def moe_kwargs(moe: MoeConfig | None) -> dict:
    """megatron-core's TransformerConfig fields for a MoE role's ``moe`` section (over the family's)."""
    if moe is None:
        return {}
    out = {"moe_router_load_balancing_type": moe.load_balancing, "moe_aux_loss_coeff": moe.aux_loss_coeff,
           "moe_z_loss_coeff": moe.z_loss_coeff, "moe_enable_routing_replay": moe.routing_replay}
    if moe.capacity_factor is not None:
        out |= {"moe_expert_capacity_factor": moe.capacity_factor, "moe_token_drop_policy": moe.token_drop_policy,
                "moe_pad_expert_input_to_capacity": moe.pad_to_capacity}
    return out


def recompute_kwargs(rc: RecomputeConfig | None) -> dict:
    """megatron-core's TransformerConfig fields for a role's ``recompute`` section."""
    if rc is None or rc.granularity == "none":
        return {}
    if rc.granularity == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(rc.modules)}
    return {"recompute_granularity": "full", "recompute_method": rc.method, "recompute_num_layers": rc.num_layers}


def transformer_config(spec: ModelSpec):
    from megatron.core.transformer import TransformerConfig

    from megarl.models import block  # megatron-core modules: imported where a model is built

    arch, par, prec = spec.arch, spec.parallel, spec.precision
    dtype = spec.params_dtype
    platform = current_platform()
    kwargs = recompute_kwargs(spec.recompute)
    # the family's layer (activation, norms, attention pattern), then its own fields (e.g. MoE routing)
    kwargs.update(block.config_kwargs(family_of(arch).block_options(arch), arch.num_layers, platform.fuses_kernels))
    kwargs.update(family_of(arch).transformer_config_kwargs(arch))
    if arch.is_moe:
        kwargs.update(moe_kwargs(spec.moe))
    if prec.fp8 is not None:
        kwargs.update(fp8=prec.fp8, fp8_recipe=prec.fp8_recipe,
                      fp8_amax_history_len=prec.fp8_amax_history_len, fp8_amax_compute_algo="max")
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        layernorm_epsilon=arch.norm_eps,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        sequence_parallel=par.sequence_parallel,
        num_layers_in_first_pipeline_stage=par.first_stage_layers,
        num_layers_in_last_pipeline_stage=par.last_stage_layers,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # CUDA only: bias/activation (``block.config_kwargs``) and bias/dropout fuse through torch's
        # JIT, the masked softmax through CUDA extensions that only some environments have.
        masked_softmax_fusion=platform.fuses_softmax,
        bias_dropout_fusion=platform.fuses_kernels,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Each rank initialises only its own shards (megatron-core's "GPU" path, which the
        # platform routes to the CPU there). The CPU path would first build every full
        # master weight on every rank: ~1.6x the model in transient memory.
        use_cpu_initialization=False,
        # Always on, even when a checkpoint overwrites every weight: megatron-core sets the
        # tensor-parallel attributes of each weight inside its init functions, and without
        # them grad norms (and anything else keyed on them) count TP shards as duplicates.
        perform_initialization=True,
    )
    # a family's fields override the generic ones (e.g. DeepSeek-V3's dense layers are wider than its
    # experts, and its attention is multi-latent: megatron-core's own config class for it)
    fields.update(kwargs)
    if fields.get("multi_latent_attention"):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**fields)
    return TransformerConfig(**fields)


def _rope_inv_freq(model, arch: ModelArch) -> None:
    """Sets the rotary frequencies exactly as transformers computes them for ``arch.rope``."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return
    dim = arch.head_dim
    base = 1.0 / (arch.rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if arch.rope.kind == "llama3":
        base = rope._apply_scaling(
            base, factor=arch.rope.factor, low_freq_factor=arch.rope.low_freq_factor,
            high_freq_factor=arch.rope.high_freq_factor,
            original_max_position_embeddings=arch.rope.original_max_position_embeddings,
        )
    elif arch.rope.kind == "linear":
        base = base / arch.rope.factor
    rope.inv_freq = base.to(rope.inv_freq.device)


def _norms_in_params_dtype(model, dtype: torch.dtype) -> None:
    """The local spec's norms are torch modules built in fp32 whatever ``params_dtype`` says
    (megatron-core's ``WrappedTorchNorm`` passes no dtype). In a BF16 model that makes every
    ``rms_norm`` a mixed-dtype call, which CUDA runs unfused (and warns about, once per process),
    and keeps the norm weights out of the BF16 layout that Transformer Engine's norms, HF and
    vLLM all use."""
    if dtype == torch.float32:
        return
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)


def _layer_spec(spec: ModelSpec, dense: bool = False):
    """The family's layer spec; ``dense``: its layer without experts (a MoE model's dense layers)."""
    from megarl.models import block

    family = family_of(spec.arch)
    options = family.block_options(spec.arch)
    kwargs = family.layer_spec_kwargs(spec.arch)
    te = current_platform().layer_spec_kind == "te"
    if dense:
        kwargs = {**kwargs, "num_experts": None}
    layer = block.layer_spec(
        options, gpt_layer_spec(**kwargs, qk_layernorm=options.qk_norm, context_parallel=spec.parallel.cp > 1),
        te=te, moe=spec.arch.is_moe and not dense)
    if kwargs.get("multi_latent_attention") and not te:
        from megarl.models import mla_local

        mla_local.allow_local_mla()
        layer.submodules.self_attention.module = mla_local.SharedRopeKeyMLA
    return layer


def _decoder_spec(spec: ModelSpec, config, vp_stage: int | None):
    """One layer spec for every layer, or, where the family sets megatron-core's ``moe_layer_freq`` to a
    per-layer list (DeepSeek-V3's first dense layers), this stage's layers, each dense or MoE."""
    pattern = getattr(config, "moe_layer_freq", 1)
    if not isinstance(pattern, list):
        return _layer_spec(spec)
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    moe, dense = _layer_spec(spec), _layer_spec(spec, dense=True)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[moe if pattern[i] else dense for i in range(offset, offset + count)],
                                      layer_norm=LayerNormImpl)


def build_model(spec: ModelSpec, vp_stage: int | None = None):
    """Builds this rank's model chunk (call inside ``megatron_parallel``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from megarl.models import block

    config = transformer_config(spec)
    family = family_of(spec.arch)
    options = family.block_options(spec.arch)
    layer_spec = _decoder_spec(spec, config, vp_stage)
    pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab,
        max_sequence_length=spec.arch.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=spec.arch.tie_embeddings and not spec.value_head,
        position_embedding_type="rope",
        rotary_base=int(spec.arch.rope.theta),
        vp_stage=vp_stage,
    )
    _rope_inv_freq(model, spec.arch)
    block.set_local_rope(model, options, spec.arch.head_dim)
    block.finish_block(model, options)
    if spec.parallel.cp > 1 and getattr(model, "rotary_pos_emb", None) is not None:
        # The rotary angles of the whole sequence; each micro-batch picks its tokens' own
        # (``rope_at`` with ``context_parallel.CpSplit.positions``), as packed rows do.
        model.rotary_pos_emb.cp_group = None
    _norms_in_params_dtype(model, config.params_dtype)
    family.finish_model(model, spec.arch)  # e.g. an embedding scale
    if spec.value_head and post:
        model.output_layer = ValueHead(config, spec.arch.hidden_size)
    current_platform().place_module(model)
    return model


def build_model_chunks(spec: ModelSpec) -> list:
    """All model chunks of this rank: one, or ``vpp`` under the interleaved pipeline schedule."""
    if spec.parallel.vpp is None:
        chunks = [build_model(spec)]
    else:
        chunks = [build_model(spec, vp_stage=i) for i in range(spec.parallel.vpp)]
    if spec.moe is not None and spec.moe.routing_replay:
        from megarl.models.routing_replay import install

        install(chunks)
    return chunks
