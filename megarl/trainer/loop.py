"""The RL loop: generate, score, estimate advantages, update, sync. One screen.

Colocated, the device changes hands at the ``device.*`` steps (``megarl.trainer.colocation``);
disaggregated, those steps do nothing. The rollout service (its own Ray actor,
``megarl.rollout_driver.service``) generates and scores the batches; with
``trainer.max_staleness: k > 0`` it has the engines generate the next k while this one trains;
``trainer.schedule: opportunistic`` has the weight sync interrupt them rather than wait.
"""

from __future__ import annotations

import time
from dataclasses import replace

from megarl.algorithms import get_algorithm
from megarl.algorithms.base import ScoredBatch
from megarl.algorithms.distill import teacher_metrics
from megarl.config.schema import RunConfig
from megarl.trainer.engine_faults import waiting_on_engines
from megarl.trainer.evaluation import final_table
from megarl.trainer.restarts import Restarts
from megarl.trainer.run import Run
from megarl.trainer.step_metrics import rollout_metrics, step_metrics, timing
from megarl.trainer.update_batches import policy_batch, value_batch
from megarl.workers.rl_fns import train_policy, train_value


def train(cfg: RunConfig) -> list[dict]:
    called = time.perf_counter()
    with Run(cfg).build() as run:  # on the way out, every process of the run is stopped
        start = run.resume()
        startup = {"time/startup_s": time.perf_counter() - called}  # to the first step (the evaluation apart)
        log = run.logger(resume_step=start)
        rollout, device = run.rollout, run.colocation  # the rollout service, the device's hand-overs
        actor, reference, critic = run.roles["actor"], run.roles.get("reference"), run.roles.get("critic")
        teacher = run.roles.get("teacher")  # on-policy distillation: scores the actor's samples
        algorithm = get_algorithm(cfg.algorithm.name)
        reward_model = run.roles.get("reward_model") if rollout.needs_reward_model else None  # else it seeds the critic
        if start == 0 and (before := run.evaluate()):  # the held-out sets before any update, as step 0
            log.log(0, before)
        restarts = Restarts(run, log)  # a Megatron rank that dies: the roles come back (trainer.max_restarts)
        while run.step < cfg.trainer.steps:
            with restarts.guard():  # on a rank's death: back to the last checkpoint or snapshot, run.step too
                run.step += 1
                began = time.perf_counter()
                algo = replace(cfg.algorithm, kl_coef=run.kl_control.value)  # adapted each step (kl_target)
                with run.phase("rollout"):
                    device.to_rollout()  # the Megatron roles leave the device to vLLM
                    # and batches up to step + k are on their way (an engine that fails with no other
                    # to take its calls is replaced meanwhile, and the batch asked of the replacement)
                    samples = waiting_on_engines(run, lambda: rollout.take(run.step))
                    device.to_training()  # vLLM sleeps, the roles come back
                batch = samples.batch
                with run.phase("reward"):
                    scores, parts = rollout.score(samples, reward_model.scores(batch) if reward_model else None)
                with run.phase("reference"):
                    ref = reference.logprobs(batch) if reference else None
                taught = None
                if teacher:  # its own phase only where there is one: no time/teacher_s otherwise
                    with run.phase("teacher"):
                        taught = teacher.logprobs(batch)
                warming = run.step <= cfg.trainer.critic_warmup  # the critic learns first, the actor waits
                with run.phase("actor_logprobs"):  # on-policy, the update's own forward gives them
                    needed = warming or algorithm.needs_old_logprobs(algo)
                    old = actor.logprobs(batch, entropy=True) if needed else None
                with run.phase("critic_values"):
                    values = critic.values(batch) if critic else None
                with run.phase("advantages"):
                    before = None if old is None else old.logprobs  # the actor's, for KL in the reward
                    turns = rollout.turn_rewards(samples, scores)  # per-turn credit (env.credit: turn), else None
                    scored = ScoredBatch(scores, batch.mask, batch.group_size, before, ref, values, turns, taught,
                                         episode_of=batch.episode_of)  # an episode's parts: rows sharing it
                    est = algorithm.estimate(algo, scored)
                metrics = {}
                if not warming:
                    with run.phase("actor_update"):
                        metrics, fresh = actor.train(train_policy, policy_batch(batch, est, old, ref, cfg), algo)
                        old = old or fresh
                metrics |= actor.routing_mismatch()  # R3: the routings its forwards replayed that differ
                if critic:
                    with run.phase("critic_update"):
                        metrics |= critic.train(train_value, value_batch(batch, est, values, cfg), algo)[0]
                restarts.after_update()  # colocated, the memory snapshot is copied while the roles hold the device
                with run.phase("rollout_wait"):  # the engines finish what they generate ahead (or stop it)
                    rollout.drain()
                with run.phase("weight_sync"):  # to_sync, sync, after_sync, verify, actor_off
                    verified = run.sync_weights(batch)
                    generating = run.generation_seconds()  # the engines' time in generate() this step
                metrics |= step_metrics(batch, scores, parts, old, ref, est, algo) | verified
                if taught is not None:  # on the samples' response tokens, before the update
                    metrics |= teacher_metrics(before, taught, batch.mask)
                if algo.kl_target is not None and "kl/mean" in metrics:  # the coefficient for the next step
                    metrics["kl/coef"] = run.kl_control.update(metrics["kl/mean"], n_steps=batch.size)
                offloaded = device.take_offloaded_bytes() if device.active else None
                metrics |= timing(run.phase_times, batch, time.perf_counter() - began, offloaded, generating,
                                  len(run.engines))
                metrics |= rollout_metrics(samples, run.step) | run.evaluate()  # eval: every eval.every steps, the last
                metrics, startup = metrics | startup, {}  # start-up: with this process's first step
                log.log(run.step, metrics | restarts.metrics())
                if cfg.trainer.save_every and run.step % cfg.trainer.save_every == 0 and run.step < cfg.trainer.steps:
                    run.save()
                restarts.after_step()  # this step's state is the restore point (its checkpoint, or a copy)
        run.release_inference()  # the engines and scoring roles are done: their memory is free to save in
        run.save()
        plots = log.close()
        print(f"done: {cfg.trainer.steps} steps; metrics in {log.path}; plots: {', '.join(map(str, plots))}")
        if table := final_table(log.history()):
            print(table)
        return log.history()
