"""The RL loop: generate, score, estimate advantages, update, sync. One screen."""

from __future__ import annotations

import time

import torch

from megarl.config.schema import RunConfig
from megarl.trainer.advantages import estimate, needs_old_logprobs
from megarl.trainer.run import Run, step_metrics
from megarl.workers.rl_fns import train_policy, train_value


def train(cfg: RunConfig) -> list[dict]:
    with Run(cfg).build() as run:  # on the way out, every process of the run is stopped
        start = run.resume()
        log = run.logger(resume_step=start)
        actor, reference, critic = run.roles["actor"], run.roles.get("reference"), run.roles.get("critic")
        for run.step in range(start + 1, cfg.trainer.steps + 1):
            began = time.perf_counter()
            with run.phase("rollout"):
                batch, texts = run.generate()
            with run.phase("reward"):
                scores, parts = run.score(batch, texts)
            with run.phase("reference"):
                ref = reference.logprobs(batch) if reference else None
            with run.phase("actor_logprobs"):  # on-policy, the update's own forward gives them
                old = actor.logprobs(batch, entropy=True) if needs_old_logprobs(cfg.algorithm) else None
            with run.phase("critic_values"):
                values = critic.values(batch) if critic else None
            with run.phase("advantages"):
                est = estimate(cfg.algorithm, scores, batch.mask, batch.group_size, old, ref, values)
            with run.phase("actor_update"):
                metrics, fresh = actor.train(train_policy, policy_batch(batch, est, old, ref, cfg), cfg.algorithm)
                old = old or fresh
            if critic:
                with run.phase("critic_update"):
                    metrics |= critic.train(train_value, value_batch(batch, est, values, cfg), cfg.algorithm)[0]
            with run.phase("weight_sync"):
                verified = run.update_weights(batch)
            metrics |= step_metrics(batch, scores, parts, old, ref, est, cfg.algorithm) | verified
            metrics |= timing(run, batch, time.perf_counter() - began)
            log.log(run.step, metrics)
            if cfg.trainer.save_every and run.step % cfg.trainer.save_every == 0 and run.step < cfg.trainer.steps:
                run.save()
        run.save()
        plots = log.close()
        print(f"done: {cfg.trainer.steps} steps; metrics in {log.path}; plots: {', '.join(map(str, plots))}")
        return log.history()


def policy_batch(batch, est, old, ref, cfg) -> dict:
    out = {"tokens": batch.tokens, "seq_lens": batch.seq_lens, "mask": est["mask"], "advantages": est["advantages"],
           "temperature": batch.temperature,
           **denominators(est["mask"], cfg, cfg.actor.parallel.data_parallel_size)}
    if old is not None:
        out["old_logprobs"] = old["logprobs"]
    else:  # on-policy: the update returns log-probs and entropy at every response token, for the metrics
        out["select_mask"] = batch.mask
    if ref is not None:
        out["ref_logprobs"] = ref
    if cfg.algorithm.off_policy_correction != "none":
        out["rollout_logprobs"] = batch.rollout_logprobs
    return out


def value_batch(batch, est, values, cfg) -> dict:
    return {"tokens": batch.tokens, "seq_lens": batch.seq_lens, "mask": est["mask"], "old_values": values,
            "returns": est["returns"],
            **denominators(est["mask"], cfg, cfg.critic.parallel.data_parallel_size)}


def denominators(mask: torch.Tensor, cfg: RunConfig, dp: int) -> dict:
    """The loss normalisers the ranks pass to ``aggregate``: ``denoms``, each minibatch's global
    normaliser (its response tokens for "token-mean", else its sequences with a response token),
    and ``norm_len``, the constant per-sequence divisor of "seq-mean-token-sum" (Dr.GRPO: the
    generation budget ``rollout.max_tokens``; None for the other modes, which do not use it).
    Ranks split the batch over data-parallel shards first, then each shard into minibatches:
    minibatch m is the m-th slice of every shard."""
    aggregation = cfg.algorithm.aggregation
    minibatches = cfg.algorithm.minibatches
    out = []
    for m in range(minibatches):
        part = torch.cat([shard.chunk(minibatches)[m] for shard in mask.chunk(dp)]) != 0
        count = part.sum() if aggregation == "token-mean" else part.any(dim=1).sum()
        out.append(max(float(count), 1.0))
    norm_len = float(cfg.rollout.max_tokens) if aggregation == "seq-mean-token-sum" else None
    return {"denoms": out, "norm_len": norm_len}


def timing(run: Run, batch, step_seconds: float) -> dict[str, float]:
    generated = float(batch.response_lens.sum())
    out = {f"time/{name}_s": seconds for name, seconds in run.phase_times.items()}
    out["time/step_s"] = step_seconds
    out["throughput/tokens_per_s"] = generated / step_seconds
    out["throughput/generation_tokens_per_s"] = generated / max(run.phase_times.get("rollout", 0.0), 1e-9)
    if run.colocated_roles():
        out["memory/offloaded_mib"] = run.offloaded_bytes / 2**20
        run.offloaded_bytes = 0
    return out
