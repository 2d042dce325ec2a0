"""Checks of each role (actor, critic, reference, reward model): its model and weights, parallel
layout, precision, MoE routing and micro-batching; every message names the dotted field."""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.roles import VALUE_HEAD_ROLES
from megarl.config.schema import (
    MoeConfig,
    PrecisionConfig,
    RoleConfig,
    RunConfig,
)
from megarl.models.hf_arch import ArchError, ModelArch
from megarl.models.layout import parallel_errors
from megarl.platform import Platform


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


def precision_errors(prec: PrecisionConfig, where: str, platform: Platform) -> list[str]:
    errors = []
    if prec.fp8 is not None:
        if not platform.supports_fp8():
            errors.append(f"{where}.fp8={prec.fp8!r} needs a GPU with Transformer Engine "
                          f"(this platform: {platform.name}, transformer_engine="
                          f"{'yes' if platform.has_transformer_engine else 'no'})")
        if prec.dtype != "bfloat16":
            errors.append(f"{where}.fp8 needs {where}.dtype=bfloat16 (FP8 GEMMs run under BF16 training)")
    if prec.fp8 is not None and prec.fp8_recipe == "mxfp8" and (cc := platform.compute_capability()) \
            and cc < (10, 0):
        # MXFP8 block scales are a Blackwell (SM100) format: Transformer Engine raises at the first
        # FP8 forward on a Hopper
        errors.append(f"{where}.fp8_recipe='mxfp8' needs a Blackwell GPU (compute capability 10.0 or newer); "
                      f"this one is {cc[0]}.{cc[1]}: use delayed, tensorwise or blockwise")
    return errors


def moe_errors(moe: MoeConfig, arch: ModelArch, where: str) -> list[str]:
    """A role's MoE routing settings: only for a MoE model, each value in range, and a
    load-balancing loss with its weight (megatron-core would train a named loss at weight 0)."""
    if moe.is_default:
        return []
    if not arch.is_moe:
        return [f"{where} is set but the model is dense (no experts to route to)"]
    errors = []
    if (moe.load_balancing == "none") != (moe.aux_loss_coeff == 0):
        errors.append(f"{where}.load_balancing={moe.load_balancing!r} and {where}.aux_loss_coeff="
                      f"{moe.aux_loss_coeff} go together: a load-balancing loss needs a weight > 0, "
                      "and a weight needs a loss")
    if moe.aux_loss_coeff < 0:
        errors.append(f"{where}.aux_loss_coeff must be >= 0")
    if moe.z_loss_coeff is not None and moe.z_loss_coeff <= 0:
        errors.append(f"{where}.z_loss_coeff must be > 0 (or null for none)")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        errors.append(f"{where}.capacity_factor must be > 0 (or null: no token dropping)")
    if moe.pad_to_capacity and moe.capacity_factor is None:
        errors.append(f"{where}.pad_to_capacity needs {where}.capacity_factor")
    if moe.routing_replay and where != "actor.moe":
        errors.append(f"{where}.routing_replay is the actor's: it replays the routes the rollout engine took "
                      "for the actor's samples")
    if moe.routing_replay and moe.capacity_factor is not None:
        errors.append(f"{where}.routing_replay sends every token to the experts vLLM chose, and vLLM drops "
                      f"none: leave {where}.capacity_factor unset")
    return errors


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
