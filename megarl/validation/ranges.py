"""Range checks: sizes, counts, rates and probabilities outside their domain, found from the config
alone (no model or data is read), so they run first and alone."""

from __future__ import annotations

import math

from megarl.config.schema import RunConfig
from megarl.data.prompts import instruction_problem
from megarl.validation.env_checks import env_ranges, env_setting_errors
from megarl.validation.eval_checks import eval_ranges, eval_setting_errors

GROUP_ROUNDS = 8  # rollout.n may be this many times rollout.max_num_seqs at most


def out_of_range(field: str, value: float | None, interval: str) -> str | None:
    """'field=value must be ...' when ``value`` is not a finite number in ``interval`` ('(0, 1]', '[1, inf)')."""
    if value is None:
        return None
    low_text, high_text = (part.strip() for part in interval[1:-1].split(","))
    low, high = float(low_text), float(high_text)
    low_open, high_open = interval[0] == "(", interval[-1] == ")"
    inside = (math.isfinite(value) and (low < value if low_open else low <= value)
              and (value < high if high_open else value <= high))
    if inside:
        return None
    if not math.isinf(high):
        wanted = f"in {interval}"
    elif math.isinf(low):
        wanted = "a finite number"
    else:
        wanted = ("a finite number " if not math.isfinite(value) else "") + f"{'>' if low_open else '>='} {low_text}"
    return f"{field}={value} must be {wanted}"


