"""Architectures of models whose weights are not on this machine.

A recipe for a cluster names its weights by a cluster path and its architecture by
``model.arch``: a name from ``megarl/plan/arch_configs`` (``llama3.1-70b``), or the path
of an HF ``config.json`` (or of its folder). The files there hold the published
architecture numbers of each model card; they validate and plan, they build nothing.
They are package data, so ``megarl plan`` works from an installed wheel too;
``model_configs/archs`` in the source tree links to them.
"""

from __future__ import annotations

import json
from pathlib import Path

from megarl.models.hf_arch import ArchError, ModelArch, arch_from_hf_config

ARCHS_DIR = Path(__file__).resolve().parent / "arch_configs"


def arch_names() -> list[str]:
    return sorted(p.parent.name for p in ARCHS_DIR.glob("*/config.json"))


def arch_config_path(spec: str | Path) -> Path:
    """The config.json that ``spec`` (a shipped name, a config.json or a folder holding one) means."""
    path = Path(spec)
    if path.is_file():
        return path
    if (path / "config.json").is_file():
        return path / "config.json"
    named = ARCHS_DIR / str(spec) / "config.json"
    if named.is_file():
        return named
    raise ArchError(f"{spec} is neither a config.json, a folder with one, nor a name from "
                    f"{ARCHS_DIR} ({', '.join(arch_names()) or 'none there'})")


def load_arch(spec: str | Path) -> ModelArch:
    path = arch_config_path(spec)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArchError(f"{path} is not valid JSON: {e}") from e
    return arch_from_hf_config(cfg, source=str(path))
