"""Model architecture read from a Hugging Face ``config.json``.

``ModelArch`` is the one description of a model that megarl builds, converts and
reshards. It is parsed strictly: a setting megarl cannot reproduce exactly
(an activation, a rope type, biases in the wrong places) is refused with the
field and file named, because a conversion that silently drops one produces
wrong numbers that look fine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral")


class ArchError(ValueError):
    """An HF config megarl cannot reproduce; the message names the field and the file."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    rope: RopeConfig
    sliding_window: int | None = None
    num_experts: int | None = None
    moe_topk: int | None = None
    dtype: str = "float32"  # the checkpoint's torch dtype name
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArch:
        data = dict(data)
        data["rope"] = RopeConfig(**data["rope"])
        return cls(**data)

    def num_parameters(self) -> int:
        """Parameter count of the HF model (unpadded vocab, tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.ffn_hidden_size * (self.num_experts or 1)
        if self.is_moe:
            mlp += h * self.num_experts
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def mismatches(self, other: ModelArch) -> list[str]:
        """Fields that differ between two architectures (dtype excluded), as 'name: a != b'."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [
            f"{key}: {mine[key]!r} != {theirs[key]!r}"
            for key in mine
            if key not in ("dtype", "extra") and mine[key] != theirs[key]
        ]


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
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


def _rope_from_config(cfg: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older files
    # have "rope_theta" and an optional "rope_scaling".
    field_name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    key = "rope_type" if "rope_type" in params else "type"
    kind = params.get(key, "default") or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        return RopeConfig(theta=float(theta), kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=float(theta), kind="llama3", factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise ArchError(f"{source}: rope type {kind!r} (field {field_name}.{key}) is not "
                    "supported; supported: default, linear, llama3")


def arch_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
    """Parses an HF config dict; raises ArchError naming the field for anything unsupported."""

    def need(key: str) -> Any:
        if key not in cfg or cfg[key] is None:
            raise ArchError(f"{source}: required field {key!r} is missing")
        return cfg[key]

    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ArchError(f"{source}: model_type {family!r} is not supported; "
                        f"supported: {', '.join(SUPPORTED_FAMILIES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ArchError(f"{source}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if cfg.get("mlp_bias"):
        raise ArchError(f"{source}: mlp_bias=true is not supported")
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ArchError(f"{source}: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv_heads}")
    # Qwen2 always carries q/k/v biases; Llama-style configs may via attention_bias.
    qkv_bias = family == "qwen2" or bool(cfg.get("attention_bias", False))
    if family != "qwen2" and cfg.get("attention_bias"):
        raise ArchError(f"{source}: attention_bias=true (biases on o_proj too) is not supported")
    sliding = cfg.get("sliding_window")
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding = None
    elif family == "qwen2" and cfg.get("use_sliding_window"):
        raise ArchError(f"{source}: use_sliding_window=true (Qwen2 per-layer windows) is not supported")
    num_experts = moe_topk = None
    ffn = int(need("intermediate_size"))
    if family == "mixtral":
        num_experts = int(need("num_local_experts"))
        moe_topk = int(need("num_experts_per_tok"))
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return ModelArch(
        family=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=_rope_from_config(cfg, source),
        sliding_window=int(sliding) if sliding else None,
        num_experts=num_experts,
        moe_topk=moe_topk,
        dtype=str(dtype).replace("torch.", ""),
    )
