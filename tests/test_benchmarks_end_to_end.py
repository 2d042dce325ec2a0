"""Every `megarl bench` that had no end-to-end run in the suite, run as a user runs it, at its
smallest size (a tiny Llama with SmolLM2's tokenizer, two steps, a few prompts), so that a broken
benchmark fails here: `bench e2e` had ended in a KeyError since the held-out evaluation before
training added a step-0 row, and nothing noticed. Each prints one JSON object whose measured
figures and limits are checked for shape and sense, not for speed (speed targets are the
benchmarks' own business). `bench refit`, `memory` and `mfu` run end to end in
test_weight_sync.py, test_plan.py and test_bench_mfu.py. About 4 minutes in all on 2 cores."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

# the smallest run of the demo recipe: 2 prompts x 4 samples of 16 tokens
SMALL = ["rollout.max_tokens=16", "data.prompts_per_step=2", "rollout.n=4"]
HELD_OUT = ("eval.sets=[{name: held, source: 'reasoning_gym:chain_sum', size: 4, seed: 100000, "
            "instruction: '{question}', max_prompt_len: 128}]")


@pytest.fixture(scope="module")
def policy(tiny_policy) -> Path:
    return tiny_policy


@pytest.fixture(scope="module")
def bench(cli):
    def run(*args: str, target_exit: bool = False) -> dict:
        """The benchmark's JSON report. ``target_exit``: it exits 1 when a row misses its target (at
        this size, expected), which is its verdict, not a failure to run."""
        proc = cli("bench", *args, "--json", timeout=600, env={**os.environ, "RAY_ADDRESS": ""})
        assert proc.returncode in ((0, 1) if target_exit else (0,)), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    return run


def _models(policy: Path) -> list[str]:
    return [f"actor.model.path={policy}", f"reference.model.path={policy}"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_e2e_against_trl_with_the_evaluation_before_training(policy, tmp_path, bench):
    report = bench("e2e", "--steps", "2", "--out", str(tmp_path), *_models(policy), *SMALL, HELD_OUT)
    (round_,) = report["rounds"]
    for side in ("megarl", "trl"):
        assert round_[side]["timed_steps"] == 1 and _positive(round_[side]["tokens_per_s"])
    assert report["target"] == 1.5 and _positive(report["ratio"])
    assert report["ratio"] == pytest.approx(report["pooled"]["megarl"]["tokens_per_s"]
                                            / report["pooled"]["trl"]["tokens_per_s"])
    start = report["startup"]  # measured on both sides, imports included (megarl's: time/startup_s + its driver's)
    assert _positive(start["megarl_s"]) and _positive(start["trl_s"]) and start["target"] == 2.0
    assert start["megarl_s"] == round_["megarl"]["startup_s"] and start["trl_s"] == round_["trl"]["startup_s"]


def test_async_rollout_against_lockstep(policy, tmp_path, bench):
    report = bench("async", "--staleness", "0,1", "--no-shared", "--steps", "2", "--out", str(tmp_path),
                    *_models(policy), *SMALL, HELD_OUT)
    assert report["speedup_target"] == 1.5 and _positive(report["speedup"])
    assert report["accuracy_points_limit"] == 5.0 and math.isfinite(report["accuracy_points_lost"])


def test_episodes_overlap_against_lockstep(policy, bench):
    report = bench("episodes", "--prompts", "2", "--rounds", "1", *_models(policy), "rollout.max_tokens=16",
                    "rollout.n=2", "rollout.max_model_len=512", "data.max_prompt_len=256", "env.max_episode_tokens=400",
                    "eval.sets=[]")
    for schedule in ("overlap", "lockstep"):
        assert _positive(report[schedule]["tokens_per_s"]) and report[schedule]["turns_mean"] >= 1
    speedup = report["speedup"]
    assert speedup["target"] == 1.0 and speedup["measured/target"] == pytest.approx(speedup["measured"])
    assert speedup["measured"] == pytest.approx(report["overlap"]["tokens_per_s"] / report["lockstep"]["tokens_per_s"])


def test_scaling_of_the_step_and_the_sync(tmp_path, bench):
    """The suite's one real run of `bench scaling` (tests/test_bench_scaling.py checks its arithmetic
    by hand): a tiny model (head_dim 32 for vLLM) at 1 and 2 ranks in every default mode, and the
    weight sync into one vLLM engine at both rank counts."""
    from megarl_bench.scaling import format_tables

    report = bench("scaling", "--ranks", "1,2", "--modes", "dp-strong,dp-weak,tp-strong", "--hidden", "64",
                   "--layers", "2", "--heads", "2", "--vocab", "256", "--seq-len", "16", "--micro-batch", "1",
                   "--warmup", "1", "--repeats", "2", "--out", str(tmp_path))
    assert set(report["train"]) == {"dp-strong", "dp-weak", "tp-strong"}
    for mode, rows in report["train"].items():  # (JSON: the rank counts keyed as strings)
        assert [r["ranks"] for r in rows] == [1, 2], mode
        for r in rows:
            assert 0 < r["seconds"] < 60 and math.isfinite(r["efficiency"]), (mode, r)
        assert set(report["step_seconds"][mode]) == {"1", "2"} and len(report["step_seconds"][mode]["2"]) == 2
    assert [r["work"] for r in report["train"]["dp-weak"]] == [16, 32]  # 1 sequence of 16 tokens per rank
    assert [r["work"] for r in report["train"]["dp-strong"]] == [32, 32]
    assert report["threads_per_rank"]["2"] >= 1
    # the same bytes synced from tp 1 and tp 2, each once (bytes ratio 1), in a finite time
    assert [r["ranks"] for r in report["sync"]] == [1, 2]
    assert len({r["bytes"] for r in report["sync"]}) == 1 and all(r["bytes_ratio"] == 1.0 for r in report["sync"])
    assert all(_positive(r["sync_seconds"]) and _positive(r["raw_seconds"]) for r in report["sync"])
    assert "training step, tp-strong" in format_tables(report)
    assert json.loads((tmp_path / "scaling.json").read_text())["train"] == report["train"]
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vocab_parallel_logprob_memory(bench):
    # a 4096-token vocabulary is too small for the quarter-of-naive target at tp 1: exit 1, as it should
    report = bench("logprob", "--vocab", "4096", "--tp", "1,2", "--batch", "1", "--seq", "64", target_exit=True)
    assert report["target_ratio"] == 0.25
    assert {r["tp"] for r in report["rows"]} == {1, 2}
    assert all(r["megarl_max_abs_diff"] < 1e-4 and _positive(r["megarl_ratio"]) for r in report["rows"])
