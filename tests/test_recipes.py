"""Every recipe in model_configs/ loads and validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.loader import load_config
from megarl.config.schema import RunConfig
from megarl.config.validate import validate_run

RECIPES = sorted((Path(__file__).parent.parent / "model_configs").glob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_validates(recipe, smollm2):
    cfg = load_config(RunConfig, recipe)
    archs = validate_run(cfg)
    assert "actor" in archs


def test_override_breaks_a_recipe_with_a_named_field(smollm2):
    from megarl.config.loader import ConfigError

    recipe = Path(__file__).parent.parent / "model_configs" / "smollm2_135m_cpu.yaml"
    cfg = load_config(RunConfig, recipe, ["actor.parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"actor\.parallel\.tp=2 does not divide num_attention_heads=9"):
        validate_run(cfg)
