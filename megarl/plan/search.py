"""Layouts and placements for an RL run that fit the GPUs, chosen by estimated step time.

Roles: GRPO trains an actor against a reference; PPO adds a critic (trained, value
head) and a reward model (value head). The rollout is vLLM engines of ``tp`` GPUs.

Placements, as megarl runs them (``megarl.trainer.run``):

- colocated: every role on every GPU, time-shared: the Megatron roles are offloaded
  to host memory while vLLM generates, vLLM sleeps while they work. A GPU's peak is
  the largest phase: vLLM's claim, the sync (actor weights + vLLM weights), or the
  Megatron roles together.
- disaggregated: every role on GPUs of its own, all resident.

Conservative by construction: activations at the 1F1B peak, the logits' transient,
a fixed per-GPU overhead (CUDA context, NCCL, fragmentation), and KV cache for every
sequence vLLM may run at once. A layout fits when every GPU's total is at most its memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

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

TRAINED = {"actor": False, "critic": True}  # role -> value head
SCORING = {"reference": False, "reward_model": True}


def roles_for(algo: str) -> list[str]:
    if algo == "grpo":
        return ["actor", "reference"]
    if algo == "ppo":
        return ["actor", "critic", "reference", "reward_model"]
    raise ValueError(f"algo {algo!r} must be grpo or ppo")


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


@dataclass
class Plan:
    placement: str
    gpus: int
    roles: dict[str, RolePlan]
    rollout: RolloutPlan
    per_gpu: dict[str, Memory]  # GPU group -> its peak memory by component
    times: dict[str, float]
    capacity: float
    notes: list[str] = field(default_factory=list)
    overlapped: bool = False  # rollout runs ahead (max_staleness > 0, disaggregated)

    @property
    def peak(self) -> float:
        return max(m.total for m in self.per_gpu.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity and not self.problems

    @property
    def problems(self) -> list[str]:
        p = []
        r = self.rollout
        if r.memory.components.get("vllm_kv_cache", 0.0) < r.kv_needed:
            p.append(f"vLLM KV cache {r.memory.components.get('vllm_kv_cache', 0.0) / GIB:.1f} GiB per GPU < "
                     f"{r.kv_needed / GIB:.1f} GiB for {r.shape.max_num_seqs} sequences of "
                     f"{r.shape.max_model_len} tokens")
        return p

    @property
    def step_s(self) -> float:
        """Synchronous: the phases one after the other. Overlapped: the engines generate the next
        batch while this one is scored and trained, and both wait for the weight sync."""
        t = self.times
        if not self.overlapped:
            return sum(t.values())
        return max(t["generation"], t["inference"] + t["training"]) + t["weight sync"]


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


def _overhead(eff: Efficiency) -> Memory:
    return Memory({"overhead": eff.overhead_gib * GIB})


def _stage_layers(arch: ModelArch, layout: Layout) -> int:
    return max(stage_layer_counts(arch.num_layers, layout))


def best_trained(name: str, arch: ModelArch, gpus: int, inp: PlanInputs, budget: float) -> list[RolePlan]:
    """Fitting layouts of a trained role on ``gpus`` GPUs within ``budget`` bytes, fastest first.

    Each layout takes the memory savers (recompute, optimizer offload) that fit at the least
    estimated time: more recompute and more offload only where less does not fit.
    """
    plans = []
    base = Workload(dtype=inp.dtype, micro_batch=inp.micro_batch, seq_len=inp.rl.seq_len, attention=inp.attention)
    for layout in layouts(arch, gpus, inp.gpu):
        micro = max(1, inp.rl.sequences // (layout.dp * inp.rl.minibatches * inp.micro_batch))
        layers = _stage_layers(arch, layout)
        timed = sorted(((steptime.training_s(arch, layout, inp.micro_batch, sv.cost(layers), inp.rl, inp.gpu,
                                             inp.eff), sv) for sv in savers(layers)), key=lambda ts: ts[0])
        for t, sv in timed:
            mem = trained_memory(arch, layout, sv.workload(base), micro, value_head=TRAINED[name])
            if mem.total <= budget:
                plans.append(RolePlan(name, layout, sv.describe(), mem, t, sv))
                break
    return sorted(plans, key=lambda p: (p.time_s, p.memory.total))


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
    """vLLM engines of ``tp`` GPUs on ``gpus`` GPUs, as many sequences at once as the KV cache holds."""
    per_engine = -(-inp.rl.sequences // (gpus // tp))
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
    t = steptime.generation_s(arch, shape, inp.rl, inp.gpu, inp.eff)
    if tp > inp.gpu.gpus_per_node:
        t *= inp.gpu.nvlink_gbps / inp.gpu.interconnect_gbps / 4  # TP across nodes: all-reduces over the NIC
    return RolloutPlan(shape, mem, needed * inp.rl.mean_seq_len / inp.rl.seq_len, t)


VLLM_UTILIZATION = 0.9  # vLLM's default share of the device


def plan_colocated(arch: ModelArch, n: int, inp: PlanInputs) -> Plan:
    """Every role on all ``n`` GPUs, time-shared (see the module docstring)."""
    cap, names = inp.gpu.memory_bytes, roles_for(inp.rl.algo)
    budget = cap - inp.eff.overhead_gib * GIB
    chosen: dict[str, RolePlan] = {}
    for name in names:  # each role alone first: if one cannot fit, nothing can
        found = (best_trained if name in TRAINED else best_scoring)(name, arch, n, inp, budget)
        if not found:
            need, detail = _smallest_detail(arch, n, inp, name)
            raise NoFit(need, cap, f"{name} alone does not fit on {n} GPUs; {detail}")
        chosen[name] = found[0]
    if _stack(chosen.values(), inp.eff).total > cap:
        # The roles are resident together. Scoring roles take their smallest layout; each trained
        # role then gets the fastest layout and savers that fit beside the others (a trained role
        # not yet chosen counted at its smallest: full recompute, Adam on the host).
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
            placed[name] = found[0] if found else _timed(smallest[name], arch, inp)
        chosen.update(placed)
    megatron = _stack(chosen.values(), inp.eff)
    util = min(VLLM_UTILIZATION, (cap - inp.eff.overhead_gib * GIB) / cap)
    rollout = best_rollout(arch, n, inp, util) or _rollout_anyway(arch, n, inp, util)
    vllm = rollout.memory.add(_overhead(inp.eff))
    sync = Memory({"actor:weights": chosen["actor"].memory.components["weights"],
                   "vllm_weights": rollout.memory.components["vllm_weights"]}).add(_overhead(inp.eff))
    offloaded = sum(p.memory.total for p in chosen.values())
    times = {"generation": rollout.time_s,
             "inference": sum(steptime.forward_s(arch, n, inp.rl, inp.gpu, inp.eff)
                              for _ in _forward_passes(inp.rl.algo)),
             "training": sum(chosen[r].time_s for r in TRAINED if r in chosen),
             "weight sync": steptime.weight_sync_s(arch, rollout.shape, True, inp.gpu, inp.eff),
             "offload": steptime.offload_s(offloaded, inp.gpu)}
    return Plan("colocated", n, chosen, rollout,
                {"Megatron phase": megatron, "generation phase": vllm, "sync phase": sync}, times, cap,
                [f"vLLM gpu_memory_utilization={util:.2f} (Megatron roles offloaded while it generates)"])


def _timed(role: RolePlan, arch: ModelArch, inp: PlanInputs) -> RolePlan:
    """``role`` with the training time its layout and savers cost."""
    cost = role.saver.cost(_stage_layers(arch, role.layout))
    role.time_s = steptime.training_s(arch, role.layout, inp.micro_batch, cost, inp.rl, inp.gpu, inp.eff)
    return role


def _stack(plans, eff: Efficiency) -> Memory:
    """Roles resident on the same GPUs: their components side by side, plus the overhead once."""
    total = Memory()
    for p in plans:
        total = total.add(p.memory, prefix=f"{p.name}:")
    return total.add(_overhead(eff))


def _forward_passes(algo: str) -> list[str]:
    """Forward passes over the batch per step: old log-probs, reference, and PPO's critic and reward."""
    return ["actor old log-probs", "reference"] + (["critic values", "reward model"] if algo == "ppo" else [])


