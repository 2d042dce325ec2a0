"""Checks that run before any process starts; every message names the dotted field.

``validate_run`` runs an RL run's checks in order; they live, grouped by what they check, beside
this module: ``ranges``, ``role_checks``, ``rollout_checks``, ``rl_checks``, ``memory``,
``env_checks``, ``eval_checks`` and ``teacher_checks``."""

from __future__ import annotations

from megarl.config.loader import ConfigError, enumeration_errors
from megarl.config.schema import RunConfig
from megarl.models.hf_arch import ModelArch
from megarl.platform import Platform, current_platform
from megarl.rollout.backends import backend_errors
from megarl.validation.eval_checks import eval_errors
from megarl.validation.lora_checks import lora_errors
from megarl.validation.memory import memory_saver_errors
from megarl.validation.ranges import range_errors
from megarl.validation.rl_checks import data_errors, rl_errors
from megarl.validation.role_checks import batching_errors, role_model_errors
from megarl.validation.rollout_checks import (
    expert_parallel_rollout_errors,
    fp8_rollout_errors,
    rollout_fit_errors,
    routing_replay_errors,
)
from megarl.validation.teacher_checks import teacher_errors


def validate_run(cfg: RunConfig, platform: Platform | None = None) -> dict[str, ModelArch]:
    """Checks every role; returns each role's architecture. Raises ConfigError listing all problems."""

    platform = platform or current_platform()
    # Ranges first, and alone: the checks below divide by sizes and step counts, and would only
    # restate an out-of-range value as a layout or batch problem.
    refuse(enumeration_errors(cfg) + range_errors(cfg) + output_dir_errors(cfg.output_dir))
    errors: list[str] = []
    archs: dict[str, ModelArch] = {}
    for name, role in cfg.roles().items():
        arch, role_errors = role_model_errors(name, role, platform)
        errors += role_errors
        if arch is None:
            continue
        archs[name] = arch
        errors += batching_errors(cfg, name, arch, platform)
        errors += memory_saver_errors(arch, role, name)  # recompute, optimizer CPU offload
        errors += lora_errors(name, role, arch)
        if role.model.vocab_pad_multiple < 1:
            errors.append(f"{name}.model.vocab_pad_multiple must be >= 1")
    if "actor" in archs and not errors:  # the RL checks assume sane layouts (dp > 0)
        errors += rl_errors(cfg, archs["actor"])
        errors += rollout_fit_errors(cfg, archs["actor"], platform)
        errors += expert_parallel_rollout_errors(cfg, archs["actor"], platform)
        errors += fp8_rollout_errors(cfg, archs["actor"], platform)
        errors += routing_replay_errors(cfg)
        errors += backend_errors(cfg)
        errors += teacher_errors(cfg, archs)  # one tokenizer for the actor and the teacher that scores its samples
        if not errors:  # reads the whole dataset: only once the rest is known to be sound
            errors += data_errors(cfg) + eval_errors(cfg)
    refuse(errors)
    return archs


def refuse(errors: list[str]) -> None:
    if len(errors) == 1:  # one problem, one line
        raise ConfigError(f"invalid configuration: {errors[0]}")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def output_dir_errors(output_dir: str) -> list[str]:
    """An output_dir that cannot become a directory (it, or a folder above it, is a file)."""
    from pathlib import Path

    if not output_dir.strip():
        return ["output_dir is empty"]
    path = Path(output_dir)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == path else f"is under {parent}, which is a file"
            return [f"output_dir={output_dir!r} {what}, not a directory"]
        if parent.exists():
            break
    return []
