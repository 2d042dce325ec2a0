"""Checks of a role's ``lora`` section (``megarl.config.lora``); every message names the field."""

from __future__ import annotations

from megarl.config.schema import RoleConfig
from megarl.models.hf_arch import ModelArch


def lora_errors(name: str, role: RoleConfig, arch: ModelArch) -> list[str]:
    where = f"{name}.lora"
    errors = role.lora.errors(where)
    if not role.lora.enabled or errors:
        return errors
    if name != "actor":
        errors.append(f"{where}.rank={role.lora.rank}: only the actor trains adapters (set it to 0)")
    if arch.is_moe:
        errors.append(f"{where}: adapters on mixture-of-experts layers are not supported (a dense model only)")
    if role.parallel.sequence_parallel:
        errors.append(f"{where}: adapters under {name}.parallel.sequence_parallel are not supported (set it false)")
    return errors
