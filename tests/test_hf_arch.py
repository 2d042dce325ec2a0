"""Parsing HF config.json into ModelArch, and checking / reading HF safetensors checkpoints."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from megarl.convert.hf_io import HFReader, check_hf_checkpoint
from megarl.convert.mapping import Piece, Recipe, hf_tensor_shapes
from megarl.models.hf_arch import (
    ArchError,
    ModelArch,
    RopeConfig,
    arch_from_hf_config,
    arch_from_hf_dir,
)

# A tiny Llama: head_dim = 64 / 4 = 16, 2 query groups of 2 heads.
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "dtype": "bfloat16",
}

LLAMA3_ROPE = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192)


def without(cfg, *keys):
    return {k: v for k, v in cfg.items() if k not in keys}


# --------------------------------------------------------------------------- arch_from_hf_config


def test_llama_fields():
    arch = arch_from_hf_config(LLAMA)
    assert arch == ModelArch(
        family="llama", vocab_size=100, hidden_size=64, ffn_hidden_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, norm_eps=1e-5, tie_embeddings=False,
        qkv_bias=False, max_position_embeddings=256, rope=RopeConfig(theta=500000.0),
        sliding_window=None, num_experts=None, moe_topk=None, dtype="bfloat16",
    )
    assert arch.heads_per_group == 2
    assert not arch.is_moe


def test_defaults_for_optional_fields():
    minimal = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    arch = arch_from_hf_config(minimal)
    assert arch.num_kv_heads == 4  # no num_key_value_heads: multi-head attention
    assert arch.head_dim == 16  # 64 / 4
    assert arch.rope == RopeConfig(theta=10000.0)
    assert arch.dtype == "float32"
    assert arch.tie_embeddings is False


def test_explicit_head_dim_and_torch_dtype():
    arch = arch_from_hf_config({**without(LLAMA, "dtype"), "head_dim": 32, "torch_dtype": "torch.float16"})
    assert arch.head_dim == 32  # not 64 / 4
    assert arch.dtype == "float16"


def test_llama3_rope_new_and_old_styles_agree():
    new_style = {**LLAMA, "rope_parameters": {
        "rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    old_style = {**without(LLAMA, "rope_parameters"), "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    old_rope_type_key = {**old_style, "rope_scaling": {**old_style["rope_scaling"], "rope_type": "llama3"}}
    del old_rope_type_key["rope_scaling"]["type"]
    assert arch_from_hf_config(new_style).rope == LLAMA3_ROPE
    assert arch_from_hf_config(old_style).rope == LLAMA3_ROPE
    assert arch_from_hf_config(old_rope_type_key).rope == LLAMA3_ROPE


def test_llama3_rope_other_values_are_kept():
    cfg = {**LLAMA, "rope_parameters": {
        "rope_theta": 1000.0, "rope_type": "llama3", "factor": 32, "low_freq_factor": 2,
        "high_freq_factor": 8, "original_max_position_embeddings": 64}}
    assert arch_from_hf_config(cfg).rope == RopeConfig(
        theta=1000.0, kind="llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
        original_max_position_embeddings=64)


def test_old_style_rope_theta_without_scaling():
    cfg = {**without(LLAMA, "rope_parameters"), "rope_theta": 1e6, "rope_scaling": None}
    assert arch_from_hf_config(cfg).rope == RopeConfig(theta=1e6)


def test_linear_rope():
    new_style = {**LLAMA, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}}
    old_style = {**without(LLAMA, "rope_parameters"), "rope_theta": 10000.0,
                 "rope_scaling": {"type": "linear", "factor": 4.0}}
    expected = RopeConfig(theta=10000.0, kind="linear", factor=4.0)
    assert arch_from_hf_config(new_style).rope == expected
    assert arch_from_hf_config(old_style).rope == expected


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type(kind):
    cfg = {**LLAMA, "rope_parameters": {"rope_theta": 10000.0, "rope_type": kind, "factor": 2.0}}
    with pytest.raises(ArchError, match=rf"rope type '{kind}' \(field rope_parameters\.rope_type\) "
                                        r"is not supported; supported: default, linear, llama3"):
        arch_from_hf_config(cfg, source="m/config.json")


def test_unsupported_activation():
    with pytest.raises(ArchError, match=r"^m/config\.json: hidden_act 'gelu' is not supported"):
        arch_from_hf_config({**LLAMA, "hidden_act": "gelu"}, source="m/config.json")


def test_unsupported_biases():
    with pytest.raises(ArchError, match=r"mlp_bias=true is not supported"):
        arch_from_hf_config({**LLAMA, "mlp_bias": True})
    with pytest.raises(ArchError, match=r"attention_bias=true .* is not supported"):
        arch_from_hf_config({**LLAMA, "attention_bias": True})
    # false flags are fine
    assert arch_from_hf_config({**LLAMA, "mlp_bias": False, "attention_bias": False}).qkv_bias is False


@pytest.mark.parametrize("family", ["gpt2", "gemma", None])
def test_unsupported_model_type(family):
    cfg = {**LLAMA, "model_type": family}
    with pytest.raises(ArchError, match=rf"model_type {family!r} is not supported; "
                                        r"supported: llama, mistral, qwen2, mixtral"):
        arch_from_hf_config(cfg)


def test_qwen2_has_qkv_bias_and_ignores_an_unused_window():
    cfg = {**LLAMA, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False,
           "tie_word_embeddings": True}
    arch = arch_from_hf_config(cfg)
    assert arch.family == "qwen2"
    assert arch.qkv_bias is True
    assert arch.sliding_window is None
    assert arch.tie_embeddings is True


def test_qwen2_sliding_window_is_refused():
    cfg = {**LLAMA, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}
    with pytest.raises(ArchError, match=r"use_sliding_window=true .* is not supported"):
        arch_from_hf_config(cfg)


def test_mistral_keeps_sliding_window():
    assert arch_from_hf_config({**LLAMA, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    assert arch_from_hf_config({**LLAMA, "model_type": "mistral", "sliding_window": None}).sliding_window is None


def test_qwen3_explicit_head_dim_no_bias_and_no_window():
    cfg = {**LLAMA, "model_type": "qwen3", "head_dim": 32, "attention_bias": False, "sliding_window": 4096,
           "use_sliding_window": False, "max_window_layers": 2}
    arch = arch_from_hf_config(cfg)
    assert (arch.family, arch.head_dim, arch.qkv_bias, arch.sliding_window) == ("qwen3", 32, False, None)
    assert arch.head_dim * arch.num_heads != arch.hidden_size  # megatron-core's kv_channels
    with pytest.raises(ArchError, match=r"use_sliding_window=true \(Qwen3 per-layer windows\) is not supported"):
        arch_from_hf_config({**cfg, "use_sliding_window": True})
    with pytest.raises(ArchError, match=r"attention_bias=true .* is not supported"):
        arch_from_hf_config({**cfg, "attention_bias": True})


def test_qwen3_moe_experts_are_moe_intermediate_size_wide():
    cfg = {**LLAMA, "model_type": "qwen3_moe", "head_dim": 32, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    arch = arch_from_hf_config(cfg)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.ffn_hidden_size) == ("qwen3_moe", 128, 8, 768)
    assert arch.is_moe and arch.extra == {"norm_topk_prob": True}
    from megarl.models.arch import family_of

    config = family_of("qwen3_moe").transformer_config_kwargs(arch)
    assert family_of("qwen3_moe").block_options(arch).qk_norm
    assert config["moe_ffn_hidden_size"] == 768 and not config["moe_router_pre_softmax"]
    raw = arch_from_hf_config({**cfg, "norm_topk_prob": False})
    assert family_of("qwen3_moe").transformer_config_kwargs(raw)["moe_router_pre_softmax"]
    for bad in ({"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}):
        with pytest.raises(ArchError, match="dense layers among the MoE layers"):
            arch_from_hf_config({**cfg, **bad})


def test_qwen2_moe_shared_expert_and_its_gate():
    """Qwen1.5-MoE-A2.7B's shape: 60 experts of 1408, top 4 unrenormalised, a 5632-wide shared expert;
    its parameter count is the published 14.3B (2.7B active)."""
    cfg = {**LLAMA, "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
           "num_key_value_heads": 16, "vocab_size": 151936, "intermediate_size": 5632, "num_experts": 60,
           "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
           "norm_topk_prob": False, "sliding_window": 32768, "use_sliding_window": False}
    arch = arch_from_hf_config(cfg)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.ffn_hidden_size, arch.qkv_bias) == \
        ("qwen2_moe", 60, 4, 1408, True)
    from megarl.models.arch import family_of

    config = family_of("qwen2_moe").transformer_config_kwargs(arch)
    assert config["moe_shared_expert_intermediate_size"] == 5632 and config["moe_shared_expert_gate"]
    assert config["moe_router_pre_softmax"]
    assert round(arch.num_parameters() / 1e9, 1) == 14.3
    with pytest.raises(ArchError, match="without its shared expert"):
        arch_from_hf_config({**cfg, "shared_expert_intermediate_size": 0})


def test_mixtral_experts():
    cfg = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    arch = arch_from_hf_config(cfg)
    assert (arch.family, arch.num_experts, arch.moe_topk) == ("mixtral", 8, 2)
    assert arch.is_moe
    with pytest.raises(ArchError, match=r"required field 'num_local_experts' is missing"):
        arch_from_hf_config(without(cfg, "num_local_experts"))
    with pytest.raises(ArchError, match=r"required field 'num_experts_per_tok' is missing"):
        arch_from_hf_config(without(cfg, "num_experts_per_tok"))


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "intermediate_size",
                                 "vocab_size", "num_hidden_layers"])
def test_missing_required_field(key):
    with pytest.raises(ArchError, match=rf"^x/config\.json: required field '{key}' is missing$"):
        arch_from_hf_config(without(LLAMA, key), source="x/config.json")
    with pytest.raises(ArchError, match=rf"required field '{key}' is missing"):
        arch_from_hf_config({**LLAMA, key: None})


def test_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ArchError, match=r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        arch_from_hf_config({**LLAMA, "num_key_value_heads": 3})
    with pytest.raises(ArchError, match=r"num_attention_heads=4 is not a multiple of num_key_value_heads=8"):
        arch_from_hf_config({**LLAMA, "num_key_value_heads": 8})


def test_arch_from_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert arch_from_hf_dir(tmp_path) == arch_from_hf_config(LLAMA)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "hidden_act": "relu"}))
    with pytest.raises(ArchError, match=re.escape(str(tmp_path / "config.json")) + ": hidden_act 'relu'"):
        arch_from_hf_dir(tmp_path)


def test_arch_from_hf_dir_errors(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ArchError, match=f"model directory {re.escape(str(missing))} does not exist"):
        arch_from_hf_dir(missing)
    with pytest.raises(ArchError, match=re.escape(str(tmp_path / "config.json")) + " not found"):
        arch_from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ArchError, match=re.escape(str(tmp_path / "config.json")) + " is not valid JSON"):
        arch_from_hf_dir(tmp_path)


def test_to_dict_from_dict_round_trip():
    arch = arch_from_hf_config({**LLAMA, "model_type": "mixtral", "num_local_experts": 4,
                                "num_experts_per_tok": 2, "sliding_window": 128,
                                "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8}})
    data = arch.to_dict()
    assert data["rope"] == {"theta": 5e5, "kind": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert data["num_experts"] == 4 and data["sliding_window"] == 128
    back = ModelArch.from_dict(json.loads(json.dumps(data)))  # through JSON, as in megarl.json
    assert back == arch
    assert isinstance(back.rope, RopeConfig)
    assert back.to_dict() == data


def test_mismatches():
    a = arch_from_hf_config(LLAMA)
    assert a.mismatches(a) == []
    b = arch_from_hf_config({**LLAMA, "num_hidden_layers": 3, "dtype": "float32",
                             "rope_parameters": {"rope_theta": 1.0, "rope_type": "default"}})
    assert a.mismatches(b) == [  # dtype differs too, but is not an architecture mismatch
        "num_layers: 2 != 3",
        ("rope: {'theta': 500000.0, 'kind': 'default', 'factor': 1.0, 'low_freq_factor': 1.0, "
         "'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192} != "
         "{'theta': 1.0, 'kind': 'default', 'factor': 1.0, 'low_freq_factor': 1.0, "
         "'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}"),
    ]
    c = arch_from_hf_config({**LLAMA, "tie_word_embeddings": True, "vocab_size": 128})
    assert a.mismatches(c) == ["vocab_size: 100 != 128", "tie_embeddings: False != True"]


# num_parameters for LLAMA (h=64, 4 heads, 2 kv heads, d=16, ffn 128, 2 layers, vocab 100):
#   attention q 64*64 + k 32*64 + v 32*64 + o 64*64 = 12288
#   mlp 3 * 64 * 128 = 24576; norms 2 * 64 = 128  -> per layer 36992, 2 layers = 73984
#   embeddings 100 * 64 = 6400; final norm 64
@pytest.mark.parametrize(("overrides", "expected"), [
    ({"tie_word_embeddings": True}, 73984 + 6400 + 64),  # 80448
    ({"tie_word_embeddings": False}, 73984 + 2 * 6400 + 64),  # 86848
    # qwen2: q/k/v biases 64 + 32 + 32 = 128 per layer
    ({"model_type": "qwen2", "tie_word_embeddings": True}, 80448 + 2 * 128),  # 80704
    # qwen3: q and k norms of head_dim 16 per layer, no biases
    ({"model_type": "qwen3", "tie_word_embeddings": True}, 80448 + 2 * 2 * 16),  # 80512
    # mixtral, 4 experts: mlp 4 * 24576 + router 4 * 64 = 98560; per layer 12288 + 98560 + 128 = 110976
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
     2 * 110976 + 2 * 6400 + 64),  # 234816
])
def test_num_parameters_by_hand(overrides, expected):
    assert arch_from_hf_config({**LLAMA, **overrides}).num_parameters() == expected


@pytest.mark.parametrize("tied", [True, False])
def test_num_parameters_and_tensor_names_match_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=96, vocab_size=100, max_position_embeddings=128, tie_word_embeddings=tied,
    )
    config.save_pretrained(tmp_path)
    arch = arch_from_hf_dir(tmp_path)  # transformers' own config.json
    assert arch.tie_embeddings is tied
    model = transformers.LlamaForCausalLM(config)
    params = dict(model.named_parameters())  # tied lm_head is listed once, as embed_tokens
    assert arch.num_parameters() == sum(p.numel() for p in params.values())
    assert hf_tensor_shapes(arch) == {name: tuple(p.shape) for name, p in params.items()}


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_num_parameters_and_tensor_names_match_transformers(tmp_path, tied):
    """QK-norm weights (head_dim each) and an explicit head_dim wider than hidden / heads."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
        intermediate_size=96, vocab_size=100, max_position_embeddings=128, tie_word_embeddings=tied,
    )
    config.save_pretrained(tmp_path)
    arch = arch_from_hf_dir(tmp_path)
    assert (arch.family, arch.head_dim) == ("qwen3", 32)
    params = dict(transformers.Qwen3ForCausalLM(config).named_parameters())
    assert arch.num_parameters() == sum(p.numel() for p in params.values())
    assert hf_tensor_shapes(arch) == {name: tuple(p.shape) for name, p in params.items()}


