"""Placement arithmetic: bundles per host and each role's share of them (pure; no Ray)."""

from __future__ import annotations

from megarl.cluster.placement import bundle_plan, placement_errors
from megarl.config.schema import ParallelConfig, RoleConfig, RunConfig


def _run(**rollout) -> RunConfig:
    cfg = RunConfig(actor=RoleConfig(parallel=ParallelConfig(tp=2, world_size=4)),
                    reference=RoleConfig(parallel=ParallelConfig(tp=2, world_size=2), colocate_with="actor"),
                    critic=RoleConfig(parallel=ParallelConfig(world_size=2), cpus_per_rank=2.0))
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    return cfg


def test_disaggregated_roles_get_their_own_bundles():
    bundles, asks = bundle_plan(_run(engines=2, tp=2), gpu=True)
    assert sorted(bundles) == ["actor", "critic", "rollout"]
    assert bundles["critic"] == [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert bundles["rollout"] == [{"CPU": 1.0, "GPU": 2.0}] * 2  # one bundle per engine, its TP's GPUs
    assert asks["critic"] == (2.0, 1.0) and asks["rollout"] == (1.0, 2.0)


def test_colocated_roles_share_devices_and_add_cpus():
    bundles, asks = bundle_plan(_run(engines=4, colocate_with="actor"), gpu=True)
    # actor (4 ranks), reference (2) and vLLM (4 engines) on the actor's 4 bundles: one GPU each,
    # split three ways where three roles share it, CPUs added up
    assert bundles["actor"] == [{"CPU": 3.0, "GPU": 1.0}] * 2 + [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert asks["actor"] == asks["reference"] == asks["rollout"] == (1.0, 1.0 / 3)


def test_cpu_bundles_have_no_gpus():
    bundles, asks = bundle_plan(_run(colocate_with="actor"), gpu=False)
    assert all("GPU" not in b for host in bundles.values() for b in host)
    assert asks["rollout"] == (1.0, 0.0)


def test_colocated_tensor_parallel_rollout_is_refused_on_gpu_only():
    cfg = _run(tp=2, colocate_with="actor")
    assert placement_errors(cfg, gpu=False) == []
    (error,) = placement_errors(cfg, gpu=True)
    assert error.startswith("rollout.colocate_with='actor' needs rollout.tp=1 on GPU (got 2)")
