"""The RL loop end to end on CPU: Megatron roles and vLLM rollout under Ray.

Tiny models carry SmolLM2's tokenizer and chat template (so prompts, decoding and
rewards are real), with vLLM's smallest CPU-friendly shape (head_dim 32).

- GRPO (the actor packing sequences, the reference on a token budget), 4 steps
  straight vs one run with rollout one weight version ahead (trainer.max_staleness=1)
  whose actor's worker gets `kill -9` twice: in step 3 it restarts in place (trainer.max_restarts=1),
  in step 4 no restart is left and the run ends within 60 s naming role, rank and phase; resumed,
  its metrics equal the run ahead's bit for bit (fp32 on CPU), the prompts trained on included.
  The fail-fast cases below resume in lockstep (max_staleness=0) and repeat the lockstep straight run.
- Opportunistic rollout (k=1, each weight sync interrupting generation ahead): kill -9 of vLLM's
  engine core while a step trains ends the run naming it; resumed, every prompt is trained once.
- The same run colocated (actor, reference and vLLM on shared bundles, offloading
  and sleeping in turn) repeats the disaggregated one bit for bit.
- PPO with critic, reward model and reference, each its own placement group, the
  actor at tp=2.
- On-policy distillation (algorithm.name=opd): a teacher role scores the actor's samples,
  rollout one version ahead in multi-turn episodes; the student's reverse KL to it falls.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SMOLLM2_VOCAB as VOCAB
from conftest import Cli, cli_train_run, read_metrics, wait_for_phase, with_smollm2_tokenizer
from length_reward import serve as serve_length_reward

from megarl.config.loader import load_config
from megarl.config.schema import RunConfig
from megarl.recipes import DEFAULT
from megarl.validation.checks import validate_run


@pytest.fixture(scope="module")
def policy(tiny_policy) -> Path:
    return tiny_policy


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, smollm2) -> Path:
    import torch
    import transformers
    from conftest import tiny_config

    torch.manual_seed(3)
    config = tiny_config("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=VOCAB,
                         num_labels=1, pad_token_id=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.LlamaForSequenceClassification(config).float().eval()
    path = tmp_path_factory.mktemp("reward") / "llama-reward"
    model.save_pretrained(path)
    return with_smollm2_tokenizer(path, smollm2)


@pytest.fixture(scope="module")
def reward_url():
    url, server = serve_length_reward()
    yield url
    server.shutdown()


def grpo_overrides(policy: Path, reward_url: str, out: Path, steps: int) -> list[str]:
    return [f"actor.model.path={policy}", f"reference.model.path={policy}", f"output_dir={out}",
            f"trainer.steps={steps}", "trainer.save_every=2", "trainer.verify_sync=every",
            "data.prompts_per_step=2", "data.size=16", "rollout.n=4", "rollout.max_tokens=12",
            "rollout.max_model_len=256", "data.max_prompt_len=128", "actor.micro_batch_size=4",
            "reference.micro_batch_size=8", "actor.optim.lr=1e-3", "algorithm.kl_coef=0.01",
            # the adaptive KL controller: its coefficient moves every step and is in the checkpoints
            "algorithm.kl_target=0.001", "algorithm.kl_horizon=64",
            # padding removed: the actor packs sequences into rows of <= 256 tokens; the reference
            # keeps one copy of each prompt for its 4 samples, in rows of the same budget
            "actor.pack_sequences=true", "actor.max_tokens_per_microbatch=256",
            "reference.max_tokens_per_microbatch=256", "reference.share_prompt=true",
            "trainer.tensorboard=false", "trainer.wandb=false", "trainer.collective_timeout_s=20",
            "rewards=[{kind: remote, url: '" + reward_url + "'}]",
            # 16 held-out questions after the last step: the evaluation repeats across resumes too
            "eval.before_training=false", "eval.sets=[{name: held, source: 'reasoning_gym:chain_sum', size: 16, "
            "seed: 100000, instruction: '{question}', max_prompt_len: 128}]"]


def _ended_by(proc: subprocess.Popen, kill: Callable[[], None]) -> tuple[str, float]:
    """Calls ``kill`` and waits (90 s at most) for the run to end: its output, and the seconds it took."""
    kill()
    killed_at = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run did not end within 90 s of the kill:\n{proc.communicate()[0][-4000:]}")
    return output, time.monotonic() - killed_at


def _config(overrides: list[str], recipe: str | Path = DEFAULT) -> RunConfig:
    cfg = load_config(RunConfig, recipe, overrides)
    validate_run(cfg)
    return cfg


def _comparable(history: list[dict], *also_skip: str) -> list[dict]:
    """Metrics that must repeat exactly: everything except wall-clock times (and ``also_skip``)."""
    skip = ("time/", "throughput/", "memory/", "busy/", *also_skip)
    return [{k: v for k, v in h.items() if not k.startswith(skip)} for h in history]


@pytest.fixture(scope="module")
def straight_run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("straight")


@pytest.fixture(scope="module")
def straight(policy, reward_url, straight_run_dir, starts_processes) -> list[dict]:
    """4 GRPO steps, disaggregated: the run the others must repeat (its output in ``straight_run_dir``)."""
    from megarl.trainer.loop import train

    return train(_config(grpo_overrides(policy, reward_url, straight_run_dir, steps=4)))


ONE_AHEAD = ["trainer.max_staleness=1"]
# ... and interrupted by each weight sync (partial rollouts); longer answers than the other runs',
# so generation ahead is still going when a sync comes
OPPORTUNISTIC = [*ONE_AHEAD, "trainer.schedule=opportunistic", "rollout.max_tokens=96"]


@pytest.fixture(scope="module")
def ahead(policy, reward_url, tmp_path_factory, starts_processes) -> list[dict]:
    """The straight run, rollout one weight version ahead: what a killed-and-resumed run and a run
    restarted in place must repeat."""
    from megarl.trainer.loop import train

    return train(_config([*grpo_overrides(policy, reward_url, tmp_path_factory.mktemp("ahead"), steps=4), *ONE_AHEAD]))


def _actor_pid(run_dir: Path) -> int:
    return json.loads((run_dir / "workers.json").read_text())["actor"][0]


def test_kill_mid_step_restarts_in_place_then_fails_fast_and_resume_repeats_the_straight_run(
        policy, reward_url, straight, ahead, tmp_path, cli):
    """One run in its own process, one version ahead (trainer.max_staleness=1), serves three checks
    (one start-up instead of two runs' each). Issue 42 item 3: with trainer.max_restarts=1 and
    snapshot none its actor rank, SIGKILLed while step 3 updates, comes back from the checkpoint of
    step 2 by itself (the engines and the rollout service survive) and step 3 equals the run that
    never failed bit for bit. Killed again while step 4 updates, no restart is left: the run ends
    within 60 s naming role, rank and phase. At max_staleness=1 the checkpoint of step 2 holds batch
    3, generated by version 1 while step 2 trained; the resumed run trains on it, not on a
    regenerated one, and repeats the straight run one version ahead. (The restart from a copy in
    host memory, run to the end, is the test below.)"""
    from megarl.trainer.loop import train

    assert [h["step"] for h in straight] == [1, 2, 3, 4]
    assert any(h["reward/mean"] != straight[0]["reward/mean"] for h in straight), "rewards never changed"
    assert straight[0]["sync/max_abs_logprob_diff"] <= 1e-3
    coefs = [h["kl/coef"] for h in straight]  # kl/mean > 0.001 pushes it up, by at most 0.2 * 8 / 64
    assert len(set(coefs)) == 4 and all(0.01 * 0.975**4 <= c <= 0.01 * 1.025**4 for c in coefs), coefs
    assert all(math.isfinite(v) for h in straight for v in h.values() if not isinstance(v, list))
    assert [h["rollout/staleness"] for h in ahead] == [0, 1, 1, 1]
    assert [h["rollout/weight_version"] for h in ahead] == [0, 0, 1, 2]
    # the same prompts, in the same order, as in lockstep; step 1 is the same step
    assert [h["data/prompt_ids"] for h in ahead] == [h["data/prompt_ids"] for h in straight]
    # step 1 is the same step: the same samples, rewards and weights. Its update may differ in the
    # last bits: rollout ahead gives each rank one CPU thread (both sides compute at once), lockstep
    # all the cores, and the float reductions follow the thread count.
    first_ahead, first_straight = _comparable(ahead)[0], _comparable(straight)[0]
    assert first_ahead.keys() == first_straight.keys()
    for key, value in first_straight.items():
        if isinstance(value, float):
            assert first_ahead[key] == pytest.approx(value, rel=1e-6, abs=1e-5), key
        else:
            assert first_ahead[key] == value, key
    assert straight[-1]["eval/held/prompts"] == 16 and "eval/held/accuracy" not in straight[-2]
    assert _comparable(ahead)[1] != _comparable(straight)[1], "batch 2 came from other weights"

    run_dir = tmp_path / "killed"
    settings = [*grpo_overrides(policy, reward_url, run_dir, steps=4), *ONE_AHEAD, "trainer.max_restarts=1",
                "trainer.snapshot=none"]
    with cli_train_run(cli, settings) as proc:
        wait_for_phase(run_dir, proc, 3, "actor_update")
        os.kill(_actor_pid(run_dir), signal.SIGKILL)
        killed_at = time.time()
        wait_for_phase(run_dir, proc, 4, "actor_update")  # restarted: workers.json names the new ranks
        output, took = _ended_by(proc, lambda: os.kill(_actor_pid(run_dir), signal.SIGKILL))

    # the restart in place, from the checkpoint of step 2
    _restarted_in_step_3_from(run_dir, output, killed_at, "none", "the checkpoint step_000002")
    restarted = read_metrics(run_dir)  # step 4 never finished: the second kill came in it
    assert [h["step"] for h in restarted] == [1, 2, 3]
    assert [h["trainer/restarts"] for h in restarted] == [0, 0, 1]
    assert restarted[2]["trainer/restart_s"] > 0 and restarted[2]["trainer/lost_s"] >= restarted[2]["trainer/restart_s"]
    assert [h["rollout/weight_version"] for h in restarted] == [0, 0, 1]  # batch 3 came from the checkpoint's copy
    assert _comparable(restarted, "trainer/") == _comparable(ahead, "trainer/")[:3]
    trained = [p for h in restarted for p in h["data/prompt_ids"]]
    assert len(set(trained)) == len(trained) == 6

    # the second death, no restart left: the run ends on its own within 60 s, naming role, rank and phase
    assert proc.returncode == 1, output[-3000:]
    assert took < 60, f"the run took {took:.0f} s to end after the kill"
    failure = [line for line in output.splitlines() if "megarl train: failed" in line]
    assert failure, output[-3000:]
    assert "'actor'" in failure[0] and "rank 0" in failure[0] and "phase" in failure[0], failure[0]
    assert "process died" in output

    # Resume to step 4 from the checkpoint of step 2: the metrics file reads as one run.
    assert (run_dir / "checkpoints" / "step_000002" / "rollout_buffer.safetensors").is_file()
    assert not (run_dir / "checkpoints" / "step_000004").exists()
    resumed = train(_config([*grpo_overrides(policy, reward_url, run_dir, steps=4), *ONE_AHEAD]))
    assert [h["step"] for h in read_metrics(run_dir)] == [1, 2, 3, 4]
    # (steps 1-2 are the first run's rows, with its trainer/restarts count; the resumed run has none)
    assert _comparable(resumed, "trainer/") == _comparable(ahead, "trainer/")
    assert not any(k.startswith("trainer/") for h in resumed[2:] for k in h)
    trained = [p for h in resumed for p in h["data/prompt_ids"]]  # none skipped, none twice
    assert sorted(trained) == sorted(p for h in ahead for p in h["data/prompt_ids"])
    assert len(set(trained)) == len(trained)
    assert (run_dir / "checkpoints" / "step_000004" / "actor" / "megarl.json").is_file()
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["eval_accuracy.png", "kl.png",
                                                                     "response_length.png", "reward.png"]


def test_actor_rank_killed_in_step_3_restarts_in_place_and_repeats_the_run(policy, reward_url, ahead, tmp_path,
                                                                          cli):
    """Issue 42 item 3: with trainer.max_restarts=1 the run whose actor rank is SIGKILLed while step
    3 updates goes on by itself (the engines and the rollout service survive, the roles come back)
    and equals the run that never failed bit for bit, every prompt trained once: snapshot memory,
    without checkpoints, from the copy of step 2 in host memory. (snapshot none, from the checkpoint
    of step 2, is the kill-and-resume test above.) The seconds from the kill to training again are
    printed for the note (``-s``)."""
    run_dir = tmp_path / "run"
    # no checkpoint to fall back on: the copy in memory is all there is
    settings = [*grpo_overrides(policy, reward_url, run_dir, steps=4), *ONE_AHEAD, "trainer.max_restarts=1",
                "trainer.snapshot=memory", "trainer.save_every=0"]
    with cli_train_run(cli, settings) as proc:
        wait_for_phase(run_dir, proc, 3, "actor_update")
        os.kill(_actor_pid(run_dir), signal.SIGKILL)
        killed_at = time.time()
        output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-4000:]
    _restarted_in_step_3_from(run_dir, output, killed_at, "memory", "the in-memory snapshot")
    metrics = read_metrics(run_dir)
    assert [h["step"] for h in metrics] == [1, 2, 3, 4]
    assert [h["trainer/restarts"] for h in metrics] == [0, 0, 1, 1]
    assert metrics[2]["trainer/restart_s"] > 0 and metrics[2]["trainer/lost_s"] >= metrics[2]["trainer/restart_s"]
    assert [h["rollout/weight_version"] for h in metrics] == [0, 0, 1, 2]  # batch 3 came from the queue's copy
    assert _comparable(metrics, "trainer/") == _comparable(ahead, "trainer/")
    trained = [p for h in metrics for p in h["data/prompt_ids"]]
    assert len(set(trained)) == len(trained) == 8
    assert (run_dir / "checkpoints" / "step_000004" / "actor" / "megarl.json").is_file()


def _killed_in_step_3_then_resumed(cli: Cli, policy: Path, reward_url: str, run_dir: Path, overrides: list[str],
                                   killed_only: list[str]) -> tuple[list[dict], list[list[int]]]:
    """`megarl train` with ``overrides`` and ``killed_only``, its vLLM engine core SIGKILLed while
    step 3 trains: the run ends within 60 s naming the engine, its process and the phase, and
    leaves no process. Then the run resumed in this process with ``overrides`` alone, to step 4:
    the metrics of steps 1-4, and the prompt ids of the dataset's first four batches."""
    from megarl.data.prompts import prompt_dataset
    from megarl.trainer.loop import train

    marker = f"MEGARL_TEST_RUN={uuid.uuid4().hex}"
    with cli_train_run(cli, [*grpo_overrides(policy, reward_url, run_dir, steps=40), *overrides, *killed_only],
                  env=dict([marker.split("=")])) as proc:
        wait_for_phase(run_dir, proc, 3, "actor_update")
        # on CPU vLLM's engine core runs inside the engine's own process (rollout.engine_core: auto):
        # that process dies (the GPU layout, a core process of its own: test_a_dying_process_...)
        [engine] = [e for e in json.loads((run_dir / "engines.json").read_text()) if e["engine"] == 0]
        assert not engine["processes"], engine
        output, took = _ended_by(proc, lambda: os.kill(engine["pid"], signal.SIGKILL))
    assert proc.returncode == 1 and took < 60, (took, output[-3000:])
    [failure] = [line for line in output.splitlines() if "megarl train: failed" in line]
    # the tiny model's update may be over before the watchdog's next look: a phase after it is named then
    assert any(f"step 3, phase {p!r}" in failure for p in ("actor_update", "rollout_wait", "weight_sync")), failure
    assert "rollout engine 0: its process died" in failure, failure
    deadline = time.monotonic() + 30
    while (left := _marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"left running 30 s after the run ended: {left}"

    cfg = _config([*grpo_overrides(policy, reward_url, run_dir, steps=4), *overrides])
    train(cfg)
    history = read_metrics(run_dir)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    dataset = prompt_dataset(cfg.data)
    return history, [dataset.next_ids() for _ in range(4)]


def test_opportunistic_schedule_fails_fast_and_resumes_every_prompt_once(policy, reward_url, tmp_path, cli):
    """trainer.schedule=opportunistic at k=2: each weight sync interrupts the batches generating
    ahead instead of waiting for them, and their samples continue under the new weights (each
    token keeping its version). The first run streams groups (rollout.granularity=group, one group
    at a time on the engine, handed the next as one finishes); kill -9 of vLLM's engine core while
    step 3 trains ends it within 60 s naming the engine, its process and the phase, and leaves no
    process behind. Resumed from step 2's checkpoint (which holds batches 3 and 4 as far as they
    got) with whole batches per call (rollout.granularity=batch), the run trains on each prompt of
    the first four batches once, in order, every batch within the bound, and some samples span two
    versions (two batches ahead: the engine's queue holds more than a step's training lasts, so
    the first sync surely finds groups to interrupt)."""

    run_dir = tmp_path / "opportunistic"
    # no held-out evaluation: the resumed run would end with one (16 questions of up to 96 tokens)
    # that nothing here reads; test_kill_mid_step_... checks that it repeats across a resume
    two_ahead = [*OPPORTUNISTIC, "trainer.max_staleness=2", "eval.sets=[]"]
    history, expected = _killed_in_step_3_then_resumed(cli, policy, reward_url, run_dir, two_ahead,
                                                       ["rollout.granularity=group", "rollout.max_num_seqs=4"])
    assert [h["data/prompt_ids"] for h in history] == expected  # none skipped, none twice, in order
    assert all(0 <= h["rollout/staleness"] <= 2 for h in history)
    assert all(0 <= h["rollout/token_staleness_mean"] <= 2 for h in history[1:])
    spanning = [h.get("rollout/spanning_fraction") for h in history]
    print("spanning fractions:", spanning)
    assert any(f for f in spanning), spanning


def test_opportunistic_episodes_continue_and_resume_every_prompt_once(policy, reward_url, tmp_path, cli):
    """Multi-turn episodes (``env.kind: single_turn``, scored by the run's reward in the engine)
    under trainer.schedule=opportunistic at k=2 with rollout.partial=continue: each weight sync
    interrupts the batches generating ahead, and their unfinished episodes, suspended on their
    engine, go on from where they stopped under the new weights (a cut turn's tokens spanning
    versions). The first run streams groups (rollout.granularity=group: an interrupted group's
    unfinished episodes wait on the engine that ran them, the groups never sent stream again);
    kill -9 of vLLM's engine core while step 3 trains ends it. Resumed from step 2's checkpoint
    with whole batches per call (the batches ahead keep their finished episodes, the unfinished
    ones start over from their reset: environments' states are not checkpointed), the run trains
    on each prompt of the first four batches once, in order, within the bound. (``regenerate``, which drops cut
    episodes to start over, is tests/test_episodes.py's interrupt test: the engine's part is all
    that differs.)"""

    run_dir = tmp_path / "episodes"
    # two batches ahead (k = 2), and the engine decoding two sequences at a time (each answer is
    # 96 tokens long: a batch's 8 take longer than a step's training), so every sync finds
    # answers in the middle of their turn to cut (with all at once, or k = 1, the engine could
    # finish before the sync, or hold only answers not started yet)
    episodes = [*OPPORTUNISTIC, "trainer.max_staleness=2", "rollout.partial=continue", "env={kind: single_turn}",
                "rollout.max_num_seqs=2", "eval.sets=[]"]
    history, expected = _killed_in_step_3_then_resumed(cli, policy, reward_url, run_dir, episodes,
                                                       ["rollout.granularity=group", "env.max_concurrent_episodes=4"])
    assert [h["data/prompt_ids"] for h in history] == expected  # each once, in order
    assert all(0 <= h["rollout/staleness"] <= 2 for h in history)
    assert all(h["reward/env"] == h["reward/mean"] for h in history)  # the environment scored them
    interrupted = [h["rollout/interrupted_episodes"] for h in history]
    spanning = [h["rollout/spanning_fraction"] for h in history]
    print(f"episodes interrupted, per step: {interrupted}; spanning fractions: {spanning}")
    assert sum(interrupted) > 0, "no sync interrupted an episode: nothing was tested"
    assert any(f > 0 for f in spanning), spanning


def test_colocated_run_repeats_the_disaggregated_run(policy, reward_url, straight, tmp_path):
    """Actor, reference and vLLM on the same bundles: the Megatron roles leave the device while
    vLLM generates (their storage freed, kept on the host) and vLLM sleeps while they work,
    checkpoints included (save_every=2). Placement must not change a single number. Nor must the
    granularity: this run's engine holds one group at a time (max_num_seqs = n), is handed the
    next as one finishes and streams each back, and the rollout service scores it then
    (rollout.granularity=group); the straight run's engine returns whole batches."""
    from megarl.trainer.loop import train

    overrides = [*grpo_overrides(policy, reward_url, tmp_path / "colocated", steps=4),
                 "rollout.colocate_with=actor", "reference.colocate_with=actor", "rollout.granularity=group",
                 "rollout.max_num_seqs=4"]
    colocated = train(_config(overrides))
    assert _comparable(colocated) == _comparable(straight)
    # the groups did stream: the first came in before the last (the batch waits for the slowest)
    assert all(0 < h["time/rollout_first_group_s"] < h["time/rollout_last_group_s"] for h in colocated)
    assert not any("time/rollout_first_group_s" in h for h in straight)
    # every step moved at least the actor's and reference's weights (2 x ~26 MiB) off and back
    weights_mib = 2 * 4 * (VOCAB * 128 + 2 * (4 * 128 * 128 + 3 * 128 * 256)) / 2**20
    assert all(h["memory/offloaded_mib"] >= weights_mib for h in colocated), \
        [h["memory/offloaded_mib"] for h in colocated]
    assert (tmp_path / "colocated" / "checkpoints" / "step_000004" / "actor" / "megarl.json").is_file()


def _vllm_prompt_logprobs(model_dir: Path, text: str) -> tuple[list[int], list[float]]:
    """vLLM (fp32, in a Ray actor like the rollout engines) loads ``model_dir`` with its own
    tokenizer, tokenizes ``text`` and scores it: (token ids, log p(token_i | tokens_<i) for i >= 1)."""
    import ray

    from megarl.cluster.ray_env import ensure_ray

    @ray.remote(num_cpus=1)
    class Scorer:
        def __init__(self, path: str):
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the rollout engine sets it
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from vllm import LLM

            self.llm = LLM(model=path, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
                           max_num_seqs=2)

        def score(self, prompt: str) -> tuple[list[int], list[float]]:
            from vllm import SamplingParams

            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            out = self.llm.generate([prompt], params, use_tqdm=False)[0]
            ids = list(out.prompt_token_ids)
            return ids, [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]

    ensure_ray()
    scorer = Scorer.remote(str(model_dir))
    try:
        return ray.get(scorer.score.remote(text), timeout=600)
    finally:
        ray.kill(scorer)


def test_the_actor_checkpoint_exports_to_a_model_that_transformers_and_vllm_load(policy, straight, straight_run_dir,
                                                                                   tmp_path, pools, cli):
    """`megarl convert mcore-to-hf` of the run's last actor checkpoint: transformers and vLLM (with
    the exported tokenizer, not skipped) load it, and score text as the actor (megatron-core) does."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.config.schema import ParallelConfig
    from megarl.convert import jobs

    ckpt = straight_run_dir / "checkpoints" / "step_000004" / "actor"
    out = tmp_path / "exported"
    proc = cli("convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= set(modes), modes
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    trained, initial = load_file(out / "model.safetensors"), load_file(policy / "model.safetensors")
    assert not torch.equal(trained["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])

    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Answer with a number."}],
                                         tokenize=False, add_generation_prompt=True)
    ids, vllm_logprobs = _vllm_prompt_logprobs(out, text)
    assert ids == tokenizer(text)["input_ids"], "vLLM did not tokenize with the exported tokenizer"

    tokens = torch.tensor([ids])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hf = model(tokens).logits
    results = pools.get(1).run(jobs.checkpoint_logits, ckpt_dir=str(ckpt), parallel=ParallelConfig(), tokens=tokens)
    (actor,) = [r["logits"] for r in results if r["logits"] is not None]
    hf_logprobs = torch.log_softmax(hf[0].double(), -1)[:-1].gather(-1, tokens[0, 1:, None])[:, 0]
    dlogit = (hf - actor).abs().max().item()
    dlogprob = (hf_logprobs - torch.tensor(vllm_logprobs, dtype=torch.float64)).abs().max().item()
    print(f"export: max |dlogit| transformers vs actor {dlogit:.2e}; max |dlogprob| vLLM vs transformers "
          f"{dlogprob:.2e} over {len(ids)} tokens")
    assert dlogit <= 1e-4 and dlogprob <= 1e-4


def test_ppo_with_critic_reward_model_and_reference_disaggregated(policy, reward_model, tmp_path, starts_processes):
    """The actor starts from a megarl checkpoint (as after `megarl sft`): vLLM, which cannot read
    one, gets its weights by a sync before the first rollout, so step 1's samples are the actor's."""
    from megarl.cli.main import main
    from megarl.trainer.loop import train

    actor_ckpt = tmp_path / "actor-ckpt"
    assert main(["convert", "hf-to-mcore", "--hf", str(policy), "--out", str(actor_ckpt)]) == 0
    overrides = [
        f"actor.model.path={actor_ckpt}", f"reference.model.path={policy}", f"reward_model.model.path={reward_model}",
        f"output_dir={tmp_path / 'ppo'}", "actor.parallel.tp=2", "actor.parallel.world_size=2",
        "critic.parallel.tp=1", "reward_model.parallel.tp=1", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
        "algorithm.kl_in_reward=true", "algorithm.minibatches=2", "algorithm.ppo_epochs=2",
        "trainer.steps=2", "data.prompts_per_step=2", "data.size=8", "rollout.n=2", "rollout.max_tokens=12",
        "rollout.max_model_len=256", "data.max_prompt_len=128", "actor.micro_batch_size=1",
        "critic.micro_batch_size=1", "reference.micro_batch_size=4", "reward_model.micro_batch_size=4",
        "trainer.tensorboard=false", "trainer.wandb=false", "trainer.verify_sync=first",
        "rewards=[{kind: model, weight: 1.0}]", "eval.sets=[]", "trainer.critic_warmup=1",
    ]
    history = train(_config(overrides))
    assert [h["step"] for h in history] == [1, 2]
    # critic warmup: step 1 updates the critic only, step 2 both
    assert "actor/pg_loss" not in history[0] and "actor/pg_loss" in history[1]
    for h in history:
        assert all(math.isfinite(v) for v in h.values() if not isinstance(v, list)), h
        assert h["critic/value_loss"] > 0
        assert h["reward/model"] == h["reward/mean"]
    # the critic started from the reward model and learns: the value loss changes
    assert history[0]["critic/value_loss"] != history[1]["critic/value_loss"]
    assert history[0]["sync/max_abs_logprob_diff"] <= 1e-3
    # step 1 sampled from the actor's weights, not vLLM's start-up ones (random without HF weights)
    assert history[0]["mismatch/max_abs_logprob"] <= 1e-3, history[0]["mismatch/max_abs_logprob"]
    groups = json.loads((tmp_path / "ppo" / "workers.json").read_text())
    assert {name: len(pids) for name, pids in groups.items()} == {"actor": 2, "reference": 1, "critic": 1,
                                                                 "reward_model": 1, "rollout_service": 1}
    assert len({pid for pids in groups.values() for pid in pids}) == 6  # one process per rank and role


def test_on_policy_distillation_ahead_in_episodes(policy, reward_url, smollm2, tmp_path, starts_processes):
    """algorithm.name=opd with a teacher role of its own (the policy's weights moved by noise, SmolLM2's
    tokenizer), rollout one weight version ahead (trainer.max_staleness=1) in multi-turn episodes
    (env.kind: single_turn), no reference: the teacher scores the actor's samples each step and the
    student's reverse KL to it falls as it learns; the task reward is logged, not trained on."""
    from conftest import moved_copy

    from megarl.trainer.loop import train

    teacher = moved_copy(policy, tmp_path / "teacher", smollm2, seed=7, scale=0.1)  # reverse KL ~0.7 nats per token
    out = tmp_path / "opd"
    overrides = [f"actor.model.path={policy}", f"teacher.model.path={teacher}", "reference=null", f"output_dir={out}",
                 "algorithm.name=opd", "algorithm.kl_coef=0", "trainer.max_staleness=1", "env={kind: single_turn}",
                 "trainer.steps=4", "data.prompts_per_step=2", "data.size=16", "rollout.n=4", "rollout.max_tokens=12",
                 "rollout.max_model_len=256", "data.max_prompt_len=128", "actor.micro_batch_size=4",
                 "teacher.micro_batch_size=8", "actor.optim.lr=1e-3", "trainer.tensorboard=false",
                 "trainer.wandb=false", "trainer.collective_timeout_s=20", "eval.sets=[]",
                 "rewards=[{kind: remote, url: '" + reward_url + "'}]"]
    history = train(_config(overrides))
    assert [h["rollout/staleness"] for h in history] == [0, 1, 1, 1]
    kl = [h["distill/reverse_kl"] for h in history]
    print("reverse KL per token, by step:", kl)
    assert all(math.isfinite(v) for v in kl) and kl[0] > 0.3, kl  # the teacher is another model
    assert kl[-1] < 0.8 * kl[0], kl
    assert all(math.isfinite(h["actor/pg_loss"]) and h["time/teacher_s"] > 0 for h in history)
    groups = json.loads((out / "workers.json").read_text())
    assert {name: len(pids) for name, pids in groups.items()} == {"actor": 1, "teacher": 1, "rollout_service": 1}
    assert (out / "plots" / "reverse_kl.png").is_file()


# ---------------------------------------------------------------- processes that die mid-run

def _marked_processes(marker: str) -> list[str]:
    """Every process whose environment carries ``marker``: all that one run started (Ray's own
    daemons and agents, rank workers, vLLM's engine core and workers inherit the driver's
    environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:80]!r}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


# (the process to kill: a vLLM process of engine 0, the rollout service or the driver itself; the step
# and phase to kill it in; the phases the failure may name). The engine's death while rollout runs ahead is
# test_opportunistic_schedule_fails_fast_and_resumes_every_prompt_once. Resuming after a death
# is that test's and test_kill_mid_step_fails_fast_and_resume_repeats_the_straight_run's.
DEATHS = {
    "core-during-generate": ("VLLM::EngineCore", 1, "rollout", ("rollout",)),
    "worker-during-weight-sync": ("VLLM::Worker", 1, "weight_sync", ("weight_sync",)),
    "rollout-service-during-generate": ("rollout service", 1, "rollout", ("rollout",)),
    "sigterm-of-the-driver": ("driver", 1, "rollout", ()),
}


@pytest.mark.parametrize("case", list(DEATHS))
def test_a_dying_process_ends_the_run_and_leaves_nothing(case, policy, reward_url, tmp_path, cli):
    """kill -9 of vLLM's engine core or its worker, while the engine generates or receives weights
    (while it generates ahead: the opportunistic test above), or of the rollout service while it
    waits for a batch: the run ends within 60 s with one line naming the engine and the process,
    or the service, and the phase. SIGTERM of the driver (scancel,
    kill, Ctrl-C alike) ends it too. Either way every process the run started is gone within 30 s."""
    victim, step, phase, named_phases = DEATHS[case]
    run_dir = tmp_path / "run"
    marker = f"MEGARL_TEST_RUN={uuid.uuid4().hex}"
    # no reference model: the deaths are of other processes, and its group's start is a third of the run's
    overrides = [o for o in grpo_overrides(policy, reward_url, run_dir, steps=40)
                 if not o.startswith(("reference.", "algorithm.kl_"))] + ["reference=null", "algorithm.kl_coef=0"]
    if victim.startswith("VLLM::"):  # vLLM's own processes, as on GPU (on CPU the core is inline by default)
        overrides.append("rollout.engine_core=process")
    if case == "core-during-generate":  # no restarts: the engine's death ends the run (tests/test_fleet_survival.py)
        overrides.append("rollout.max_engine_restarts=0")
    if phase == "weight_sync":  # 64 KiB buckets: the sync of the 26 MiB model lasts long enough to hit
        overrides.append("trainer.bucket_mib=0.0625")
    with cli_train_run(cli, overrides, env=dict([marker.split("=")])) as proc:
        wait_for_phase(run_dir, proc, step, phase)
        if victim == "driver":
            output, took = _ended_by(proc, lambda: proc.send_signal(signal.SIGTERM))
        elif victim == "rollout service":
            [pid] = json.loads((run_dir / "workers.json").read_text())["rollout_service"]
            output, took = _ended_by(proc, lambda: os.kill(pid, signal.SIGKILL))
        else:
            engines = json.loads((run_dir / "engines.json").read_text())
            pid = next(p["pid"] for p in engines[0]["processes"] if p["title"].startswith(victim))
            output, took = _ended_by(proc, lambda: os.kill(pid, signal.SIGKILL))
    print(f"{case}: the run ended {took:.1f} s after the kill")
    assert took < 60, f"the run took {took:.0f} s to end after the kill"
    if victim == "driver":
        assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    else:
        assert proc.returncode == 1, output[-3000:]
        [failure] = [line for line in output.splitlines() if "megarl train: failed" in line]
        assert any(f"step {step}, phase {p!r}" in failure for p in named_phases), failure
        assert ("rollout engine 0" in failure and victim in failure) if victim.startswith("VLLM") else \
            f"the rollout service (pid {pid}): its process died" in failure, failure
        assert "\x1b" not in failure and "Traceback" not in failure
    deadline = time.monotonic() + 30
    while (left := _marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"left running 30 s after the run ended: {left}"


def _restarted_in_step_3_from(run_dir: Path, output: str, killed_at: float, snapshot: str, restored: str) -> None:
    """The one restart in place the run logged: the actor's rank 0 died in step 3, and training
    went on from step 2 restored from ``restored``."""
    [restart] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    print(f"snapshot {snapshot}: training again {restart['training_again_at'] - killed_at:.1f} s after the kill "
          f"(restart itself {restart['restart_s']:.1f} s, lost {restart['lost_s']:.1f} s)")
    assert restart["failed_step"] == 3 and restart["restored_step"] == 2, restart
    assert restart["from"] == restored
    assert "'actor'" in restart["cause"] and "rank 0" in restart["cause"] and "process died" in restart["cause"]
    assert "trainer fault at step 3" in output
