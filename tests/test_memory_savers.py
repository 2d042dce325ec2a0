"""Activation recompute and optimizer CPU offload: config -> megatron-core, planner memory, search."""

from __future__ import annotations

from megarl.config.schema import OptimizerConfig, RecomputeConfig
from megarl.models.gpt import recompute_kwargs
from megarl.plan.archs import load_arch
from megarl.plan.hardware import GIB, GPUS, Efficiency
from megarl.plan.memory import Layout, Workload, trained_rank
from megarl.plan.search import PlanInputs, plan
from megarl.plan.steptime import RLShape


def test_recompute_reaches_megatron_transformer_config():
    from megarl.config.schema import ParallelConfig, PrecisionConfig
    from megarl.models.gpt import ModelSpec, transformer_config

    arch = load_arch("llama3.1-8b")
    spec = ModelSpec(arch, ParallelConfig(), PrecisionConfig(), recompute=RecomputeConfig("full", "block", 2))
    cfg = transformer_config(spec)  # what megarl hands megatron-core's GPTModel
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 2)
    spec = ModelSpec(arch, ParallelConfig(), PrecisionConfig(),
                     recompute=RecomputeConfig("selective", modules=["core_attn", "mlp"]))
    cfg = transformer_config(spec)
    assert cfg.recompute_granularity == "selective" and cfg.recompute_modules == ["core_attn", "mlp"]
    assert transformer_config(ModelSpec(arch, ParallelConfig(), PrecisionConfig())).recompute_granularity is None
    assert recompute_kwargs(RecomputeConfig()) == {}


def test_full_recompute_cuts_measured_activations(starts_processes):
    """A real megatron-core step on one CPU rank: full recompute saves far less for backward,
    and the planner's estimate follows both within 15%."""
    from megarl_bench.memory import Case, run_memory_bench

    cases = [Case("small", world=1, dtype="bfloat16"), Case("small", world=1, dtype="bfloat16", recompute="full")]
    rows = run_memory_bench(cases, tolerance=0.15, progress=lambda *a: None)
    act = {r["case"]: r for r in rows if r["component"] == "activations"}
    plain, recomputed = (act[c.label()]["measured"] for c in cases)
    assert recomputed < plain / 2
    assert all(r["ok"] for r in rows), rows


def test_offload_reaches_megatron_optimizer_config(monkeypatch):
    import megarl.platform as platform
    from megarl.models.train import offload_kwargs

    cfg = OptimizerConfig(cpu_offload=True, offload_fraction=0.5)
    assert offload_kwargs(cfg) == {}  # CPU: all state is host memory, and megatron-core cannot build it here
    monkeypatch.setattr(platform, "current_platform",
                        lambda: platform.Platform(name="cuda", backend="nccl", has_transformer_engine=True))
    kw = offload_kwargs(cfg)
    assert kw["optimizer_cpu_offload"] and kw["optimizer_offload_fraction"] == 0.5
    assert kw["use_precision_aware_optimizer"]
    assert offload_kwargs(OptimizerConfig()) == {}


def test_recompute_and_offload_shrink_the_planned_memory():
    arch, layout = load_arch("llama3.1-70b"), Layout(tp=8, pp=4, dp=1, sequence_parallel=True)
    base = Workload(seq_len=4096)
    none = trained_rank(arch, layout, base, 0, microbatches=64)
    full = trained_rank(arch, layout, Workload(seq_len=4096, recompute="full"), 0, microbatches=64)
    block = trained_rank(arch, layout, Workload(seq_len=4096, recompute="full", recompute_method="block",
                                                recompute_layers=10), 0, microbatches=64)
    assert full.activations < block.activations < none.activations
    half = trained_rank(arch, layout, Workload(seq_len=4096, offload_fraction=0.5), 0)
    assert abs(half.optimizer - none.optimizer / 2) < 1 and abs(half.optimizer_host - none.optimizer / 2) < 1


def test_70b_ppo_on_32_h100_fits_with_savers():
    rl = RLShape(algo="ppo", prompts=256, n=8, prompt_len=1024, response_len=2048)
    result = plan(load_arch("llama3.1-70b"), 32, PlanInputs(GPUS["h100-80gb"], rl, Efficiency()))
    assert result.fits and result.peak <= GPUS["h100-80gb"].memory_gib * GIB
    assert any(p.saver is not None and (p.saver.recompute != "none" or p.saver.offload > 0)
               for p in result.roles.values())


def test_8b_on_16_h100_does_not_pick_a_deep_pipeline():
    # peers run tp1 pp2 dp8 here (NeMo RL's recipe); pipeline sends make pp=16 dp=1 lose
    rl = RLShape(prompts=64, n=32, prompt_len=200, response_len=3896, mean_response_len=819, minibatches=4)
    result = plan(load_arch("llama3.1-8b"), 16, PlanInputs(GPUS["h100-80gb"], rl, Efficiency()))
    assert result.roles["actor"].layout.pp <= 4


def test_memory_saver_fields_are_checked_with_their_names():
    from megarl.config.schema import ParallelConfig, RoleConfig
    from megarl.validation.memory import memory_saver_errors

    arch = load_arch("llama3.1-8b")  # 32 layers
    role = RoleConfig(parallel=ParallelConfig(pp=2), recompute=RecomputeConfig("full", "uniform", 3))
    assert any("actor.recompute.num_layers=3 must divide the 16 layers" in e
               for e in memory_saver_errors(arch, role, "actor"))
    from megarl.config.loader import enumeration_errors

    role = RoleConfig(recompute=RecomputeConfig("sometimes"))
    assert enumeration_errors(role, "actor") == [
        "actor.recompute.granularity: 'sometimes' is not one of none, selective, full"]
    role = RoleConfig(recompute=RecomputeConfig("selective", modules=["moe"]))
    assert any("MoE modules of a dense model" in e for e in memory_saver_errors(arch, role, "actor"))
    role = RoleConfig(optim=OptimizerConfig(cpu_offload=True, use_distributed_optimizer=False, offload_fraction=0))
    errors = memory_saver_errors(arch, role, "critic")
    assert any("critic.optim.cpu_offload needs critic.optim.use_distributed_optimizer" in e for e in errors)
    assert any("critic.optim.offload_fraction=0" in e for e in errors)
    assert memory_saver_errors(arch, RoleConfig(), "actor") == []


def test_no_fit_names_the_components_left_with_every_saver():
    import pytest

    from megarl.plan.search import NoFit

    rl = RLShape(algo="ppo", prompts=256, n=8, prompt_len=1024, response_len=2048)
    with pytest.raises(NoFit) as e:
        plan(load_arch("llama3.1-70b"), 8, PlanInputs(GPUS["h100-80gb"], rl, Efficiency()), "colocated")
    msg = str(e.value)
    assert "actor:gradients" in msg and "critic:weights" in msg
    assert "recompute=full (uniform, 1 layer), optimizer offload=1" in msg
