"""Checks that run before any process starts; every message names the dotted field."""

from __future__ import annotations

import math

from megarl.config.loader import ConfigError
from megarl.config.schema import DTYPES, FP8_FORMATS, FP8_RECIPES, ParallelConfig, PrecisionConfig, RunConfig
from megarl.config.validate_memory import memory_saver_errors
from megarl.models.hf_arch import ArchError, ModelArch
from megarl.platform import Platform, current_platform


def parallel_errors(arch: ModelArch, par: ParallelConfig, where: str) -> list[str]:
    """Layout problems of ``par`` for ``arch``; ``where`` prefixes field names (e.g. 'actor.parallel')."""
    errors = []
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(par, name) < 1:
            errors.append(f"{where}.{name}={getattr(par, name)} must be >= 1")
    if errors:
        return errors
    if arch.num_heads % par.tp:
        errors.append(f"{where}.tp={par.tp} does not divide num_attention_heads={arch.num_heads}")
    if arch.num_kv_heads % par.tp:
        errors.append(f"{where}.tp={par.tp} does not divide the query groups "
                      f"(num_key_value_heads={arch.num_kv_heads})")
    if arch.ffn_hidden_size % par.tp:
        errors.append(f"{where}.tp={par.tp} does not divide intermediate_size={arch.ffn_hidden_size}")
    errors += _pipeline_errors(arch, par, where)
    if par.sequence_parallel and par.tp == 1:
        errors.append(f"{where}.sequence_parallel=true needs tp > 1")
    if par.ep > 1 and not arch.is_moe:
        errors.append(f"{where}.ep={par.ep} needs a mixture-of-experts model ({arch.family} has none)")
    if arch.is_moe and arch.num_experts % par.ep:
        errors.append(f"{where}.ep={par.ep} does not divide num_local_experts={arch.num_experts}")
    ranks = par.ranks
    if ranks % par.model_parallel_size:
        errors.append(f"{where}.world_size={ranks} is not a multiple of tp*pp*cp="
                      f"{par.model_parallel_size}")
    elif par.dp is not None and par.world_size is not None and ranks != par.model_parallel_size * par.dp:
        errors.append(f"{where}.world_size={ranks} != tp*pp*cp*dp = "
                      f"{par.tp}*{par.pp}*{par.cp}*{par.dp}")
    if par.ep > 1 and (ranks // (par.tp * par.pp)) % par.ep:
        errors.append(f"{where}.ep={par.ep} does not divide the {ranks // (par.tp * par.pp)} "
                      "ranks of a pipeline stage's data-parallel x context-parallel group")
    return errors


def _pipeline_errors(arch: ModelArch, par: ParallelConfig, where: str) -> list[str]:
    layers, pp = arch.num_layers, par.pp
    first, last = par.first_stage_layers, par.last_stage_layers
    if (first is not None or last is not None) and pp == 1:
        return [f"{where}.first_stage_layers/last_stage_layers need pp > 1"]
    custom = [n for n in (first, last) if n is not None]
    remaining = layers - sum(custom)
    middle = pp - len(custom)
    # every stage needs layers: the middle stages exist exactly when layers remain for them
    if any(n < 1 for n in custom) or remaining < 0 or (middle == 0) != (remaining == 0):
        return [f"{where}: first_stage_layers={first}, last_stage_layers={last} do not fit "
                f"{layers} layers over pp={pp} stages"]
    if middle and remaining % middle:
        what = "num_hidden_layers" if not custom else "the layers left after the explicit split"
        return [f"{where}.pp={pp} does not divide {what} ({remaining}); "
                f"set {where}.first_stage_layers / last_stage_layers for an uneven split"]
    if par.vpp is not None:
        if pp < 2 or par.vpp < 2:
            return [f"{where}.vpp={par.vpp} needs pp > 1 and vpp > 1"]
        if custom:
            return [f"{where}.vpp with an explicit first/last stage split is not supported"]
        if (layers // pp) % par.vpp:
            return [f"{where}.vpp={par.vpp} does not divide the {layers // pp} layers per stage"]
    return []


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


def padded_vocab_size(vocab_size: int, pad_multiple: int, tp: int) -> int:
    multiple = math.lcm(pad_multiple, tp)
    return -(-vocab_size // multiple) * multiple


def validate_run(cfg: RunConfig, platform: Platform | None = None) -> dict[str, ModelArch]:
    """Checks every role; returns each role's architecture. Raises ConfigError listing all problems."""
    from megarl.convert.checkpoint import read_model_arch  # reads HF dirs and megarl checkpoints

    platform = platform or current_platform()
    errors: list[str] = []
    archs: dict[str, ModelArch] = {}
    for name, role in cfg.roles().items():
        if not role.model.path:
            errors.append(f"{name}.model.path is not set")
            continue
        try:
            arch = read_model_arch(role.model.path)
        except (ArchError, ConfigError, OSError) as e:
            if not role.model.arch:
                errors.append(f"{name}.model.path: {e}")
                continue
            arch = None
            path_error = e
        if role.model.arch:
            from megarl.plan.archs import load_arch  # ships architectures of models not on this machine

            try:
                declared = load_arch(role.model.arch)
            except (ArchError, OSError) as e:
                errors.append(f"{name}.model.arch: {e}" if arch is not None else
                              f"{name}.model.path: {path_error}; and {name}.model.arch: {e}")
                continue
            if arch is not None and arch.mismatches(declared):
                errors.append(f"{name}.model.arch={role.model.arch!r} does not match {name}.model.path: "
                              + "; ".join(arch.mismatches(declared)))
                continue
            arch = arch or declared
        archs[name] = arch
        errors += parallel_errors(arch, role.parallel, f"{name}.parallel")
        errors += precision_errors(role.precision, f"{name}.precision", platform)
        errors += batching_errors(cfg, name, arch, platform)
        errors += memory_saver_errors(arch, role, name)  # recompute, optimizer CPU offload
        if role.model.vocab_pad_multiple < 1:
            errors.append(f"{name}.model.vocab_pad_multiple must be >= 1")
    if "actor" in archs and not errors:  # the RL checks assume sane layouts (dp > 0)
        errors += rl_errors(cfg, archs["actor"])
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return archs


def rl_errors(cfg: RunConfig, actor: ModelArch) -> list[str]:
    """Algorithm, rewards, rollout, data and batch sizes that cannot run together."""
    from pathlib import Path

    from megarl.algorithms import AGGREGATION_MODES, KL_ESTIMATORS
    from megarl.cluster.placement import placement_errors
    from megarl.reshard.vllm_layout import vllm_padded_vocab
    from megarl.trainer.advantages import ALGORITHMS
    from megarl.trainer.rewards import REWARD_KINDS

    algo, rollout, data, errors = cfg.algorithm, cfg.rollout, cfg.data, []
    if algo.name not in ALGORITHMS:
        errors.append(f"algorithm.name={algo.name!r} must be one of {', '.join(ALGORITHMS)}")
    if algo.name == "ppo" and cfg.critic is None:
        errors.append("algorithm.name='ppo' needs a critic role (critic.model.path, or a reward_model to start from)")
    if algo.name in ("grpo", "rloo") and rollout.n < 2:
        errors.append(f"rollout.n={rollout.n}: {algo.name} compares samples of a prompt, it needs n >= 2")
    if algo.aggregation not in AGGREGATION_MODES:
        errors.append(f"algorithm.aggregation={algo.aggregation!r} must be one of {', '.join(AGGREGATION_MODES)}")
    if algo.kl_estimator not in KL_ESTIMATORS:
        errors.append(f"algorithm.kl_estimator={algo.kl_estimator!r} must be one of {', '.join(KL_ESTIMATORS)}")
    if algo.kl_coef > 0 and cfg.reference is None:
        errors.append(f"algorithm.kl_coef={algo.kl_coef} needs a reference role")
    for i, term in enumerate(cfg.rewards):
        if term.kind not in REWARD_KINDS:
            errors.append(f"rewards[{i}].kind={term.kind!r} must be one of {', '.join(REWARD_KINDS)}")
        if term.kind == "model" and cfg.reward_model is None:
            errors.append(f"rewards[{i}].kind='model' needs a reward_model role")
        if term.kind == "remote" and not term.url:
            errors.append(f"rewards[{i}].url is required for a remote reward")
    if not cfg.rewards:
        errors.append("rewards: at least one reward term is needed")
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
    if data.source.startswith("reasoning_gym:"):
        import reasoning_gym

        task = data.source.split(":", 1)[1]
        if task not in reasoning_gym.factory.DATASETS:
            errors.append(f"data.source: reasoning-gym has no task {task!r}")
    elif not Path(data.source).is_file():
        errors.append(f"data.source: {data.source} does not exist")
    if cfg.trainer.verify_sync not in ("first", "every", "never"):
        errors.append(f"trainer.verify_sync={cfg.trainer.verify_sync!r} must be first, every or never")
    if cfg.trainer.resume not in ("auto", "never"):
        errors.append(f"trainer.resume={cfg.trainer.resume!r} must be auto or never")
    return errors + placement_errors(cfg)