def _rollout_anyway(arch: ModelArch, gpus: int, inp: PlanInputs, util: float) -> RolloutPlan:
    """The roomiest vLLM shape, for reporting a rollout that does not fit."""
    tp = max(t for t in (1, 2, 4, 8, 16) if gpus % t == 0 and arch.num_heads % t == 0)
    shape = RolloutShape(tp=tp, engines=gpus // tp, max_num_seqs=inp.max_num_seqs, max_model_len=inp.rl.seq_len,
                         gpu_memory_utilization=util, dtype=inp.dtype, weights=inp.rollout_weights)
    mem, needed = vllm_memory(arch, shape, inp.gpu.memory_bytes)
    return RolloutPlan(shape, mem, needed, steptime.generation_s(arch, shape, inp.rl, inp.gpu, inp.eff))


def _smallest_detail(arch: ModelArch, n: int, inp: PlanInputs, name: str) -> tuple[float, str]:
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


def _smallest_need(arch: ModelArch, n: int, inp: PlanInputs, name: str) -> float:
    if name in TRAINED:
        p = smallest_trained(name, arch, n, inp)
    else:
        found = best_scoring(name, arch, n, inp, 0.0)
        p = found[0] if found else None
    return (p.memory.total if p else float("inf")) + inp.eff.overhead_gib * GIB


