"""A recipe's own layouts checked against a GPU: per-GPU memory of each group of GPUs.

GPUs are counted the way ``megarl.cluster.placement.place`` asks Ray for them: one
bundle per rank of each host role, holding the GPUs of every role placed on it
(``gpus_per_rank`` each, ``rollout.tp`` per engine). Roles whose GPUs on a bundle sum
to at most one share that GPU (their memory adds up); a rollout colocated with a
Megatron role time-shares with it (megarl offloads the Megatron roles while vLLM
generates), so that GPU's peak is the larger of the two phases.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megarl.config.schema import RunConfig
from megarl.models.hf_arch import ModelArch
from megarl.plan import steptime
from megarl.plan.hardware import GIB, Efficiency, GpuSpec
from megarl.plan.memory import (
    Layout,
    Memory,
    RolloutShape,
    Workload,
    inference_memory,
    stage_layer_counts,
    trained_memory,
    vllm_memory,
)
from megarl.plan.savers import Saver
from megarl.plan.search import SCORING, TRAINED, Plan, RolePlan, RolloutPlan, _forward_passes
from megarl.plan.steptime import RLShape


def recipe_gpus(cfg: RunConfig) -> int:
    """GPUs the recipe's placement groups ask for (whole GPUs per bundle)."""
    ranks = {name: role.parallel.ranks for name, role in cfg.roles().items()}
    ranks["rollout"] = cfg.rollout.engines
    demand = {name: role.gpus_per_rank for name, role in cfg.roles().items()}
    demand["rollout"] = float(cfg.rollout.tp)
    host_of = {name: role.colocate_with or name for name, role in cfg.roles().items()}
    host_of["rollout"] = cfg.rollout.colocate_with or "rollout"
    total = 0
    for host in set(host_of.values()):
        for i in range(ranks[host]):
            total += math.ceil(sum(demand[g] for g, h in host_of.items() if h == host and i < ranks[g]) - 1e-9)
    return total


def layout_of(role) -> Layout:
    par = role.parallel
    return Layout(tp=par.tp, pp=par.pp, dp=par.data_parallel_size, cp=par.cp, ep=par.ep, etp=par.etp, vpp=par.vpp,
                  sequence_parallel=par.sequence_parallel, first_stage_layers=par.first_stage_layers,
                  last_stage_layers=par.last_stage_layers)


def rl_shape(cfg: RunConfig) -> RLShape:
    return RLShape(algo=cfg.algorithm.name, prompts=cfg.data.prompts_per_step,
                   n=cfg.rollout.n, prompt_len=cfg.data.max_prompt_len, response_len=cfg.rollout.max_tokens,
                   ppo_epochs=cfg.algorithm.ppo_epochs, minibatches=cfg.algorithm.minibatches)


def evaluate_recipe(cfg: RunConfig, archs: dict[str, ModelArch], gpu: GpuSpec, eff: Efficiency | None = None,
                    attention: str = "flash") -> Plan:
    """The recipe's layouts as written (``archs``: each role's architecture, from run validation):
    memory per GPU group and the step-time estimate."""
    eff = eff or Efficiency()
    rl = rl_shape(cfg)
    roles: dict[str, RolePlan] = {}
    for name, role in cfg.roles().items():
        arch, layout = archs[name], layout_of(role)
        work = Workload(dtype=role.precision.dtype, micro_batch=role.micro_batch_size, seq_len=rl.seq_len,
                        attention=attention, distributed_optimizer=role.optim.use_distributed_optimizer)
        if name in TRAINED:
            rc = role.recompute
            saver = Saver(rc.granularity, rc.method, rc.num_layers,
                          role.optim.offload_fraction if role.optim.cpu_offload else 0.0)
            work = replace(saver.workload(work), recompute_modules=tuple(rc.modules),
                           lora_rank=role.lora.rank, lora_targets=tuple(role.lora.target_modules))
            micro = max(1, rl.sequences // (layout.dp * rl.minibatches * role.micro_batch_size))
            mem = trained_memory(arch, layout, work, micro, value_head=TRAINED[name])
            cost = saver.cost(max(stage_layer_counts(arch.num_layers, layout)))
            t = steptime.training_s(arch, layout, role.micro_batch_size, cost, rl, gpu, eff)
            roles[name] = RolePlan(name, layout, saver.describe(), mem, t, saver)
        else:
            mem = inference_memory(arch, layout, work, value_head=SCORING[name])
            t = steptime.forward_s(arch, layout.gpus, rl, gpu, eff)
            roles[name] = RolePlan(name, layout, "none", mem, t)
    r = cfg.rollout
    shape = RolloutShape(tp=r.tp, engines=r.engines, max_num_seqs=r.max_num_seqs, max_model_len=r.max_model_len,
                         gpu_memory_utilization=r.gpu_memory_utilization, dtype=r.dtype, weights=r.weights)
    vmem, needed = vllm_memory(archs["actor"], shape, gpu.memory_bytes)
    rollout = RolloutPlan(shape, vmem, needed, steptime.generation_s(archs["actor"], shape, rl, gpu, eff))

    overhead = Memory({"overhead": eff.overhead_gib * GIB})
    host_of = {name: role.colocate_with or name for name, role in cfg.roles().items()}
    per_gpu: dict[str, Memory] = {}
    for host in dict.fromkeys(host_of.values()):
        guests = [n for n, h in host_of.items() if h == host]
        shared = sum(cfg.roles()[g].gpus_per_rank for g in guests) <= 1.0 + 1e-9
        groups = [guests] if shared else [[g] for g in guests]
        for group in groups:
            mem = Memory()
            for g in group:
                mem = mem.add(roles[g].memory, prefix=f"{g}:" if len(group) > 1 else "")
            label = f"{'+'.join(group)} ({cfg.roles()[group[0]].parallel.ranks} GPUs)"
            if cfg.rollout.colocate_with in group:  # time-shared with vLLM: the larger phase
                label += " + rollout, time-shared"
                if vmem.total > mem.total:
                    mem = vmem
            per_gpu[label] = mem.add(overhead)
    if cfg.rollout.colocate_with is None:
        per_gpu[f"rollout ({r.engines * r.tp} GPUs)"] = vmem.add(overhead)
    colocated = cfg.rollout.colocate_with is not None
    forward = [roles[n].time_s for n in roles if n in SCORING]
    forward.append(steptime.forward_s(archs["actor"], roles["actor"].layout.gpus, rl, gpu, eff))
    if "critic" in roles:
        forward.append(steptime.forward_s(archs["critic"], roles["critic"].layout.gpus, rl, gpu, eff))
    assert len(forward) == len(_forward_passes(rl.algo))
    times = {"generation": rollout.time_s, "inference": max(forward),
             "training": max(roles[n].time_s for n in roles if n in TRAINED),
             "weight sync": steptime.weight_sync_s(archs["actor"], shape, colocated, gpu, eff)}
    return Plan("recipe", recipe_gpus(cfg), roles, rollout, per_gpu, times, gpu.memory_bytes)
