"""The roles of an RL run and the fastest layout of each on a group of GPUs.

Roles: GRPO trains an actor against a reference; PPO adds a critic (trained, value head) and a
reward model (value head). The rollout is vLLM engines of ``tp`` GPUs. Each role's layouts
(``layouts``: every tp, cp, pp, dp and, for MoE, ep and etp megatron-core can build) are timed
with the memory savers that fit (``best_trained``, ``best_scoring``, ``best_rollout``); the
placements that combine them are in ``megarl.plan.search``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from megarl.config.roles import ROLE_KINDS
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
from megarl.plan.savers import Saver, most_saving, savers
from megarl.plan.steptime import RLShape

# role -> value head, for the roles that train and those that score (megarl.config.roles)
TRAINED = {name: kind.value_head for name, kind in ROLE_KINDS.items() if kind.trained}
SCORING = {name: kind.value_head for name, kind in ROLE_KINDS.items() if not kind.trained}


def roles_for(algo: str) -> list[str]:
    """The roles a step of ``algo`` (a registered algorithm's name) runs, asked of the algorithm:
    the actor and a KL reference (the workloads the planner models all use one), and a critic
    with the reward model it starts from where the algorithm learns a value function. On-policy
    distillation (opd) scores the samples with a teacher instead of a reference, planned as a
    scoring role of the actor's architecture (a larger teacher is not modelled)."""
    from megarl.algorithms.registry import ALGORITHMS, get_algorithm
    from megarl.config.schema import AlgorithmConfig

    if algo not in ALGORITHMS:
        raise ValueError(f"algo {algo!r} must be one of {', '.join(ALGORITHMS)}")
    algorithm = get_algorithm(algo)
    if algorithm.needs_teacher(AlgorithmConfig(name=algo)):
        return ["actor", "teacher"]
    return ["actor", "critic", "reference", "reward_model"] if algorithm.needs_critic else ["actor", "reference"]


@dataclass(frozen=True)
class PlanInputs:
    gpu: GpuSpec
    rl: RLShape = RLShape()
    eff: Efficiency = Efficiency()
    micro_batch: int = 1
    infer_micro_batch: int = 2
    max_num_seqs: int = 256
    dtype: str = "bfloat16"
    attention: str = "flash"
    # rollout ahead of training (trainer.max_staleness): disaggregated, a step's generation of the
    # next batch overlaps its scoring and training; colocated stays synchronous
    max_staleness: int = 0
    rollout_weights: str = "model"  # rollout.weights: "fp8" holds vLLM's layers in E4M3


@dataclass
class RolePlan:
    name: str
    layout: Layout
    recompute: str  # what the report prints: recompute and optimizer offload chosen
    memory: Memory  # per GPU
    time_s: float
    saver: Saver | None = None  # trained roles: the recompute and offload chosen


@dataclass
class RolloutPlan:
    shape: RolloutShape
    memory: Memory
    kv_needed: float
    time_s: float


class NoFit(Exception):
    """Nothing fits; ``needed`` is the smallest per-GPU peak any candidate reached."""

    def __init__(self, needed: float, capacity: float, detail: str, gpus: bool = False):
        self.needed, self.capacity, self.detail = needed, capacity, detail
        if gpus:  # memory per GPU is not the problem; the GPU count is
            super().__init__(f"no layout fits: {detail}")
        else:
            super().__init__(f"no layout fits: needs {needed / GIB:.1f} GiB per GPU, has {capacity / GIB:.1f} GiB "
                             f"(short by {(needed - capacity) / GIB:.1f} GiB); {detail}")


def _divides(arch: ModelArch, tp: int) -> bool:
    return (arch.num_heads % tp == 0 and arch.num_kv_heads % tp == 0 and arch.ffn_hidden_size % tp == 0)


def pipeline_split(num_layers: int, pp: int) -> tuple[int | None, int | None] | None:
    """(first, last) stage layers for ``pp`` stages: None, None when even; lighter ends otherwise."""
    if num_layers % pp == 0:
        return None, None
    if pp < 3:
        return None
    per = math.ceil(num_layers / pp)
    ends = num_layers - (pp - 2) * per
    if ends < 2 or ends % 2:
        return None
    return ends // 2, ends // 2


def layouts(arch: ModelArch, gpus: int, gpu: GpuSpec) -> list[Layout]:
    """Every (tp, cp, pp, dp[, ep, etp]) of ``gpus`` ranks megatron-core can build for ``arch``: for
    an MoE model at tp > 1, experts split tp ways (megatron-core's default) or kept whole (etp = 1,
    which lets ep reach tp * dp ranks). Context parallelism (dense models, as megarl runs it) stays
    inside a node with tensor parallelism: its key/value exchange runs every layer."""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if t <= gpu.gpus_per_node and gpus % t == 0 and _divides(arch, t)):
        cps = [c for c in (1, 2, 4, 8) if c == 1 or (not arch.is_moe and tp * c <= gpu.gpus_per_node
                                                      and gpus % (tp * c) == 0)]
        for cp in cps:
            for pp in (p for p in range(1, min(arch.num_layers, gpus // (tp * cp)) + 1)
                       if (gpus // (tp * cp)) % p == 0):
                split = pipeline_split(arch.num_layers, pp)
                if split is None:
                    continue
                dp = gpus // (tp * cp * pp)
                for etp in (None, 1) if arch.is_moe and tp > 1 else (None,):
                    stage = dp * tp // (etp or tp)  # the ranks ep can spread over
                    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if arch.is_moe and arch.num_experts % e == 0
                           and stage % e == 0] or [1]
                    for ep in eps:
                        out.append(Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, sequence_parallel=tp > 1,
                                          first_stage_layers=split[0], last_stage_layers=split[1]))
    return out


def overhead_memory(eff: Efficiency) -> Memory:
    return Memory({"overhead": eff.overhead_gib * GIB})


def stage_layers(arch: ModelArch, layout: Layout) -> int:
    return max(stage_layer_counts(arch.num_layers, layout))


def best_trained(name: str, arch: ModelArch, gpus: int, inp: PlanInputs, budget: float) -> list[RolePlan]:
    """Fitting layouts of a trained role on ``gpus`` GPUs within ``budget`` bytes, fastest first.

    Each layout takes the memory savers (recompute, optimizer offload) that fit at the least
    estimated time: more recompute and more offload only where less does not fit. Cached: the
    placements (and a recommendation's lockstep and run-ahead searches) ask for the same groups.
    """
    return [replace(p) for p in _best_trained(name, arch, gpus, replace(inp, max_staleness=0), budget)]


@functools.lru_cache(maxsize=512)
def _best_trained(name: str, arch: ModelArch, gpus: int, inp: PlanInputs, budget: float) -> tuple[RolePlan, ...]:
    plans = []
    base = Workload(dtype=inp.dtype, micro_batch=inp.micro_batch, seq_len=inp.rl.seq_len, attention=inp.attention)
    for layout in layouts(arch, gpus, inp.gpu):
        micro = max(1, inp.rl.sequences // (layout.dp * inp.rl.minibatches * inp.micro_batch))
        layers = stage_layers(arch, layout)
        ranked = sorted(((steptime.training_s(arch, layout, inp.micro_batch, sv.cost(layers), inp.rl, inp.gpu,
                                              inp.eff), sv) for sv in savers(layers)), key=lambda ts: ts[0])
        for t, sv in ranked:
            mem = trained_memory(arch, layout, sv.workload(base), micro, value_head=TRAINED[name])
            if mem.total <= budget:
                plans.append(RolePlan(name, layout, sv.describe(), mem, t, sv))
                break
    return tuple(sorted(plans, key=lambda p: (p.time_s, p.memory.total)))


def smallest_trained(name: str, arch: ModelArch, gpus: int, inp: PlanInputs) -> RolePlan | None:
    """The layout with the least memory per GPU under full recompute and full optimizer offload."""
    best = None
    base = Workload(dtype=inp.dtype, micro_batch=inp.micro_batch, seq_len=inp.rl.seq_len, attention=inp.attention)
    for layout in layouts(arch, gpus, inp.gpu):
        sv = most_saving()
        micro = max(1, inp.rl.sequences // (layout.dp * inp.rl.minibatches * inp.micro_batch))
        mem = trained_memory(arch, layout, sv.workload(base), micro, value_head=TRAINED[name])
        if best is None or mem.total < best.memory.total:
            best = RolePlan(name, layout, sv.describe(), mem, 0.0, sv)
    return best


def best_scoring(name: str, arch: ModelArch, gpus: int, inp: PlanInputs, budget: float) -> list[RolePlan]:
    plans = []
    for layout in layouts(arch, gpus, inp.gpu):
        if layout.ep > 1 or layout.etp is not None or layout.gpus != gpus:
            continue
        work = Workload(dtype=inp.dtype, micro_batch=inp.infer_micro_batch, seq_len=inp.rl.seq_len,
                        attention=inp.attention)
        mem = inference_memory(arch, layout, work, value_head=SCORING[name])
        t = steptime.forward_s(arch, gpus, inp.rl, inp.gpu, inp.eff) * (1 + (layout.pp - 1) / 8)
        plans.append(RolePlan(name, layout, "none", mem, t))
    fitting = [p for p in plans if p.memory.total <= budget]
    # equal FLOPs at any tp: the smallest tp that fits wastes least on all-reduces
    return sorted(fitting or sorted(plans, key=lambda p: p.memory.total)[:1],
                  key=lambda p: (p.time_s, p.layout.tp, p.memory.total))


def best_rollout(arch: ModelArch, gpus: int, inp: PlanInputs, utilization: float) -> RolloutPlan | None:
    """The fastest vLLM TP size whose engines fit on ``gpus`` GPUs.

    An engine runs at most as many sequences at once as its KV cache holds (vLLM would
    preempt beyond that), so max_num_seqs is lowered to what fits; the time counts the
    extra waves. An engine that cannot hold one full sequence does not fit.
    """
    best = None
    for tp in (1, 2, 4, 8, 16):
        if gpus % tp or arch.num_heads % tp:
            continue
        option = rollout_at(arch, gpus, inp, utilization, tp)
        if option is not None and (best is None or option.time_s < best.time_s):
            best = option
    return best


def rollout_at(arch: ModelArch, gpus: int, inp: PlanInputs, utilization: float, tp: int) -> RolloutPlan | None:
    """vLLM engines of ``tp`` GPUs on ``gpus`` GPUs, as many sequences at once as the KV cache holds.
    With ``inp.max_staleness`` = k > 0 the engines run k steps ahead (``steptime.overlapped_generation_s``)."""
    per_engine = -(-inp.rl.sequences // (gpus // tp)) * max(1, inp.max_staleness)
    shape = RolloutShape(tp=tp, engines=gpus // tp, max_num_seqs=min(inp.max_num_seqs, per_engine),
                         max_model_len=inp.rl.seq_len, gpu_memory_utilization=utilization, dtype=inp.dtype,
                         weights=inp.rollout_weights)
    mem, needed = vllm_memory(arch, shape, inp.gpu.memory_bytes)
    # vLLM admits sequences by the KV blocks they use: the mean sequence, not the longest
    per_seq = needed / shape.max_num_seqs * inp.rl.mean_seq_len / inp.rl.seq_len
    fit_seqs = int(mem.components["vllm_kv_cache"] // per_seq)
    if mem.components["vllm_kv_cache"] < needed / shape.max_num_seqs:  # not even one longest sequence
        return None
    if fit_seqs < shape.max_num_seqs:
        shape = replace(shape, max_num_seqs=fit_seqs)
        mem, needed = vllm_memory(arch, shape, inp.gpu.memory_bytes)
    if inp.max_staleness > 0:
        t = steptime.overlapped_generation_s(arch, shape, inp.rl, inp.max_staleness, inp.gpu, inp.eff)
    else:
        t = steptime.generation_s(arch, shape, inp.rl, inp.gpu, inp.eff)
    if tp > inp.gpu.gpus_per_node:
        t *= inp.gpu.nvlink_gbps / inp.gpu.interconnect_gbps / 4  # TP across nodes: all-reduces over the NIC
    return RolloutPlan(shape, mem, needed * inp.rl.mean_seq_len / inp.rl.seq_len, t)


VLLM_UTILIZATION = 0.9  # vLLM's default share of the device


def timed(role: RolePlan, arch: ModelArch, inp: PlanInputs) -> RolePlan:
    """``role`` with the training time its layout and savers cost."""
    cost = role.saver.cost(stage_layers(arch, role.layout))
    role.time_s = steptime.training_s(arch, role.layout, inp.micro_batch, cost, inp.rl, inp.gpu, inp.eff)
    return role


def stack(plans, eff: Efficiency) -> Memory:
    """Roles resident on the same GPUs: their components side by side, plus the overhead once."""
    total = Memory()
    for p in plans:
        total = total.add(p.memory, prefix=f"{p.name}:")
    return total.add(overhead_memory(eff))


def rollout_anyway(arch: ModelArch, gpus: int, inp: PlanInputs, util: float) -> RolloutPlan:
    """The roomiest vLLM shape, for reporting a rollout that does not fit."""
    tp = max(t for t in (1, 2, 4, 8, 16) if gpus % t == 0 and arch.num_heads % t == 0)
    shape = RolloutShape(tp=tp, engines=gpus // tp, max_num_seqs=inp.max_num_seqs, max_model_len=inp.rl.seq_len,
                         gpu_memory_utilization=util, dtype=inp.dtype, weights=inp.rollout_weights)
    mem, needed = vllm_memory(arch, shape, inp.gpu.memory_bytes)
    return RolloutPlan(shape, mem, needed, steptime.generation_s(arch, shape, inp.rl, inp.gpu, inp.eff))


def smallest_detail(arch: ModelArch, n: int, inp: PlanInputs, name: str) -> tuple[float, str]:
    """(per-GPU need, its components) of ``name``'s smallest layout on ``n`` GPUs: for a trained role
    with full recompute and full optimizer offload, so the message says what still does not fit."""
    if name in TRAINED:
        p = smallest_trained(name, arch, n, inp)
    else:
        found = best_scoring(name, arch, n, inp, 0.0)
        p = found[0] if found else None
    if p is None:
        return float("inf"), f"no layout of {name} divides {n} GPUs"
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.memory.components.items())
    how = f" with {p.recompute}" if name in TRAINED else ""
    return (p.memory.total + inp.eff.overhead_gib * GIB,
            f"its smallest layout ({p.layout.describe()}{how}) needs GiB per GPU: {parts}, "
            f"overhead {inp.eff.overhead_gib:.1f}")


def stacked_roles(arch: ModelArch, n: int, inp: PlanInputs) -> dict[str, RolePlan]:
    """Every Megatron role on the same ``n`` GPUs, resident together: each role's fastest layout,
    or, where they do not fit side by side, the scoring roles at their smallest and each trained
    role at the fastest layout and savers that fit beside the others. NoFit when a role alone
    does not fit on ``n`` GPUs."""
    cap, names = inp.gpu.memory_bytes, roles_for(inp.rl.algo)
    budget = cap - inp.eff.overhead_gib * GIB
    chosen: dict[str, RolePlan] = {}
    for name in names:  # each role alone first: if one cannot fit, nothing can
        found = (best_trained if name in TRAINED else best_scoring)(name, arch, n, inp, budget)
        if not found:
            need, detail = smallest_detail(arch, n, inp, name)
            raise NoFit(need, cap, f"{name} alone does not fit on {n} GPUs; {detail}")
        chosen[name] = found[0]
    if stack(chosen.values(), inp.eff).total > cap:
        # a trained role not yet chosen counts at its smallest: full recompute, Adam on the host
        for name in (r for r in names if r in SCORING):
            chosen[name] = min(best_scoring(name, arch, n, inp, budget), key=lambda p: p.memory.total)
        trained = [r for r in names if r in TRAINED]
        smallest = {r: smallest_trained(r, arch, n, inp) for r in trained}
        placed: dict[str, RolePlan] = {}
        for name in trained:
            others = [chosen[r] for r in names if r in SCORING]
            others += [placed.get(r) or smallest[r] for r in trained if r != name]
            room = budget - sum(o.memory.total for o in others)
            found = best_trained(name, arch, n, inp, room)
            placed[name] = found[0] if found else timed(smallest[name], arch, inp)
        chosen.update(placed)
    return chosen
