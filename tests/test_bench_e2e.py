"""`megarl bench e2e`'s pure parts: tokens/s, the report and its verdict, the recipe -> TRL
mapping, and the refusal when TRL is missing. The benchmark itself is `megarl bench e2e`."""

from __future__ import annotations

import sys

import pytest

from megarl_bench.e2e import (
    TARGET_RATIO,
    StepRecord,
    SystemResult,
    build_report,
    format_table,
    megarl_steps,
    throughput,
)
from megarl_bench.e2e_trl import grpo_settings


def _result(name: str, steps: list[tuple[int, float, float]], overhead: float = 30.0,
            startup: float | None = None) -> SystemResult:
    return SystemResult(system=name, steps=[StepRecord(t, s, r) for t, s, r in steps], overhead_s=overhead,
                        samples_per_step=10, notes=[f"{name} note"], startup_s=startup)


def test_throughput_leaves_out_the_warmup_step():
    steps = [StepRecord(1000, 100.0, 0.1), StepRecord(60, 20.0, 0.2), StepRecord(40, 20.0, 0.3)]
    assert throughput(steps) == (100, 40.0, 2.5)
    assert throughput(steps, warmup=0) == (1100, 140.0, 1100 / 140)


def test_throughput_needs_a_step_after_the_warmup():
    with pytest.raises(ValueError, match="run more steps"):
        throughput([StepRecord(10, 1.0, 0.0)])


def test_megarl_steps_recover_generated_tokens_from_the_logged_rate():
    history = [{"step": 1, "time/step_s": 54.8, "throughput/tokens_per_s": 978 / 54.8, "reward/mean": 0.25},
               {"step": 2, "time/step_s": 33.0, "throughput/tokens_per_s": 275 / 33.0, "reward/mean": 0.5}]
    assert [(s.tokens, s.seconds, s.reward) for s in megarl_steps(history)] == [(978, 54.8, 0.25), (275, 33.0, 0.5)]
    with pytest.raises(KeyError, match="reward/mean"):
        megarl_steps([{"step": 3, "time/step_s": 1.0, "throughput/tokens_per_s": 1.0}])


def test_megarl_steps_leave_out_the_evaluation_before_training():
    """`megarl bench e2e` with the demo's held-out evaluation on ended in a KeyError: step 0's row."""
    history = [{"step": 0, "eval/chain_sum/accuracy": 0.42},
               {"step": 1, "time/step_s": 2.0, "throughput/tokens_per_s": 10.0, "reward/mean": 0.5}]
    assert [(s.tokens, s.seconds, s.reward) for s in megarl_steps(history)] == [(20, 2.0, 0.5)]


def test_report_pools_rounds_and_judges_the_ratio_against_the_target():
    setup = {"task": "GRPO on a model", "steps": 3, "threads": 2, "cores": 2, "notes": ["load note"]}
    rounds = [
        # round 1: megarl 300 tok / 60 s = 5/s, TRL 200 tok / 100 s = 2/s
        {"order": ("megarl", "trl"), "megarl": _result("megarl", [(500, 90, 0.2), (150, 30, 0.3), (150, 30, 0.5)]),
         "trl": _result("trl", [(500, 80, 0.2), (100, 50, 0.4), (100, 50, 0.6)])},
        # round 2: megarl 100 tok / 100 s = 1/s, TRL 200 tok / 100 s = 2/s
        {"order": ("trl", "megarl"), "megarl": _result("megarl", [(500, 90, 0.2), (50, 50, 0.3), (50, 50, 0.4)]),
         "trl": _result("trl", [(500, 80, 0.2), (100, 50, 0.4), (100, 50, 0.6)])},
    ]
    report = build_report(setup, rounds)
    assert [r["ratio"] for r in report["rounds"]] == [2.5, 0.5]
    assert [r["passed"] for r in report["rounds"]] == [True, False]
    # pooled: megarl 400 tok / 160 s = 2.5/s, TRL 400 / 200 = 2/s -> 1.25, not the mean of the ratios (1.5)
    assert report["pooled"]["megarl"] == {"tokens": 400, "seconds": 160, "tokens_per_s": 2.5}
    assert report["ratio"] == pytest.approx(1.25) and not report["passed"] and report["target"] == TARGET_RATIO
    first = report["rounds"][0]["megarl"]
    assert (first["reward_first"], first["reward_last"], first["timed_steps"]) == (0.2, 0.5, 2)
    assert first["mean_response_tokens"] == 15.0  # 300 tokens / (2 steps x 10 responses)
    table = format_table(report)
    assert "ratio 1.25 (target >= 1.5): FAIL" in table
    assert "note: megarl note" in table and "note: load note" in table
    assert table.index("megarl", table.index("    2 |")) > table.index("trl", table.index("    2 |"))  # order kept

    report = build_report(setup, rounds[:1])
    assert report["passed"] and "ratio 2.50 (target >= 1.5): PASS" in format_table(report)
    assert report["startup"] is None and "start-up" not in format_table(report)  # a side did not report it


