"""`megarl bench endpoint` end to end at its smallest size (a tiny Llama with SmolLM2's tokenizer
and chat template, one prompt of two samples a round): the report's shape and sense, not its speed
(the 0.8x target is the benchmark's own business)."""

from __future__ import annotations

import json
import math
import os

import pytest


def test_endpoint_against_in_process_episodes(cli, tiny_policy):
    policy = tiny_policy
    proc = cli("bench", "endpoint", "--prompts", "1", "--rounds", "1", "--json", f"actor.model.path={policy}",
               f"reference.model.path={policy}", "rollout.max_tokens=8", "rollout.n=2", "eval.sets=[]",
               "rollout.max_model_len=512", "data.max_prompt_len=256", "env.max_episode_tokens=400",
               timeout=600, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: under its target, its verdict at this size
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for path in ("endpoint", "in_process"):
        assert all(math.isfinite(report[path][k]) and report[path][k] > 0 for k in ("tokens_per_s", "seconds"))
        assert report[path]["episodes_per_s"] == pytest.approx(2 / report[path]["seconds"])
    ratio = report["ratio"]
    assert ratio["target"] == 0.8
    assert ratio["measured"] == pytest.approx(report["endpoint"]["tokens_per_s"] / report["in_process"]["tokens_per_s"])
    assert (proc.returncode == 0) == (ratio["measured/target"] >= 1.0)


def test_the_two_arms_report_medians_and_the_first_arms_tokens_per_second_over_the_seconds():
    from megarl_bench.endpoint import format_table, report

    rounds = {"endpoint": [{"tokens_per_s": 40.0, "episodes_per_s": 1.0, "seconds": 10.0},
                           {"tokens_per_s": 44.0, "episodes_per_s": 1.2, "seconds": 9.0},
                           {"tokens_per_s": 50.0, "episodes_per_s": 1.4, "seconds": 8.0}],
              "in_process": [{"tokens_per_s": 50.0, "episodes_per_s": 1.5, "seconds": 8.0},
                             {"tokens_per_s": 55.0, "episodes_per_s": 1.6, "seconds": 7.0},
                             {"tokens_per_s": 60.0, "episodes_per_s": 1.7, "seconds": 6.0}]}
    result = report(rounds)
    assert result["endpoint"] == {"tokens_per_s": 44.0, "episodes_per_s": 1.2, "seconds": 9.0}  # medians
    assert result["ratio"] == pytest.approx({"measured": 0.8, "target": 0.8, "measured/target": 1.0})
    assert "endpoint / in_process tokens/s: 0.80x (target >= 0.80x, measured/target 1.00)" in format_table(result)
