"""Model architecture read from a Hugging Face ``config.json``.

``ModelArch`` (``megarl.models.arch``) is the one description of a model that megarl
builds, converts and reshards. It is parsed strictly: a setting megarl cannot reproduce exactly
(an activation, a rope type, biases in the wrong places) is refused with the
field and file named, because a conversion that silently drops one produces
wrong numbers that look fine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# ModelArch and its parts live in megarl.models.arch (with the family registry); they are
# re-exported here, where most of megarl imports them from.
from megarl.models.arch import (
    ArchError,
    ModelArch,
    RopeConfig,
    family_names,
    family_of,
    positive_count,
    rope_from_config,
)

__all__ = ["SUPPORTED_FAMILIES", "ArchError", "ModelArch", "RopeConfig", "arch_from_hf_config", "arch_from_hf_dir",
           "load_hf_config"]

# The registered families (megarl.models.families), fixed once megarl.models is imported.
SUPPORTED_FAMILIES = family_names()


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if Path(model_dir).is_file():
        raise ArchError(f"model path {model_dir} is a file: name the HF model directory that holds config.json "
                        "and the weights (or a megarl checkpoint directory)")
    if not Path(model_dir).is_dir():
        raise ArchError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ArchError(f"{path} not found: an HF model directory needs a config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArchError(f"{path} is not valid JSON: {e}") from e


def arch_from_hf_dir(model_dir: str | Path) -> ModelArch:
    return arch_from_hf_config(load_hf_config(model_dir), source=str(Path(model_dir) / "config.json"))


def arch_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
    """Parses an HF config dict; raises ArchError naming the field for anything unsupported.

    The fields every family shares are read here; the family reads its own (activation, biases,
    window, experts, a rope of its own) through ``Family.read_hf_config``."""

    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ArchError(f"{source}: model_type {family!r} is not supported; "
                        f"supported: {', '.join(SUPPORTED_FAMILIES)}")
    if cfg.get("mlp_bias"):
        raise ArchError(f"{source}: mlp_bias=true is not supported")
    hidden = positive_count(cfg, "hidden_size", source)
    heads = positive_count(cfg, "num_attention_heads", source)
    kv_heads = positive_count(cfg, "num_key_value_heads", source, default=heads)
    # an explicit head_dim may differ from hidden / heads (megatron-core's kv_channels)
    head_dim = positive_count(cfg, "head_dim", source, default=hidden // heads or None)
    if heads % kv_heads:
        raise ArchError(f"{source}: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv_heads}")
    ffn = positive_count(cfg, "intermediate_size", source)
    own = family_of(family).read_hf_config(cfg, source)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return ModelArch(
        family=family,
        vocab_size=positive_count(cfg, "vocab_size", source),
        hidden_size=hidden,
        ffn_hidden_size=own.get("ffn_hidden_size", ffn),  # an MoE family's expert width
        num_layers=positive_count(cfg, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=own.get("num_kv_heads", kv_heads),  # MLA: every head has its own key and value
        head_dim=own.get("head_dim", head_dim),  # MLA: the query/key head (its no-rope and rope parts)
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=own["qkv_bias"],
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=own["rope"] if "rope" in own else rope_from_config(cfg, source),
        sliding_window=own.get("sliding_window"),
        num_experts=own.get("num_experts"),
        moe_topk=own.get("moe_topk"),
        dtype=str(dtype).replace("torch.", ""),
        extra=own.get("extra", {}),
    )
