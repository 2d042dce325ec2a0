"""Checks of a role's memory savers: activation recompute and optimizer CPU offload.

Kept in a module of their own so the rules for these fields sit in one place; every
message names the dotted field, as the other checks do.
"""

from __future__ import annotations

from megarl.config.schema import RECOMPUTE_MODULES, RoleConfig
from megarl.models.hf_arch import ModelArch


def stage_layers(arch: ModelArch, role: RoleConfig) -> int:
    """Transformer layers on the fullest pipeline stage (per model chunk under vpp)."""
    par = role.parallel
    if par.pp == 1:
        return arch.num_layers
    ends = [n for n in (par.first_stage_layers, par.last_stage_layers) if n is not None]
    middle = par.pp - len(ends)
    rest = (arch.num_layers - sum(ends)) // middle if middle else 0
    most = max(ends + [rest])
    return most // par.vpp if par.vpp else most


def memory_saver_errors(arch: ModelArch, role: RoleConfig, name: str) -> list[str]:
    errors: list[str] = []
    rc, where = role.recompute, f"{name}.recompute"
    if rc.granularity == "full":
        layers = stage_layers(arch, role)
        if not 1 <= rc.num_layers <= layers:
            errors.append(f"{where}.num_layers={rc.num_layers} must be between 1 and the {layers} layers of a "
                          "pipeline stage")
        elif rc.method == "uniform" and layers % rc.num_layers:
            # megatron-core's uniform method steps through the layers in units of num_layers
            errors.append(f"{where}.num_layers={rc.num_layers} must divide the {layers} layers of a pipeline stage "
                          "(method uniform)")
    if rc.granularity == "selective":
        unknown = [m for m in rc.modules if m not in RECOMPUTE_MODULES]
        if unknown or not rc.modules:
            errors.append(f"{where}.modules={rc.modules} must be a non-empty subset of {', '.join(RECOMPUTE_MODULES)}")
        if not arch.is_moe and any(m in ("moe", "moe_act", "shared_experts") for m in rc.modules):
            errors.append(f"{where}.modules: {', '.join(rc.modules)} names MoE modules of a dense model")
        if "moe_act" in rc.modules:  # megatron-core: only with grouped GEMM, which megarl does not use
            errors.append(f"{where}.modules: moe_act needs grouped GEMM experts; use moe")
    opt = role.optim
    if opt.cpu_offload:
        if not role.optim.use_distributed_optimizer:
            errors.append(f"{name}.optim.cpu_offload needs {name}.optim.use_distributed_optimizer: true "
                          "(megatron-core offloads the distributed optimizer's shards)")
        if not 0.0 < opt.offload_fraction <= 1.0:
            errors.append(f"{name}.optim.offload_fraction={opt.offload_fraction} must be in (0, 1]")
    return errors
