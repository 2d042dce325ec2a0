"""Recipes shipped inside the package; ``cpu_demo_grpo.yaml`` is what ``megarl train`` runs by default."""

from __future__ import annotations

from pathlib import Path

from megarl.config.loader import load_config
from megarl.config.schema import RunConfig

RECIPES = Path(__file__).parent
DEFAULT = RECIPES / "cpu_demo_grpo.yaml"


def load_run_config(recipe: str | None, overrides: list[str]) -> RunConfig:
    """A recipe file (the packaged default when None) with ``a.b=value`` overrides applied."""
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        overrides, recipe = [recipe, *overrides], None  # `megarl train a.b=1` overrides the default
    return load_config(RunConfig, recipe or DEFAULT, overrides)
