"""A rollout fleet that survives an engine's fault (issue 42 items 1, 2 and 4), through `megarl train`.

One 6-step run with two engines under the exact schedule: kill -9 of engine 0's vLLM core while
step 3 generates. Its calls go to engine 1, a new engine starts on engine 0's placement bundle,
takes the actor's weights at step 3's weight sync (its log-probs checked against the actor's, by
vLLM's own scoring) and serves again from step 4. Then SIGSTOP of engine 1's core while step 5
generates (a hang: the process lives, nothing it serves moves): no restarts are left
(rollout.max_engine_restarts=1), so it is dropped and the run goes on with one engine
(rollout.min_engines=1). The run finishes all 6 steps and trains every prompt of the dataset's
first 6 batches once, in order. Its engines run vLLM's core as a process of its own
(rollout.engine_core=process, the GPU layout); the two runs below keep CPU's default, the core
inside the engine's process, so a kill of that process is the engine's death.

One 5-step run under the opportunistic schedule with episodes generated ahead and continued
across syncs: kill -9 of engine 0's process while step 3's episodes are in the middle of their turns.
The episodes it held start over from their reset on engine 1 (an episode trains whole or not at
all), and every prompt trains once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import cli_train_run, read_metrics, wait_for_phase
from length_reward import serve as serve_length_reward


@pytest.fixture(scope="module")
def policy(tiny_policy) -> Path:
    return tiny_policy


@pytest.fixture(scope="module")
def reward_url():
    url, server = serve_length_reward()
    yield url
    server.shutdown()


def _overrides(policy: Path, reward_url: str, out: Path, engine_core: str = "process") -> list[str]:
    return [f"actor.model.path={policy}", "reference=null", f"output_dir={out}", "trainer.steps=8",
            "trainer.save_every=0", "trainer.verify_sync=first", "rollout.engines=2", "data.prompts_per_step=2",
            "data.size=32", "rollout.n=4", "rollout.max_tokens=12", "rollout.max_model_len=256",
            "data.max_prompt_len=128", "actor.micro_batch_size=8", "actor.optim.lr=1e-3", "algorithm.kl_coef=0",
            "trainer.tensorboard=false", "trainer.wandb=false", "trainer.collective_timeout_s=20", "eval.sets=[]",
            "rewards=[{kind: remote, url: '" + reward_url + "'}]",
            # process: vLLM's engine core in a process of its own, as on GPU; inline: in the engine's
            # own process (CPU's default), whose death is the engine actor's
            f"rollout.engine_core={engine_core}"]


def _engine_pid(run_dir: Path, engine: int, title: str | None) -> int:
    """Engine ``engine``'s vLLM process titled ``title``; None: the engine's own process (its Ray actor)."""
    table = json.loads((run_dir / "engines.json").read_text())
    if title is None:
        return table[engine]["pid"]
    return next(p["pid"] for p in table[engine]["processes"] if p["title"].startswith(title))


def test_an_engine_killed_mid_rollout_is_replaced_and_every_prompt_trains_once(policy, reward_url, tmp_path, cli):
    from megarl.config.loader import load_config
    from megarl.config.schema import RunConfig
    from megarl.data.prompts import prompt_dataset
    from megarl.recipes import DEFAULT

    run_dir = tmp_path / "fleet"
    overrides = [*_overrides(policy, reward_url, run_dir), "trainer.steps=6", "rollout.max_engine_restarts=1"]
    with cli_train_run(cli, overrides) as proc:
        wait_for_phase(run_dir, proc, 3, "rollout")
        killed = _engine_pid(run_dir, 0, "VLLM::EngineCore")
        os.kill(killed, signal.SIGKILL)
        wait_for_phase(run_dir, proc, 5, "rollout")
        stopped = _engine_pid(run_dir, 1, "VLLM::EngineCore")
        os.kill(stopped, signal.SIGSTOP)
        output, _ = proc.communicate(timeout=420)
    assert proc.returncode == 0, output[-4000:]
    history = read_metrics(run_dir)
    assert [h["step"] for h in history] == list(range(1, 7))
    # the replacement took step 3's weights, checked against the actor's, and served from step 4
    seen = f"fleet: rollout engine 0: vLLM's process VLLM::EngineCore (pid {killed}) died; its work goes"
    assert any(line.startswith(seen) for line in output.splitlines()), output[-3000:]
    [back] = [line for line in output.splitlines() if "rollout engine 0 holds weight version" in line]
    assert "version 3," in back and "serves again from step 4" in back, back
    took = float(re.search(r"\(([\d.]+) s after its fault\)", back).group(1))
    print(f"engine 0 (SIGKILL of its core at step 3): serving again {took:.1f} s after the watchdog saw the fault")
    h = history[2]
    assert h["sync/max_abs_logprob_diff"] <= 1e-3, h  # verify_sync=first, yet run for the new engine
    assert h["fleet/engine_restarts"] == 1 and h["fleet/fault_s"] == pytest.approx(took, abs=0.1)
    assert h["fleet/redispatched"] >= 1, "the fault found no call to send elsewhere: nothing was tested"
    # the hang, with no restarts left: dropped
    dropped = (f"fleet: rollout engine 1: vLLM's process VLLM::EngineCore (pid {stopped}) is stopped (hung); no "
               f"restarts left (rollout.max_engine_restarts=1): the run goes on with 1 engine")
    assert dropped in output.splitlines(), output[-3000:]
    assert history[4]["fleet/redispatched"] > history[2]["fleet/redispatched"], \
        "the hang held no call to send elsewhere: nothing was tested"
    # verify_sync=first: step 1, and the syncs that changed the fleet
    assert [h["step"] for h in history if "sync/max_abs_logprob_diff" in h] == [1, 3, 5]
    assert [h["fleet/engines_alive"] for h in history] == [2.0] * 4 + [1.0] * 2
    assert [h["fleet/engines_dropped"] for h in history] == [0.0] * 4 + [1.0] * 2
    assert history[-1]["fleet/engine_restarts"] == 1
    # every prompt of the dataset's first 6 batches trained once, in order: none lost, none twice
    cfg = load_config(RunConfig, DEFAULT, overrides)
    dataset = prompt_dataset(cfg.data)
    assert [h["data/prompt_ids"] for h in history] == [dataset.next_ids() for _ in range(6)]
    # the one engine left is engine 0's replacement
    [left] = json.loads((run_dir / "engines.json").read_text())
    assert {p["pid"] for p in left["processes"]}.isdisjoint({killed, stopped})


def test_an_episode_on_a_killed_engine_starts_over_elsewhere_and_trains_whole(policy, reward_url, tmp_path, cli):
    from megarl.config.loader import load_config
    from megarl.config.schema import RunConfig
    from megarl.data.prompts import prompt_dataset
    from megarl.recipes import DEFAULT

    run_dir = tmp_path / "episodes"
    # one batch ahead, continued across syncs; two sequences at a time, answers up to 96 tokens: the
    # kill finds episodes in the middle of their turn
    overrides = [*_overrides(policy, reward_url, run_dir, "inline"), "trainer.steps=5",
                 "trainer.schedule=opportunistic", "trainer.max_staleness=1", "rollout.partial=continue",
                 "env={kind: single_turn}", "rollout.max_tokens=96", "rollout.max_num_seqs=2"]
    with cli_train_run(cli, overrides) as proc:
        wait_for_phase(run_dir, proc, 3, "rollout")
        os.kill(_engine_pid(run_dir, 0, None), signal.SIGKILL)  # the engine, its core inside it
        output, _ = proc.communicate(timeout=420)
    assert proc.returncode == 0, output[-4000:]
    history = read_metrics(run_dir)
    assert [h["step"] for h in history] == list(range(1, 6))
    lost = [h.get("rollout/lost_episodes", 0) for h in history]
    print(f"episodes started over after the kill, per step: {lost}")
    assert sum(lost) > 0, "the kill cut no episode: nothing was tested"
    assert history[-1]["fleet/engine_restarts"] == 1
    assert any("rollout engine 0 holds weight version 3" in line for line in output.splitlines()), output[-3000:]
    assert all(h["reward/env"] == h["reward/mean"] for h in history)  # the environment scored whole episodes
    cfg = load_config(RunConfig, DEFAULT, overrides)
    dataset = prompt_dataset(cfg.data)
    assert [h["data/prompt_ids"] for h in history] == [dataset.next_ids() for _ in range(5)]


def test_a_colocated_engine_and_actor_rank_that_die_come_back_in_the_hand_over_order(policy, reward_url, tmp_path,
                                                                                      cli):
    """Colocated, one engine (no other to take its calls): kill -9 of its vLLM core while step 2
    generates. The batch's calls wait in the rollout service; the driver starts a replacement at
    once with the actor off the device, puts it to sleep, brings the actor back, syncs the weights
    the engine held (version 1), checks it, and the calls are asked of it: step 2's prompts train
    once. Then kill -9 of actor rank 0 while step 4 updates: the roles restart in place from the
    memory snapshot with vLLM asleep, and the run finishes all 5 steps."""
    from megarl.config.loader import load_config
    from megarl.config.schema import RunConfig
    from megarl.data.prompts import prompt_dataset
    from megarl.recipes import DEFAULT

    run_dir = tmp_path / "colocated"
    overrides = [*_overrides(policy, reward_url, run_dir, "inline"), "trainer.steps=5", "rollout.engines=1",
                 "rollout.colocate_with=actor", "trainer.max_restarts=1", "trainer.snapshot=memory"]
    with cli_train_run(cli, overrides) as proc:
        wait_for_phase(run_dir, proc, 2, "rollout")
        killed = _engine_pid(run_dir, 0, None)  # the engine, its core inside it
        os.kill(killed, signal.SIGKILL)
        wait_for_phase(run_dir, proc, 4, "actor_update")
        os.kill(json.loads((run_dir / "workers.json").read_text())["actor"][0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    lines = output.splitlines()
    seen = "fleet: rollout engine 0: its process died (killed, crashed or out of memory); its work waits"
    assert any(line.startswith(seen) for line in lines), output[-3000:]
    [back] = [line for line in lines if "rollout engine 0 holds weight version" in line]
    assert "version 1," in back and "serves again from step 2" in back, back
    took = float(re.search(r"\(([\d.]+) s after its fault\)", back).group(1))
    print(f"colocated engine (SIGKILL of its process at step 2): serving again {took:.1f} s after the watchdog saw "
          f"the fault")
    [restart] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert (restart["failed_step"], restart["restored_step"], restart["from"]) == (4, 3, "the in-memory snapshot")
    history = read_metrics(run_dir)
    assert [h["step"] for h in history] == list(range(1, 6))
    h = history[1]
    assert h["sync/max_abs_logprob_diff"] <= 1e-3, h  # the replacement's check (verify_sync=first)
    assert h["fleet/fault_s"] == pytest.approx(took, abs=0.1) and h["fleet/redispatched"] == 1
    assert [h["fleet/engine_restarts"] for h in history] == [0, 1, 1, 1, 1]
    assert [h["fleet/engines_alive"] for h in history] == [1.0] * 5
    assert [h["trainer/restarts"] for h in history] == [0, 0, 0, 1, 1]
    assert [h["rollout/weight_version"] for h in history] == [0, 1, 2, 3, 4]  # the batch re-asked kept its version
    # every prompt of the dataset's first 5 batches trained once, in order: none lost, none twice
    dataset = prompt_dataset(load_config(RunConfig, DEFAULT, overrides).data)
    assert [h["data/prompt_ids"] for h in history] == [dataset.next_ids() for _ in range(5)]


def test_a_straggler_is_asked_again_elsewhere_and_the_late_answer_dropped(smollm2_engine):
    """rollout.request_timeout_s: a call with no answer in time is asked again of another engine,
    once; the first answer is kept. The one shared engine stands under two indexes here, so the
    call asked again waits behind the straggler, whose answer comes first: the second is the late
    one, dropped. The answer kept is vLLM's own for the request (the same seed asked directly)."""
    import ray

    from megarl.rollout.sampling import SamplingConfig
    from megarl.rollout_driver.fleet import EngineFleet

    fleet = EngineFleet([smollm2_engine, smollm2_engine], request_timeout_s=0.2)
    sampling = SamplingConfig(temperature=1.0, max_tokens=64, n=2, seed=5)
    prompts = [[1, 9038, 2683, 314, 260, 1345]]
    calls = fleet.submit_shares([prompts, []], lambda engine, part: engine.generate.remote(part, sampling))
    [[answer]] = fleet.wait(calls, timeout_s=120)  # one call, one prompt
    assert fleet.counters() == {"redispatched": 1, "stragglers": 1}
    assert (calls[0].engine, calls[0].straggler.engine) == (1, 0)
    ray.get(calls[0].ref, timeout=120)  # the late answer came too, and was not used
    [direct] = ray.get(smollm2_engine.generate.remote(prompts, sampling), timeout=120)
    assert [s.response_ids for s in answer] == [s.response_ids for s in direct]
    assert sum(len(s.response_ids) for s in answer) > 10  # long enough to be late at 0.2 s