def _group_sizes(n: int) -> list[int]:
    sizes = {1 << k for k in range(n.bit_length()) if 1 << k <= n}
    sizes |= {8 * k for k in range(1, n // 8 + 1)} if n <= 256 else set()
    return sorted(sizes)


def plan_disaggregated(arch: ModelArch, n: int, inp: PlanInputs) -> Plan:
    """Each role on GPUs of its own; the split with the lowest estimated step time."""
    cap, names = inp.gpu.memory_bytes, roles_for(inp.rl.algo)
    budget = cap - inp.eff.overhead_gib * GIB
    sizes = _group_sizes(n)
    cache: dict[tuple[str, int], RolePlan | RolloutPlan | None] = {}

    def option(name: str, g: int):
        if (name, g) not in cache:
            if name == "rollout":
                cache[name, g] = best_rollout(arch, g, inp, min(VLLM_UTILIZATION, 1 - inp.eff.overhead_gib * GIB / cap))
            else:
                found = (best_trained if name in TRAINED else best_scoring)(name, arch, g, inp, budget)
                cache[name, g] = found[0] if found and found[0].memory.total <= budget else None
        return cache[name, g]

    best: tuple[float, dict] | None = None
    order = names + ["rollout"]

    def search(i: int, left: int, picked: dict) -> None:
        nonlocal best
        if i == len(order):
            t = _disagg_time(picked, arch, inp)
            if best is None or t < best[0]:
                best = (t, dict(picked))
            return
        for g in sizes:
            if g > left - (len(order) - i - 1):
                break
            opt = option(order[i], g)
            if opt is not None:
                picked[order[i]] = (g, opt)
                search(i + 1, left - g, picked)
                del picked[order[i]]

    search(0, n, {})
    if best is None:
        # the fewest GPUs each role fits on; a role that fits on none of the sizes decides the shortfall
        least = {r: next((g for g in sizes if option(r, g) is not None), None) for r in order}
        missing = [r for r, g in least.items() if g is None]
        if missing:
            name = missing[0]
            if name != "rollout":
                need, detail = _smallest_detail(arch, n, inp, name)
            else:
                need = (arch.num_parameters() * 2 / max(t for t in (1, 2, 4, 8, 16) if n % t == 0)
                        + inp.eff.overhead_gib * GIB)
                detail = "vLLM's weights and one sequence's KV cache do not fit an engine"
            raise NoFit(need, cap, f"{name} does not fit even on all {n} GPUs; {detail}")
        raise NoFit(cap, cap, f"the roles need at least {sum(least.values())} GPUs on their own "
                              f"({', '.join(f'{r} {g}' for r, g in least.items())}), {n} given", gpus=True)
    picked = best[1]
    roles = {name: picked[name][1] for name in names}
    rollout = picked["rollout"][1]
    per_gpu = {f"{name} ({picked[name][0]} GPUs)": roles[name].memory.add(_overhead(inp.eff)) for name in names}
    per_gpu[f"rollout ({picked['rollout'][0]} GPUs)"] = rollout.memory.add(_overhead(inp.eff))
    used = sum(g for g, _ in picked.values())
    notes = [f"{n - used} of {n} GPUs unused"] if used < n else []
    return Plan("disaggregated", used, roles, rollout, per_gpu, _disagg_times(picked, arch, inp), cap, notes,
                overlapped=inp.max_staleness > 0)


def _disagg_times(picked: dict, arch: ModelArch, inp: PlanInputs) -> dict[str, float]:
    """Synchronous RL: generation, then the scoring passes (in parallel on their GPUs), then training."""
    forward = {"actor": steptime.forward_s(arch, picked["actor"][0], inp.rl, inp.gpu, inp.eff)}
    for name in ("reference", "reward_model", "critic"):
        if name in picked:
            forward[name] = steptime.forward_s(arch, picked[name][0], inp.rl, inp.gpu, inp.eff)
    training = [picked[r][1].time_s for r in TRAINED if r in picked]
    return {"generation": picked["rollout"][1].time_s, "inference": max(forward.values()),
            "training": max(training),
            "weight sync": steptime.weight_sync_s(arch, picked["rollout"][1].shape, False, inp.gpu, inp.eff)}


def _disagg_time(picked: dict, arch: ModelArch, inp: PlanInputs) -> float:
    times = _disagg_times(picked, arch, inp)
    if inp.max_staleness > 0:  # the split that balances generation against training wins
        return max(times["generation"], times["inference"] + times["training"]) + times["weight sync"]
    return sum(times.values())


def _over(candidate: Plan) -> str:
    """The fullest group of GPUs by component, and the savers its trained roles already use."""
    group, mem = max(candidate.per_gpu.items(), key=lambda kv: kv[1].total)
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in mem.components.items() if v >= 0.05 * GIB)
    savers_used = "; ".join(f"{r.name} {r.recompute}" for r in candidate.roles.values() if r.saver is not None)
    return f"{group} needs {mem.total / GIB:.1f} GiB per GPU: {parts} (with {savers_used})"


def plan(arch: ModelArch, n: int, inp: PlanInputs, placement: str = "any") -> Plan:
    """The fastest fitting plan of the requested placement(s); NoFit when none fits."""
    tries = {"any": (plan_colocated, plan_disaggregated), "colocated": (plan_colocated,),
             "disaggregated": (plan_disaggregated,)}[placement]
    plans, failures = [], []
    for fn in tries:
        try:
            candidate = fn(arch, n, inp)
        except NoFit as e:
            failures.append(e)
            continue
        if candidate.fits:
            plans.append(candidate)
        else:
            failures.append(NoFit(candidate.peak, candidate.capacity,
                                  f"{candidate.placement}: " + ("; ".join(candidate.problems) or _over(candidate))))
    if plans:
        return min(plans, key=lambda p: p.step_s)
    raise min(failures, key=lambda e: e.needed)
