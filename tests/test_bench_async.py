"""``megarl bench async``: its figures from a run's metrics, checked by hand; its refusals.

The runs themselves are the trainer's (tests/test_trainer.py runs max_staleness=1); the
benchmark is run by hand, its output quoted in the issue notes."""

from __future__ import annotations

import pytest

from megarl.cli.main import main
from megarl_bench.async_rollout import SHARED, format_table, over_seeds, report, setting_summary


def _step(step: int, tokens_per_s: float, step_s: float, staleness: int, **more) -> dict:
    return {"step": step, "throughput/tokens_per_s": tokens_per_s, "time/step_s": step_s,
            "busy/rollout_fraction": 0.5, "busy/actor_fraction": 0.25, "rollout/staleness": staleness,
            "mismatch/kl_k3": 0.01 * staleness, "reward/mean": 0.1 * step, **more}


def test_summary_by_hand():
    history = [{"step": 0, "eval/heldout/accuracy": 0.25},  # the evaluation before training
               _step(1, 10.0, 40.0, 0), _step(2, 30.0, 20.0, 1),
               _step(3, 20.0, 10.0, 1, **{"eval/heldout/accuracy": 0.5})]
    s = setting_summary(history)
    assert s["tokens_per_s"] == pytest.approx((30 * 20 + 20 * 10) / 30)  # step 1 is warm-up
    assert s["step_s"] == pytest.approx(15.0)
    assert s["mean_staleness"] == pytest.approx(2 / 3)
    assert s["mismatch_kl"] == pytest.approx(0.02 / 3)
    assert s["heldout_accuracy"] == 0.5 and s["reward_mean_last"] == pytest.approx(0.3)


def test_report_puts_k1_over_k0():
    base = setting_summary([_step(1, 1.0, 1.0, 0), _step(2, 20.0, 10.0, 0, **{"eval/a/accuracy": 0.60})])
    ahead = setting_summary([_step(1, 1.0, 1.0, 0), _step(2, 32.0, 10.0, 1, **{"eval/a/accuracy": 0.57})])
    shared = setting_summary([_step(1, 1.0, 1.0, 0), _step(2, 25.0, 8.0, 0, **{"eval/a/accuracy": 0.61})])
    result = report({"0": base, "1": ahead, SHARED: shared})
    assert result["speedup"] == pytest.approx(1.6)
    assert result["accuracy_points_lost"] == pytest.approx(3.0)
    assert result["heldout_accuracy"] == {"0": 0.60, "1": 0.57, SHARED: 0.61}
    # lockstep with both cores in each side's turn: 25 tokens/s in 8 s steps against k=1's 32 in 10 s
    assert result["speedup_vs_shared_lockstep"] == pytest.approx(1.28)
    assert result["step_time_ratio_vs_shared_lockstep"] == pytest.approx(0.8)
    table = format_table(result)
    assert "speedup k=1 / k=0 (tokens/s, same cores): 1.60x (measured/target 1.07)" in table
    assert "3.0 points (limit 5)" in table
    assert "k=1 / lockstep on shared cores: 1.28x tokens/s, 0.80x step time" in table


def test_seeds_are_averaged_and_each_accuracy_kept():
    runs = [setting_summary([_step(1, 1.0, 1.0, 0), _step(2, tokens, 10.0, 1, **{"eval/a/accuracy": acc})])
            for tokens, acc in ((30.0, 0.5), (40.0, 0.6))]
    s = over_seeds(runs)
    assert s["tokens_per_s"] == pytest.approx(35.0) and s["heldout_accuracy"] == pytest.approx(0.55)
    assert s["heldout_accuracy_per_seed"] == [0.5, 0.6] and s["tokens_per_s_per_seed"] == [30.0, 40.0]
    assert over_seeds(runs[:1]) == runs[0]  # one run: its own figures
    assert "k=1: held-out accuracy per seed 50.0%, 60.0%" in format_table(report({"1": s}))


def test_refuses_bad_arguments_before_starting_anything(capsys):
    assert main(["bench", "async", "--staleness", "0,-1", "--steps", "0", "--seeds", "1,-2"]) == 2
    err = capsys.readouterr().err
    assert "--staleness=-1 must be >= 0" in err and "--steps=0 must be >= 1" in err and "--seeds=-2 must be >= 0" in err
