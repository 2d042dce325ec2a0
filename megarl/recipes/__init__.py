"""Recipes shipped inside the package; ``cpu_demo_grpo.yaml`` is what ``megarl train`` runs by default."""

from pathlib import Path

RECIPES = Path(__file__).parent
DEFAULT = RECIPES / "cpu_demo_grpo.yaml"
