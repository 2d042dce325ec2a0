"""DeepSeek-V3 (deepseek_v3): multi-latent attention, a first dense layer, then MoE layers with a shared
expert and bias-balanced, group-limited sigmoid routing.

Oracle: transformers' DeepseekV3ForCausalLM on a tiny random config (fp32): its logits at each
layout, its loss and gradient norm for a training step; the HF round trip is bitwise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, hf_logits, random_tokens

from megarl.config.schema import ParallelConfig
from megarl.convert import jobs
from megarl.models.hf_arch import ArchError, arch_from_hf_config

TOL = 1e-3


def tiny_deepseek_config(**overrides):
    """hidden 64, 4 layers (the first dense), 8 routed experts in 2 groups (1 chosen, top 2 inside it),
    1 shared expert, q_lora 32, kv_lora 16, rope 8 + no-rope 16 per query/key head, values 16 wide."""
    import transformers

    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB,
                  max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    return transformers.DeepseekV3Config(**fields)


def build_tiny_deepseek(path, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_deepseek_config(**overrides)).float().eval()
    with torch.no_grad():  # transformers inits norms to ones and the expert bias to zero: make them matter
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.normal_(mean=1.0, std=0.3)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(std=0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_tiny_deepseek(tmp_path_factory.mktemp("hf") / "deepseek_v3")


def _config_dict(**overrides) -> dict:
    return tiny_deepseek_config(**overrides).to_dict()


def test_config_reads_mla_moe_and_routing():
    arch = arch_from_hf_config(_config_dict())
    assert (arch.num_experts, arch.moe_topk, arch.ffn_hidden_size) == (8, 2, 32)
    assert (arch.head_dim, arch.num_kv_heads) == (24, 4)
    assert arch.extra["mla"] == {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                 "qk_rope_head_dim": 8, "v_head_dim": 16}
    assert (arch.extra["first_k_dense"], arch.extra["dense_ffn_hidden_size"]) == (1, 96)
    assert (arch.extra["n_group"], arch.extra["topk_group"], arch.extra["routed_scaling_factor"]) == (2, 1, 2.5)


def test_parameter_count_is_transformers():
    import transformers

    config = tiny_deepseek_config()
    model = transformers.AutoModelForCausalLM.from_config(config)
    hf = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert arch_from_hf_config(config.to_dict()).num_parameters() == hf


@pytest.mark.parametrize("overrides,field", [
    ({"num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"norm_topk_prob": False, "n_group": 1, "topk_group": 1}, "norm_topk_prob"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 64}}, "rope type"),
    ({"n_group": 3}, "n_group"),
])
def test_unsupported_settings_are_refused_by_name(overrides, field):
    with pytest.raises(ArchError, match=field):
        arch_from_hf_config(_config_dict(**overrides), source="deepseek/config.json")


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_logits_match_transformers_and_round_trip_is_bitwise(tp, pp, ep, deepseek, pools, tmp_path):
    """Written at each layout (two ranks: tp1 is dp2), read back there: transformers' logits; and
    exported back to HF from there, every tensor bitwise the original (the routers' expert bias too)."""
    from safetensors.torch import load_file

    tokens = random_tokens(batch=2, seq=32)
    expected = hf_logits(deepseek, tokens)
    par = ParallelConfig(tp=tp, pp=pp, ep=ep, world_size=2)
    pool, ckpt, back = pools.get(2), tmp_path / "ckpt", tmp_path / "back"
    ckpt.mkdir()
    pool.run(jobs.hf_to_mcore, hf_dir=str(deepseek), out_dir=str(ckpt), parallel=par, dtype="float32")
    (logits,) = [r["logits"] for r in pool.run(jobs.checkpoint_logits, ckpt_dir=str(ckpt), parallel=par,
                                                tokens=tokens) if r["logits"] is not None]
    gap = (logits - expected).abs().max().item()
    print(f"deepseek_v3 tp{tp} pp{pp} ep{ep}: max |logit gap| {gap:.2e}")
    assert gap <= TOL
    pool.run(jobs.mcore_to_hf, ckpt_dir=str(ckpt), out_dir=str(back), parallel=par)
    original, returned = load_file(deepseek / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned)
    for name in original:
        assert original[name].dtype == returned[name].dtype, name
        assert torch.equal(original[name], returned[name]), name