# ---------------------------------------------------------------- the pieces that need no engine

def test_what_a_run_does_with_an_engine_fault():
    from megarl.config.loader import load_config
    from megarl.config.schema import RunConfig
    from megarl.recipes import DEFAULT
    from megarl.rollout_driver.engine_restarts import backoff_s, decide, unsupported

    assert decide(restarts_used=0, max_restarts=2, live_after=1, min_engines=1) == "restart"
    assert decide(restarts_used=2, max_restarts=2, live_after=1, min_engines=1) == "drop"  # fewer engines
    assert decide(restarts_used=2, max_restarts=2, live_after=1, min_engines=2) == "end"  # too few
    assert decide(restarts_used=0, max_restarts=0, live_after=3, min_engines=4) == "end"
    # with no engine left to finish the batch in flight the run ends, as it did before (one engine)
    assert decide(restarts_used=0, max_restarts=2, live_after=0, min_engines=1) == "end"
    # unless it can wait for a replacement started at once (trainer.max_staleness=0), while restarts are left
    assert decide(restarts_used=0, max_restarts=2, live_after=0, min_engines=1, replace_now=True) == "restart"
    assert decide(restarts_used=2, max_restarts=2, live_after=0, min_engines=1, replace_now=True) == "end"
    assert [backoff_s(n) for n in (1, 2, 3, 7)] == [1.0, 2.0, 4.0, 30.0]
    # colocated runs ride through a fault; group-streamed ones end, saying why
    assert unsupported(load_config(RunConfig, DEFAULT, ["rollout.colocate_with=actor"])) is None
    why = unsupported(load_config(RunConfig, DEFAULT, ["rollout.granularity=group"]))
    assert why.startswith("rollout.granularity=group streams each group to an engine outside the fleet's re-dispatch")


def test_a_stopped_process_counts_as_hung(subprocesses):
    from megarl.utils import process_watch

    child = subprocesses.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watched = [p for p in process_watch.descendants() if p.pid == child.pid]
        assert process_watch.deaths(watched) == []
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.3)
        [hung] = process_watch.deaths(watched)
        assert (hung.pid, hung.how) == (child.pid, "stopped")
        assert hung.describe().endswith(f"(pid {child.pid}) is stopped (hung)")
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.3)
        assert process_watch.deaths(watched) == []
    finally:
        child.kill()
        child.wait()
