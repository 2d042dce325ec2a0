"""Trainer faults restart in place (issue 42 item 3): `kill -9` of the actor's rank while step 3
trains, with ``trainer.max_restarts=1``. The run goes on by itself (the engines and the rollout
service survive, the roles come back) and finishes; its metrics equal a run that never failed,
bit for bit (exact schedule, rollout one version ahead so the queue's batches are restored too),
and every prompt trains once.

- ``snapshot: memory`` without checkpoints: the roles come back from the copy of step 2 in host memory;
- ``snapshot: none``: from the checkpoint of step 2.

The seconds from the kill to training again are printed for the note (``-s``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import Cli, build_tiny_policy
from length_reward import serve as serve_length_reward

from megarl.config.loader import load_config
from megarl.config.schema import RunConfig
from megarl.recipes import DEFAULT
from megarl.validation.checks import validate_run


@pytest.fixture(scope="module")
def policy(tmp_path_factory, smollm2) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "llama", smollm2)


@pytest.fixture(scope="module")
def reward_url():
    url, server = serve_length_reward()
    yield url
    server.shutdown()


def overrides(policy: Path, reward_url: str, out: Path) -> list[str]:
    """3 GRPO steps, rollout one weight version ahead, a checkpoint after step 2 (save_every 2)."""
    return [f"actor.model.path={policy}", f"reference.model.path={policy}", f"output_dir={out}",
            "trainer.steps=3", "trainer.save_every=2", "trainer.max_staleness=1", "trainer.verify_sync=every",
            "data.prompts_per_step=2", "data.size=16", "rollout.n=4", "rollout.max_tokens=12",
            "rollout.max_model_len=256", "data.max_prompt_len=128", "actor.micro_batch_size=4",
            "reference.micro_batch_size=8", "actor.optim.lr=1e-3", "algorithm.kl_coef=0.01",
            "algorithm.kl_target=0.001", "algorithm.kl_horizon=64",  # the KL coefficient is state to restore
            "trainer.tensorboard=false", "trainer.wandb=false", "trainer.collective_timeout_s=20",
            "rewards=[{kind: remote, url: '" + reward_url + "'}]", "eval.sets=[]"]


def _comparable(history: list[dict]) -> list[dict]:
    """What must repeat exactly: all but wall-clock times and the restart's own counters."""
    skip = ("time/", "throughput/", "memory/", "busy/", "trainer/")
    return [{k: v for k, v in h.items() if not k.startswith(skip)} for h in history]


@pytest.fixture(scope="module")
def straight(policy, reward_url, tmp_path_factory, starts_processes) -> list[dict]:
    """The run that never fails, in this process."""
    from megarl.trainer.loop import train

    cfg = load_config(RunConfig, DEFAULT, overrides(policy, reward_url, tmp_path_factory.mktemp("straight")))
    validate_run(cfg)
    return train(cfg)


def _killed_at_step_3(cli: Cli, run_dir: Path, settings: list[str]) -> tuple[list[dict], dict, str]:
    """`megarl train` with ``settings``, its actor rank SIGKILLed while step 3 updates: the run's
    metrics, its one restart's record and its output. Prints the seconds from the kill to training again."""
    proc = cli.popen("train", *settings, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     env={**os.environ, "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 400
        while True:
            with contextlib.suppress(OSError, ValueError):
                if json.loads((run_dir / "progress.json").read_text()) == {"step": 3, "phase": "actor_update"}:
                    break
            assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "step 3 not reached within 400 s"
            time.sleep(0.01)
        os.kill(json.loads((run_dir / "workers.json").read_text())["actor"][0], signal.SIGKILL)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    [restart] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    print(f"{settings[-1]}: training again {restart['training_again_at'] - killed_at:.1f} s after the kill "
          f"(restart itself {restart['restart_s']:.1f} s, lost {restart['lost_s']:.1f} s)")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return metrics, restart, output


@pytest.mark.parametrize("snapshot", ["memory", "none"])
def test_actor_rank_killed_in_step_3_restarts_in_place_and_repeats_the_straight_run(snapshot, policy, reward_url,
                                                                                    straight, tmp_path, cli):
    run_dir = tmp_path / "run"
    settings = [*overrides(policy, reward_url, run_dir), "trainer.max_restarts=1", f"trainer.snapshot={snapshot}"]
    if snapshot == "memory":  # no checkpoint to fall back on: the copy in memory is all there is
        settings.insert(-2, "trainer.save_every=0")
    metrics, restart, output = _killed_at_step_3(cli, run_dir, settings)
    assert restart["failed_step"] == 3 and restart["restored_step"] == 2, restart
    assert restart["from"] == ("the in-memory snapshot" if snapshot == "memory" else "the checkpoint step_000002")
    assert "'actor'" in restart["cause"] and "rank 0" in restart["cause"] and "process died" in restart["cause"]
    assert "trainer fault at step 3" in output
    assert [h["step"] for h in metrics] == [1, 2, 3]
    assert [h["trainer/restarts"] for h in metrics] == [0, 0, 1]
    assert metrics[2]["trainer/restart_s"] > 0 and metrics[2]["trainer/lost_s"] >= metrics[2]["trainer/restart_s"]
    assert [h["rollout/weight_version"] for h in metrics] == [0, 0, 1]  # batch 3 came from the queue's copy
    assert _comparable(metrics) == _comparable(straight)
    trained = [p for h in metrics for p in h["data/prompt_ids"]]
    assert len(set(trained)) == len(trained) == 6
    assert (run_dir / "checkpoints" / "step_000003" / "actor" / "megarl.json").is_file()


def rank_tensor(mib: int, raise_it: bool = False):
    """Run on a rank: a tensor big enough to live in Ray's shared object store, not inline."""
    import torch

    if raise_it:
        raise ValueError("raised on purpose")
    return torch.arange(mib * 2**18, dtype=torch.float32)


def test_results_kept_by_run_kept_outlive_the_rank_and_a_death_is_told_from_an_error(ray_session):
    """What a memory snapshot relies on: a result left in the object store by ``run_kept`` is still
    readable once its rank's process is SIGKILLed; a rank that raises fails the call with
    ``died`` empty (no restart would help), a killed one with its rank in ``died``."""
    import ray
    import torch

    from megarl.workers.group import WorkerGroup, WorkerGroupError

    group = WorkerGroup("kept", 1, pythonpath=[str(Path(__file__).parent)])
    try:
        with pytest.raises(WorkerGroupError, match="raised on purpose") as raised:
            group.run_kept(rank_tensor, mib=1, raise_it=True)
        assert raised.value.died == [] and not group.alive
    finally:
        group.shutdown()
    group = WorkerGroup("kept", 1, pythonpath=[str(Path(__file__).parent)])
    try:
        [kept] = group.run_kept(rank_tensor, mib=4)
        os.kill(group.pids[0], signal.SIGKILL)
        with pytest.raises(WorkerGroupError, match="process died") as died:
            group.run(rank_tensor, mib=1, timeout_s=60)
        assert died.value.died == [0]
        assert torch.equal(ray.get(kept), torch.arange(2**20, dtype=torch.float32))
    finally:
        group.shutdown()


def test_restarts_in_place_are_refused_for_colocated_runs_before_start():
    from megarl.config.loader import ConfigError

    cfg = load_config(RunConfig, DEFAULT, ["rollout.colocate_with=actor", "trainer.max_restarts=1"])
    with pytest.raises(ConfigError, match=r"trainer.max_restarts=1: restarting the roles in place is not supported "
                                          r"for colocated runs"):
        validate_run(cfg)