# --------------------------------------------------------------------------- checkpoints


# LLAMA with one layer, for small checkpoint files.
ONE_LAYER = {**LLAMA, "num_hidden_layers": 1}


def random_tensors(arch, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in hf_tensor_shapes(arch).items()}


def write_checkpoint(path, tensors, cfg=ONE_LAYER):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def check_message(path, arch, value_head=False):
    with pytest.raises(ArchError, match=f"^{re.escape(str(path))} does not match its config.json:") as info:
        check_hf_checkpoint(HFReader(path), hf_tensor_shapes(arch, value_head=value_head))
    return str(info.value)


def test_correct_checkpoint_passes(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    assert len(tensors) == 12  # embed, 9 in the layer, norm, lm_head
    path = write_checkpoint(tmp_path / "m", tensors)
    reader = HFReader(path)
    check_hf_checkpoint(reader, hf_tensor_shapes(arch))
    assert sorted(reader.names()) == sorted(tensors)
    assert reader.shape("model.layers.0.self_attn.k_proj.weight") == (32, 64)  # 2 kv heads * 16


def test_rotary_buffers_and_a_tied_lm_head_are_tolerated(tmp_path):
    arch = arch_from_hf_config({**ONE_LAYER, "tie_word_embeddings": True})
    tensors = random_tensors(arch)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    path = write_checkpoint(tmp_path / "m", tensors)
    reader = HFReader(path)
    check_hf_checkpoint(reader, hf_tensor_shapes(arch))
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in reader.names()


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    path = write_checkpoint(tmp_path / "m", tensors)
    message = check_message(path, arch)
    assert ("model.layers.0.self_attn.q_proj.weight: shape [32, 64] in the checkpoint, "
            "[64, 64] from config.json") in message
    assert message.count("\n") == 1  # one problem only


def test_missing_tensor(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    message = check_message(write_checkpoint(tmp_path / "m", tensors), arch)
    assert "missing tensor model.layers.0.mlp.down_proj.weight (expected shape [64, 128])" in message


def test_untied_checkpoint_without_lm_head(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    del tensors["lm_head.weight"]
    message = check_message(write_checkpoint(tmp_path / "m", tensors), arch)
    assert "missing tensor lm_head.weight (expected shape [100, 64])" in message


def test_unexpected_tensor(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    tensors["model.layers.1.input_layernorm.weight"] = torch.ones(64)  # a second layer config.json lacks
    message = check_message(write_checkpoint(tmp_path / "m", tensors), arch)
    assert ("unexpected tensor model.layers.1.input_layernorm.weight "
            "(not part of the architecture in config.json)") in message


def test_value_head_checkpoint(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    del tensors["lm_head.weight"]
    tensors["score.weight"] = torch.randn(1, 64)
    path = write_checkpoint(tmp_path / "m", tensors)
    check_hf_checkpoint(HFReader(path), hf_tensor_shapes(arch, value_head=True))
    # the same checkpoint is not a causal LM
    assert "unexpected tensor score.weight" in check_message(path, arch)


def test_many_problems_are_truncated(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    path = write_checkpoint(tmp_path / "m", {"unrelated.weight": torch.zeros(2)})
    message = check_message(path, arch)
    # 12 missing + 1 unexpected = 13 problems: 12 shown, then one summary line
    lines = message.splitlines()
    assert len(lines) == 1 + 12 + 1
    assert lines[-1] == "  ... and 1 more"


def test_pickled_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ONE_LAYER))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ArchError, match=r"no model\.safetensors or model\.safetensors\.index\.json "
                                        r"\(found pytorch_model\.bin: pickled checkpoints are not read"):
        HFReader(tmp_path)


def test_folder_without_weights(tmp_path):
    with pytest.raises(ArchError, match=re.escape(str(tmp_path)) + r": no model\.safetensors or "
                                        r"model\.safetensors\.index\.json$"):
        HFReader(tmp_path)


def test_reader_reads_slices_and_counts_bytes(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    reader = HFReader(write_checkpoint(tmp_path / "m", tensors))
    embed = tensors["model.embed_tokens.weight"]
    q = tensors["model.layers.0.self_attn.q_proj.weight"]

    rows = reader.read("model.embed_tokens.weight", 0, 10, 20)
    assert rows.shape == (10, 64)
    assert torch.equal(rows, embed[10:20])
    assert reader.bytes_read == 10 * 64 * 4  # float32

    cols = reader.read("model.layers.0.self_attn.q_proj.weight", 1, 8, 24)
    assert cols.shape == (64, 16)
    assert torch.equal(cols, q[:, 8:24])
    assert reader.bytes_read == 2560 + 64 * 16 * 4  # 6656

    whole = reader.read("model.norm.weight")
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, tensors["model.norm.weight"])
    assert reader.bytes_read == 6656 + 64 * 2  # bf16: 2 bytes each
    assert reader.dtype("model.norm.weight") == torch.bfloat16
    assert reader.dtype("model.embed_tokens.weight") == torch.float32

    with pytest.raises(ArchError, match=r"tensor 'nope\.weight' is missing from the checkpoint"):
        reader.read("nope.weight")


def test_read_shard_assembles_pieces_and_padding(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    reader = HFReader(write_checkpoint(tmp_path / "m", tensors))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    p = "model.layers.0.self_attn."
    rec = Recipe(0, (Piece(p + "q_proj.weight", 32, 64), Piece(p + "k_proj.weight", 16, 32)), (48, 64))
    shard = reader.read_shard(rec, torch.float32)
    assert torch.equal(shard, torch.cat([q[32:64], k[16:32]]))
    assert reader.bytes_read == (32 + 16) * 64 * 4

    embed = tensors["model.embed_tokens.weight"]
    rec = Recipe(0, (Piece("model.embed_tokens.weight", 64, 100), Piece(None, 100, 128)), (64, 64))
    shard = reader.read_shard(rec, torch.bfloat16)
    assert shard.dtype == torch.bfloat16 and shard.shape == (64, 64)
    assert torch.equal(shard[:36], embed[64:100].to(torch.bfloat16))
    assert torch.count_nonzero(shard[36:]) == 0

    down = tensors["model.layers.0.mlp.down_proj.weight"]
    rec = Recipe(1, (Piece("model.layers.0.mlp.down_proj.weight", 64, 128),), (64, 64))
    assert torch.equal(reader.read_shard(rec, torch.float32), down[:, 64:128])


def test_sharded_checkpoint_with_index(tmp_path):
    arch = arch_from_hf_config(ONE_LAYER)
    tensors = random_tensors(arch)
    names = list(tensors)
    first, second = names[:5], names[5:]
    tmp_path.joinpath("config.json").write_text(json.dumps(ONE_LAYER))
    save_file({n: tensors[n] for n in first}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in second}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    reader = HFReader(tmp_path)
    check_hf_checkpoint(reader, hf_tensor_shapes(arch))
    assert sorted(reader.names()) == sorted(names)
    last = names[-1]  # lm_head.weight, in the second file
    assert last == "lm_head.weight"
    assert torch.equal(reader.read(last, 0, 0, 3), tensors[last][:3])
    assert torch.equal(reader.read(names[0], 0, 99, 100), tensors[names[0]][99:])


def test_index_naming_a_missing_file(tmp_path):
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # refused when the checkpoint is opened, before any tensor is asked for
    with pytest.raises(ArchError, match=r"model-00001-of-00001\.safetensors is listed in the checkpoint "
                                        r"index but does not exist"):
        HFReader(tmp_path)


# Gemma-3 text as transformers 5 writes it (per-layer-kind rope_parameters) and as Google's released
# configs do (rope_theta, rope_scaling, rope_local_base_freq): the same block options.
GEMMA3 = {**without(LLAMA, "hidden_act", "rope_parameters"), "model_type": "gemma3_text", "head_dim": 32,
          "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 8, "query_pre_attn_scalar": 24,
          "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": None,
          "rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}


@pytest.mark.parametrize("cfg", [GEMMA3, {**without(GEMMA3, "rope_parameters"), "rope_theta": 1e6,
                                          "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                          "rope_local_base_freq": 1e4}])
def test_gemma3_block_options(cfg):
    from megarl.models.arch import BlockOptions, family_of

    arch = arch_from_hf_config(cfg)
    assert (arch.rope, arch.sliding_window) == (RopeConfig(theta=1e6, kind="linear", factor=8.0), 8)
    assert family_of(arch).block_options(arch) == BlockOptions(
        activation="gelu_tanh", zero_centred_norms=True, qk_norm=True, sandwich_norms=True, window=8,
        global_layers=(1,), local_rope_theta=1e4, softmax_scale=24 ** -0.5)


@pytest.mark.parametrize(("change", "message"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must list one of"),
])
def test_gemma3_refusals_name_the_field(change, message):
    with pytest.raises(ArchError, match=r"^g/config\.json: " + message):
        arch_from_hf_config({**GEMMA3, **change}, source="g/config.json")


def test_family_fields_in_extra_are_compared():
    # Gemma-3's global layers live in ModelArch.extra: a checkpoint whose layers are all windowed
    # is not the architecture of a config with a global layer, though every common field agrees
    a = arch_from_hf_config(GEMMA3)
    b = arch_from_hf_config({**GEMMA3, "layer_types": ["sliding_attention", "sliding_attention"]})
    assert a.mismatches(b) == ["extra.global_layers: [1] != []"]
    # a field only one side holds (written before a family read it) is no mismatch
    assert not [m for m in a.mismatches(arch_from_hf_config(LLAMA)) if m.startswith("extra.")]