def test_report_sets_the_start_up_beside_trls():
    """Start-up to the first step: each side's mean over the rounds, megarl's as a multiple of TRL's."""
    steps = [(500, 90, 0.2), (150, 30, 0.3)]
    rounds = [{"order": ("megarl", "trl"), "megarl": _result("megarl", steps, startup=30.0),
               "trl": _result("trl", steps, startup=10.0)},
              {"order": ("trl", "megarl"), "megarl": _result("megarl", steps, startup=20.0),
               "trl": _result("trl", steps, startup=14.0)}]
    report = build_report({"task": "t", "steps": 2, "threads": 2, "cores": 2, "notes": []}, rounds)
    assert report["startup"] == {"megarl_s": 25.0, "trl_s": 12.0, "ratio": 25 / 12, "target": 2.0, "passed": False}
    assert "megarl 25.0 s vs TRL 12.0 s: 2.08x (target <= 2x): FAIL" in format_table(report)
    assert report["rounds"][1]["megarl"]["startup_s"] == 20.0



def _demo_config(*overrides: str):
    from megarl.recipes import load_run_config

    return load_run_config(None, list(overrides))


def test_trl_settings_reproduce_the_demo_recipe(tmp_path):
    s = grpo_settings(_demo_config(), steps=4, output_dir=tmp_path)
    # 4 prompts x 8 samples = 32 completions, generated at once, one optimizer step over micro-batches of 8
    assert (s["per_device_train_batch_size"], s["gradient_accumulation_steps"], s["num_generations"]) == (8, 4, 8)
    assert (s["max_completion_length"], s["temperature"], s["learning_rate"], s["beta"]) == (48, 1.0, 3e-5, 0.001)
    assert (s["loss_type"], s["scale_rewards"], s["epsilon"], s["epsilon_high"], s["top_k"]) == \
        ("dapo", "group", 0.2, 0.2, 0)
    assert not s["use_vllm"] and not s["shuffle_dataset"] and not s["gradient_checkpointing"] and not s["bf16"]
    assert (s["max_steps"], s["seed"], s["lr_scheduler_type"]) == (4, 1234, "constant")


def test_trl_settings_refuse_what_trl_cannot_reproduce(tmp_path):
    cfg = _demo_config("algorithm.dynamic_sampling=true", "algorithm.kl_estimator=k1", "actor.micro_batch_size=5")
    with pytest.raises(ValueError) as info:
        grpo_settings(cfg, steps=4, output_dir=tmp_path)
    for field in ("algorithm.dynamic_sampling", "algorithm.kl_estimator", "actor.micro_batch_size=5"):
        assert field in str(info.value)


def test_trl_config_accepts_the_settings(tmp_path):
    pytest.importorskip("trl")
    from trl.trainer.grpo_config import GRPOConfig

    config = GRPOConfig(**grpo_settings(_demo_config(), steps=4, output_dir=tmp_path))
    assert (config.generation_batch_size, config.steps_per_generation) == (32, 4)


def test_missing_trl_exits_2_and_says_how_to_install(monkeypatch, capsys, tmp_path):
    from megarl.cli.main import build_parser

    monkeypatch.setitem(sys.modules, "trl", None)  # makes `import trl` raise ImportError
    args = build_parser().parse_args(["bench", "e2e", "--steps", "2", "--out", str(tmp_path)])
    assert args.handler(args) == 2
    assert "pip install -e .[bench]" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything ran