def range_errors(cfg: RunConfig) -> list[str]:
    """Sizes, counts, rates and probabilities outside their domain; no model is read."""
    checks: list[tuple[str, float | None, str]] = []
    for name, role in cfg.roles().items():
        par, opt = role.parallel, role.optim
        checks += [
            (f"{name}.parallel.world_size", par.world_size, "[1, inf)"),
            (f"{name}.parallel.dp", par.dp, "[1, inf)"),
            (f"{name}.micro_batch_size", role.micro_batch_size, "[1, inf)"),
            (f"{name}.cpus_per_rank", role.cpus_per_rank, "(0, inf)"),
            (f"{name}.gpus_per_rank", role.gpus_per_rank, "(0, inf)"),
            (f"{name}.precision.fp8_amax_history_len", role.precision.fp8_amax_history_len, "[1, inf)"),
            (f"{name}.optim.lr", opt.lr, "(0, inf)"),
            (f"{name}.optim.weight_decay", opt.weight_decay, "[0, inf)"),
            (f"{name}.optim.adam_beta1", opt.adam_beta1, "[0, 1)"),
            (f"{name}.optim.adam_beta2", opt.adam_beta2, "[0, 1)"),
            (f"{name}.optim.adam_eps", opt.adam_eps, "(0, inf)"),
            (f"{name}.optim.clip_grad", opt.clip_grad, "[0, inf)"),
            (f"{name}.optim.warmup_steps", opt.warmup_steps, "[0, inf)"),
        ]
    r, data, algo, tr = cfg.rollout, cfg.data, cfg.algorithm, cfg.trainer
    checks += [
        ("rollout.tp", r.tp, "[1, inf)"),
        ("rollout.engines", r.engines, "[1, inf)"),
        ("rollout.max_model_len", r.max_model_len, "[1, inf)"),
        ("rollout.max_num_seqs", r.max_num_seqs, "[1, inf)"),
        ("rollout.kv_cache_gib", r.kv_cache_gib, "[1, inf)"),
        ("rollout.gpu_memory_utilization", r.gpu_memory_utilization, "(0, 1]"),
        # 0 would be greedy decoding: the n samples of a group would all be the same
        ("rollout.temperature", r.temperature, "(0, inf)"),
        ("rollout.top_p", r.top_p, "(0, 1]"),
        ("rollout.top_k", r.top_k, "[-1, inf)"),
        ("rollout.max_tokens", r.max_tokens, "[1, inf)"),
        ("rollout.n", r.n, "[1, inf)"),
        ("data.size", data.size, "[1, inf)"),
        ("data.prompts_per_step", data.prompts_per_step, "[1, inf)"),
        ("data.max_prompt_len", data.max_prompt_len, "[1, inf)"),
        ("algorithm.kl_coef", algo.kl_coef, "[0, inf)"),
        ("algorithm.kl_target", algo.kl_target, "(0, inf)"),
        ("algorithm.kl_horizon", algo.kl_horizon, "[1, inf)"),
        ("algorithm.clip_low", algo.clip_low, "[0, 1)"),  # the ratio's lower bound 1 - clip_low stays > 0
        ("algorithm.clip_high", algo.clip_high, "[0, inf)"),
        ("algorithm.dual_clip", algo.dual_clip, "(1, inf)"),  # the dual bound c > 1 (Ye et al. 2020)
        ("algorithm.is_cap", algo.is_cap, "[1, inf)"),  # a truncated IS weight still reaches 1
        ("algorithm.is_floor", algo.is_floor, "(0, 1]"),  # ... and so does one bounded below
        ("algorithm.is_low", algo.is_low, "(0, 1]"),  # [is_low, is_high] holds ratio 1: on-policy is kept
        ("algorithm.is_high", algo.is_high, "[1, inf)"),
        ("algorithm.sapo_tau_pos", algo.sapo_tau_pos, "(0, inf)"),  # the gate's temperature: 4 / tau
        ("algorithm.sapo_tau_neg", algo.sapo_tau_neg, "(0, inf)"),
        ("algorithm.cov_fraction", algo.cov_fraction, "(0, 1]"),
        ("algorithm.clip_cov_low", algo.clip_cov_low, "(-inf, inf)"),
        ("algorithm.clip_cov_high", algo.clip_cov_high, "(-inf, inf)"),
        ("algorithm.kl_cov_coef", algo.kl_cov_coef, "(0, inf)"),
        ("algorithm.entropy_coef", algo.entropy_coef, "[0, inf)"),  # a bonus; negative would punish exploring
        ("algorithm.gamma", algo.gamma, "[0, 1]"),
        ("algorithm.lam", algo.lam, "[0, 1]"),
        ("algorithm.value_clip", algo.value_clip, "(0, inf)"),
        ("algorithm.ppo_epochs", algo.ppo_epochs, "[1, inf)"),
        ("algorithm.minibatches", algo.minibatches, "[1, inf)"),
        ("algorithm.overlong_buffer", algo.overlong_buffer, "[0, inf)"),
        ("algorithm.overlong_penalty", algo.overlong_penalty, "[0, inf)"),
        ("trainer.steps", tr.steps, "[1, inf)"),
        ("trainer.save_every", tr.save_every, "[0, inf)"),
        ("trainer.verify_tolerance", tr.verify_tolerance, "(0, inf)"),
        ("trainer.verify_mult_error", tr.verify_mult_error, "(1, inf)"),
        ("trainer.bucket_mib", tr.bucket_mib, "(0, inf)"),
        ("trainer.step_timeout_s", tr.step_timeout_s, "(0, inf)"),
        ("trainer.collective_timeout_s", tr.collective_timeout_s, "(0, inf)"),
        ("trainer.watchdog_interval_s", tr.watchdog_interval_s, "(0, inf)"),
        ("trainer.max_staleness", tr.max_staleness, "[0, inf)"),
        ("trainer.critic_warmup", tr.critic_warmup, "[0, inf)"),
        ("trainer.max_restarts", tr.max_restarts, "[0, inf)"),
        ("rollout.max_engine_restarts", r.max_engine_restarts, "[0, inf)"),
        ("rollout.min_engines", r.min_engines, "[1, inf)"),
        ("rollout.request_timeout_s", r.request_timeout_s, "(0, inf)"),
    ]
    for i, term in enumerate(cfg.rewards):
        checks += [
            (f"rewards[{i}].weight", term.weight, "(-inf, inf)"),
            (f"rewards[{i}].timeout_s", term.timeout_s, "(0, inf)"),
            (f"rewards[{i}].max_retries", term.max_retries, "[0, inf)"),
            (f"rewards[{i}].max_concurrency", term.max_concurrency, "[1, inf)"),
        ]
    checks += eval_ranges(cfg) + env_ranges(cfg)
    errors = [problem for field, value, interval in checks if (problem := out_of_range(field, value, interval))]
    errors += eval_setting_errors(cfg) + env_setting_errors(cfg)
    if data.source.startswith("reasoning_gym:") and data.size >= 1 and data.prompts_per_step > data.size:
        errors.append(f"data.prompts_per_step={data.prompts_per_step} is more than the data.size={data.size} "
                      "prompts generated")
    # A prompt's samples are generated on one engine (its prefix cache holds the prompt once); a
    # group larger than a few of its batches serialises there while the other engines idle.
    if r.n > GROUP_ROUNDS * r.max_num_seqs >= 1:
        errors.append(f"rollout.n={r.n}: a prompt's samples are generated together on one engine, which batches "
                      f"at most rollout.max_num_seqs={r.max_num_seqs} sequences ({GROUP_ROUNDS} rounds of it: "
                      f"{GROUP_ROUNDS * r.max_num_seqs}); lower n or raise max_num_seqs")
    if r.min_engines > r.engines >= 1:
        errors.append(f"rollout.min_engines={r.min_engines} is more than the run's rollout.engines={r.engines}")
    if problem := instruction_problem("data.instruction", data.source, data.instruction):
        errors.append(problem)
    return errors
