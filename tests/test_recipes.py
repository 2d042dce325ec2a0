"""Every recipe in model_configs/ loads and validates; the big ones state their GPU count, and the
planner finds every GPU of the stated type within memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.config.loader import ConfigError, load_config
from megarl.config.schema import RunConfig
from megarl.validation.checks import validate_run

ALL_RECIPES = sorted((Path(__file__).parent.parent / "model_configs").glob("*.yaml"))
# The RLHF pipeline's stages read the previous stage's output (runs/<stage>/final): checked as a chain
PIPELINE = [r for r in ALL_RECIPES if r.stem.startswith("cpu_rlhf_")]
# and the distillation recipe's teacher is an SFT run's output (runs/cpu-opd-teacher/final)
DISTILL = Path(__file__).parent.parent / "model_configs" / "cpu_opd.yaml"
RECIPES = [r for r in ALL_RECIPES if r not in PIPELINE and r != DISTILL]
# "# ...: 48 GPUs (6 nodes of 8 x H100 80GB)." in a cluster recipe's first line
HEADER = re.compile(r"(\d+) GPUs \((\d+) nodes? of (\d+) x (H100 80GB|H200 141GB|A100 80GB)\)")
GPU_NAMES = {"H100 80GB": "h100-80gb", "H200 141GB": "h200-141gb", "A100 80GB": "a100-80gb"}


def _cluster_recipes() -> list[Path]:
    return [r for r in RECIPES if HEADER.search(r.read_text().splitlines()[0])]


def test_there_are_recipes():
    assert RECIPES
    names = {r.stem for r in _cluster_recipes()}
    assert {"llama3.1_8b_ppo", "llama3.1_70b_grpo", "llama3.1_405b_grpo", "qwen2.5_7b_grpo", "qwen2.5_32b_grpo",
            "qwen2.5_72b_grpo", "mixtral_8x7b_grpo", "qwen3_30b_a3b_grpo", "qwen3_235b_a22b_grpo"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_validates(recipe, smollm2, tmp_path, monkeypatch):
    if recipe.stem == "cpu_openenv_echo":  # its environment is written by `openenv init`, as its header says
        from openenv_echo import write_echo_env

        write_echo_env(tmp_path, monkeypatch)
    cfg = load_config(RunConfig, recipe)
    archs = validate_run(cfg)
    assert "actor" in archs


@pytest.mark.parametrize("recipe", _cluster_recipes(), ids=[r.stem for r in _cluster_recipes()])
def test_cluster_recipe_gpu_count_and_fit(recipe):
    from megarl.plan.hardware import GIB, gpu_spec
    from megarl.plan.recipe import evaluate_recipe, recipe_gpus

    gpus, nodes, per_node, kind = HEADER.search(recipe.read_text().splitlines()[0]).groups()
    cfg = load_config(RunConfig, recipe)
    assert recipe_gpus(cfg) == int(gpus) == int(nodes) * int(per_node)
    plan = evaluate_recipe(cfg, validate_run(cfg), gpu_spec(GPU_NAMES[kind]))
    over = {group: round(mem.total / GIB, 1) for group, mem in plan.per_gpu.items() if mem.total > plan.capacity}
    assert not over and not plan.problems, (over, plan.problems)


def test_cluster_recipe_without_readable_arch_names_both_fields():
    recipe = next(r for r in RECIPES if r.stem == "llama3.1_8b_ppo")
    cfg = load_config(RunConfig, recipe, ["actor.model.arch=no-such-model"])
    with pytest.raises(ConfigError, match=r"actor\.model\.path: .* does not exist; and actor\.model\.arch: "
                                          r"no-such-model is neither"):
        validate_run(cfg)


def test_arch_must_match_a_readable_path(smollm2):
    recipe = Path(__file__).parent.parent / "model_configs" / "smollm2_135m_cpu.yaml"
    cfg = load_config(RunConfig, recipe, ["actor.model.arch=llama3.1-8b"])
    with pytest.raises(ConfigError, match=r"actor\.model\.arch='llama3.1-8b' does not match actor\.model\.path: "
                                          r".*hidden_size: 576 != 4096"):
        validate_run(cfg)


def test_override_breaks_a_recipe_with_a_named_field(smollm2):
    recipe = Path(__file__).parent.parent / "model_configs" / "smollm2_135m_cpu.yaml"
    cfg = load_config(RunConfig, recipe, ["actor.parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"actor\.parallel\.tp=2 does not divide num_attention_heads=9"):
        validate_run(cfg)


def test_the_rlhf_pipeline_recipes_chain_and_validate_where_their_inputs_exist(smollm2):
    """SFT validates as it stands; the reward model validates on the bundled model in place of the
    SFT output; PPO loads, and names the SFT output for its actor and reference and the reward
    model's for its critic and reward model (run end to end by examples/rlhf_pipeline.sh)."""
    from megarl.config.supervised import SupervisedConfig
    from megarl.validation.supervised_checks import validate_supervised

    sft, rm, ppo = (next(r for r in PIPELINE if r.stem == f"cpu_rlhf_{s}") for s in ("sft", "rm", "ppo"))
    sft_cfg = load_config(SupervisedConfig, sft)
    sft_cfg.stage = "sft"
    validate_supervised(sft_cfg)
    rm_cfg = load_config(SupervisedConfig, rm)
    assert rm_cfg.model.model.path == f"{sft_cfg.output_dir}/final"
    rm_cfg.model.model.path = "bundled:SmolLM2-135M-Instruct"
    validate_supervised(rm_cfg)
    ppo_cfg = load_config(RunConfig, ppo)
    assert ppo_cfg.actor.model.path == ppo_cfg.reference.model.path == f"{sft_cfg.output_dir}/final"
    assert ppo_cfg.critic.model.path == ppo_cfg.reward_model.model.path == f"{rm_cfg.output_dir}/final"
    assert [t.eval_only for t in ppo_cfg.rewards] == [False, True] and ppo_cfg.eval.sets


def test_the_distillation_recipe_validates_with_its_teacher_in_place(smollm2):
    """cpu_opd.yaml's teacher is what its header's commands make (the base's own correct answers by
    scripts/rejection_sample_chain_sum.py, then `megarl sft ... output_dir=runs/cpu-opd-teacher`); with
    the bundled model (the same tokenizer) in its place the recipe validates."""
    cfg = load_config(RunConfig, DISTILL)
    assert cfg.teacher.model.path == "runs/cpu-opd-teacher/final" and cfg.algorithm.name == "opd"
    header = DISTILL.read_text()
    assert "python scripts/rejection_sample_chain_sum.py runs/cpu-opd-teacher-data.jsonl" in header
    assert "data.train=runs/cpu-opd-teacher-data.jsonl" in header and "output_dir=runs/cpu-opd-teacher\n" in header
    assert (DISTILL.parent.parent / "scripts" / "rejection_sample_chain_sum.py").is_file()
    cfg.teacher.model.path = "bundled:SmolLM2-135M-Instruct"
    assert set(validate_run(cfg)) == {"actor", "teacher"}
