"""Value checks for the numbers in HF ``config.json`` files and megarl's ``megarl.json``.

Parsing turns fields into ints and floats with ``int()``/``float()``, which accepts
``"64"`` and lets ``0`` through to a division or a tensor shape many steps later (a
traceback, or a model transformers cannot build). These checks run first and name
the file and the field.
"""

from __future__ import annotations

from typing import Any

from megarl.config.loader import ConfigError

# HF config.json: integers that size the model, and numbers that must be positive.
HF_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
HF_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                    "num_local_experts", "num_experts_per_tok")
HF_OPTIONAL_FLOATS = ("rms_norm_eps", "rope_theta")
HF_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
HF_ROPE_FLOATS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor")
HF_ROPE_INTS = ("original_max_position_embeddings",)

# megarl.json "arch" (a ModelArch as a dict)
ARCH_INTS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "max_position_embeddings")
ARCH_OPTIONAL_INTS = ("sliding_window", "num_experts", "moe_topk")
ARCH_BOOLS = ("tie_embeddings", "qkv_bias")
ROPE_KINDS = ("default", "linear", "llama3", "yarn")  # yarn: DeepSeek-V3 (megatron-core MLA builds it)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(data: dict, key: str, source: str, optional: bool = False) -> None:
    value = data.get(key)
    if value is None:
        if optional:
            return
        raise ConfigError(f"{source}: required field {key!r} is missing")
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"{source}: field {key!r} must be a positive integer, got {value!r}")


def positive_number(data: dict, key: str, source: str, optional: bool = True) -> None:
    value = data.get(key)
    if value is None and optional:
        return
    if not _is_number(value) or not 0 < value < float("inf"):
        raise ConfigError(f"{source}: field {key!r} must be a positive number, got {value!r}")


def boolean(data: dict, key: str, source: str, optional: bool = True) -> None:
    value = data.get(key)
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field {key!r} must be true or false, got {value!r}")


def check_hf_config(cfg: Any, source: str) -> None:
    """Refuses an HF config whose sizing fields are not positive numbers of the right kind."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: must hold a JSON object, got {type(cfg).__name__}")
    for key in HF_REQUIRED_INTS:
        positive_int(cfg, key, source)
    for key in HF_OPTIONAL_INTS:
        # Qwen configs write sliding_window 0 (or any number) when use_sliding_window is false: unused
        if key == "sliding_window" and cfg.get("use_sliding_window") is False:
            continue
        positive_int(cfg, key, source, optional=True)
    for key in HF_OPTIONAL_FLOATS:
        positive_number(cfg, key, source)
    for key in HF_OPTIONAL_BOOLS:
        boolean(cfg, key, source)
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: field {field!r} must be an object or null, got {rope!r}")
        for key in HF_ROPE_FLOATS:
            positive_number(rope, key, f"{source} ({field})")
        for key in HF_ROPE_INTS:
            positive_int(rope, key, f"{source} ({field})", optional=True)


def check_arch_dict(arch: Any, source: str) -> None:
    """Refuses a megarl.json ``arch`` that ModelArch cannot be built from, or that sizes nothing."""
    from dataclasses import MISSING, fields

    from megarl.models.hf_arch import SUPPORTED_FAMILIES, ModelArch, RopeConfig

    where = f"{source} (arch)"
    if not isinstance(arch, dict):
        raise ConfigError(f"{source}: field 'arch' must be an object, got {arch!r}")
    expected = {f.name for f in fields(ModelArch)}
    required = {f.name for f in fields(ModelArch) if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(arch))
    unknown = sorted(set(arch) - expected)
    if missing or unknown:
        raise ConfigError(f"{where}: " + "; ".join(
            ([f"missing field(s) {', '.join(missing)}"] if missing else [])
            + ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])))
    if arch["family"] not in SUPPORTED_FAMILIES:
        raise ConfigError(f"{where}: field 'family' is {arch['family']!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    for key in ARCH_INTS:
        positive_int(arch, key, where)
    for key in ARCH_OPTIONAL_INTS:
        positive_int(arch, key, where, optional=True)
    positive_number(arch, "norm_eps", where, optional=False)
    for key in ARCH_BOOLS:
        boolean(arch, key, where, optional=False)
    if arch["num_heads"] % arch["num_kv_heads"]:
        raise ConfigError(f"{where}: num_heads={arch['num_heads']} is not a multiple of "
                          f"num_kv_heads={arch['num_kv_heads']}")
    rope = arch["rope"]
    rope_fields = {f.name for f in fields(RopeConfig)}
    if not isinstance(rope, dict) or "theta" not in rope or set(rope) - rope_fields:
        raise ConfigError(f"{where}: field 'rope' must be an object with 'theta' and only {sorted(rope_fields)}, "
                          f"got {rope!r}")
    if rope.get("kind", "default") not in ROPE_KINDS:
        raise ConfigError(f"{where}: rope kind {rope.get('kind')!r} is not one of {', '.join(ROPE_KINDS)}")
    for key in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
        positive_number(rope, key, f"{where} rope")
    positive_int(rope, "original_max_position_embeddings", f"{where} rope", optional=True)
    if not isinstance(arch.get("extra", {}), dict):
        raise ConfigError(f"{where}: field 'extra' must be an object")
