"""Placements for an RL run that fit the GPUs, chosen by estimated step time.

The roles and each role's layouts are in ``megarl.plan.roles``. Placements, as megarl runs them
(``megarl.trainer.run``):

- colocated: every role on every GPU, time-shared: the Megatron roles are offloaded
  to host memory while vLLM generates, vLLM sleeps while they work. A GPU's peak is
  the largest phase: vLLM's claim, the sync (actor weights + vLLM weights), or the
  Megatron roles together.
- split: the Megatron roles together on some of the GPUs (resident side by side), vLLM on
  the rest (a recipe whose reference ``colocate_with: actor`` and rollout on its own), as
  NeMo RL runs its non-colocated and async GRPO.
- disaggregated: every role on GPUs of its own, all resident.

With rollout ahead of training (``max_staleness`` > 0; split or disaggregated) the engines
generate the next batch while this one is scored and trained: the step is max(generation,
inference + training) + the weight sync, not their sum. ``recommend`` weighs the fastest
lockstep plan against the fastest one-step-off one and picks the latter where it pays.

Conservative by construction: activations at the 1F1B peak, the logits' transient,
a fixed per-GPU overhead (CUDA context, NCCL, fragmentation), and KV cache for every
sequence vLLM may run at once. A layout fits when every GPU's total is at most its memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from megarl.models.hf_arch import ModelArch
from megarl.plan import steptime
from megarl.plan.hardware import GIB
from megarl.plan.memory import Memory
from megarl.plan.roles import (
    SCORING,
    TRAINED,
    VLLM_UTILIZATION,
    NoFit,
    PlanInputs,
    RolePlan,
    RolloutPlan,
    best_rollout,
    best_scoring,
    best_trained,
    overhead_memory,
    roles_for,
    rollout_anyway,
    smallest_detail,
    stack,
    stacked_roles,
)

__all__ = ["SCORING", "TRAINED", "NoFit", "Option", "Plan", "PlanInputs", "Recommendation", "RolePlan", "RolloutPlan",
           "best_scoring", "best_trained", "plan", "plan_colocated", "plan_disaggregated", "plan_split",
           "recommend"]


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
    overlapped: bool = False  # rollout runs ahead (max_staleness > 0, split or disaggregated)

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


def plan_colocated(arch: ModelArch, n: int, inp: PlanInputs) -> Plan:
    """Every role on all ``n`` GPUs, time-shared (see the module docstring)."""
    cap = inp.gpu.memory_bytes
    chosen = stacked_roles(arch, n, inp)
    megatron = stack(chosen.values(), inp.eff)
    util = min(VLLM_UTILIZATION, (cap - inp.eff.overhead_gib * GIB) / cap)
    lockstep = replace(inp, max_staleness=0)  # colocated generation cannot run ahead
    rollout = best_rollout(arch, n, lockstep, util) or rollout_anyway(arch, n, lockstep, util)
    vllm = rollout.memory.add(overhead_memory(inp.eff))
    sync = Memory({"actor:weights": chosen["actor"].memory.components["weights"],
                   "vllm_weights": rollout.memory.components["vllm_weights"]}).add(overhead_memory(inp.eff))
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


def plan_split(arch: ModelArch, n: int, inp: PlanInputs) -> Plan:
    """The Megatron roles together on ``t`` of the ``n`` GPUs (resident, none offloaded: they score
    and train one after the other), vLLM on the other ``n - t``; the ``t`` with the lowest step
    time. Run ahead, generation overlaps scoring and training, and the refit crosses the split
    (``steptime.split_sync_s``)."""
    cap = inp.gpu.memory_bytes
    util = min(VLLM_UTILIZATION, (cap - inp.eff.overhead_gib * GIB) / cap)
    best: Plan | None = None
    failures: list[NoFit] = []
    for t in (g for g in _group_sizes(n) if g < n):
        try:
            chosen = stacked_roles(arch, t, inp)
        except NoFit as e:
            failures.append(e)
            continue
        rollout = best_rollout(arch, n - t, inp, util)
        if rollout is None:
            continue
        megatron = stack(chosen.values(), inp.eff)
        forward = steptime.forward_s(arch, t, inp.rl, inp.gpu, inp.eff)
        times = {"generation": rollout.time_s, "inference": forward * len(_forward_passes(inp.rl.algo)),
                 "training": sum(chosen[r].time_s for r in TRAINED if r in chosen),
                 "weight sync": steptime.split_sync_s(arch, rollout.shape, t, inp.gpu, inp.eff)}
        candidate = Plan("split", n, chosen, rollout,
                         {f"Megatron roles ({t} GPUs)": megatron,
                          f"rollout ({n - t} GPUs)": rollout.memory.add(overhead_memory(inp.eff))}, times, cap,
                         [f"Megatron roles on {t} GPUs, vLLM on the other {n - t} "
                          f"(gpu_memory_utilization={util:.2f})"], overlapped=inp.max_staleness > 0)
        if candidate.fits and (best is None or candidate.step_s < best.step_s):
            best = candidate
        elif not candidate.fits:
            failures.append(NoFit(candidate.peak, cap, "split: " + ("; ".join(candidate.problems) or _over(candidate))))
    if best is None:
        raise min(failures, key=lambda e: e.needed) if failures else NoFit(
            cap, cap, f"no split of {n} GPUs leaves the rollout an engine", gpus=True)
    return best


def _forward_passes(algo: str) -> list[str]:
    """Forward passes over the batch per step: old log-probs, reference, and where the algorithm
    learns a value function, the critic's values and the reward model's scores."""
    roles = roles_for(algo)
    scoring = ["teacher"] if "teacher" in roles else ["reference"]
    return ["actor old log-probs", *scoring] + (["critic values", "reward model"] if "critic" in roles else [])


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
                need, detail = smallest_detail(arch, n, inp, name)
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
    per_gpu = {f"{name} ({picked[name][0]} GPUs)": roles[name].memory.add(overhead_memory(inp.eff)) for name in names}
    per_gpu[f"rollout ({picked['rollout'][0]} GPUs)"] = rollout.memory.add(overhead_memory(inp.eff))
    used = sum(g for g, _ in picked.values())
    notes = [f"{n - used} of {n} GPUs unused"] if used < n else []
    return Plan("disaggregated", used, roles, rollout, per_gpu, _disagg_times(picked, arch, inp), cap, notes,
                overlapped=inp.max_staleness > 0)


def _disagg_times(picked: dict, arch: ModelArch, inp: PlanInputs) -> dict[str, float]:
    """Synchronous RL: generation, then the scoring passes (in parallel on their GPUs), then training."""
    forward = {"actor": steptime.forward_s(arch, picked["actor"][0], inp.rl, inp.gpu, inp.eff)}
    for name in ("reference", "teacher", "reward_model", "critic"):
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
    tries = {"any": (plan_colocated, plan_split, plan_disaggregated), "colocated": (plan_colocated,),
             "split": (plan_split,), "disaggregated": (plan_disaggregated,)}[placement]
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


# One step off trains on samples from weights one update old (with an importance-sampling
# correction); it is recommended when it saves at least this share of the lockstep step.
ASYNC_MIN_SPEEDUP = 1.05
# where generation can run ahead: on GPUs of its own
_AHEAD = {"any": ("split", "disaggregated"), "split": ("split",), "disaggregated": ("disaggregated",),
          "colocated": ()}


class Option(Protocol):
    """A timed setup: a ``Plan``, or the estimate of a published run (``published.Comparison``)."""

    @property
    def placement(self) -> str: ...

    @property
    def step_s(self) -> float: ...


@dataclass
class Recommendation:
    """The lockstep setup (max_staleness 0) beside the fastest one running ahead (max_staleness
    k > 0, generation on GPUs of its own); either is None when it does not fit."""

    lockstep: Option | None
    ahead: Option | None
    staleness: int = 1

    @property
    def speedup(self) -> float:
        """Lockstep step time over the run-ahead one (0 when either is missing)."""
        if self.lockstep is None or self.ahead is None:
            return 0.0
        return self.lockstep.step_s / self.ahead.step_s

    @property
    def pays(self) -> bool:
        return self.ahead is not None and (self.lockstep is None or self.speedup >= ASYNC_MIN_SPEEDUP)

    @property
    def chosen(self) -> Option:
        chosen = self.ahead if self.pays else self.lockstep
        assert chosen is not None
        return chosen

    def describe(self) -> str:
        if self.lockstep is None or self.ahead is None:
            only = "lockstep" if self.ahead is None else f"{self.staleness} step(s) off"
            return f"recommended: {only}, the only timing that fits"
        ahead = (f"{self.staleness} step(s) off (trainer.max_staleness={self.staleness}, {self.ahead.placement}) "
                 f"{self.ahead.step_s:.1f} s/step")
        lock = f"lockstep ({self.lockstep.placement}) {self.lockstep.step_s:.1f} s/step"
        if self.pays:
            return f"recommended: {ahead}, {self.speedup:.2f}x faster than {lock}"
        return (f"recommended: {lock}; {ahead} would be {self.speedup:.2f}x "
                f"(under {ASYNC_MIN_SPEEDUP:.2f}x, not worth stale samples)")


def recommend(arch: ModelArch, n: int, inp: PlanInputs, placement: str = "any",
              lockstep: Option | None = None) -> Recommendation:
    """Lockstep or rollout ahead (``inp.max_staleness``, at least 1) on ``n`` GPUs, whichever is
    faster by at least ``ASYNC_MIN_SPEEDUP``. The lockstep side is the fastest lockstep plan, or
    ``lockstep`` where given (a recipe's own layouts, a published run). A chosen plan's notes say
    what it was weighed against. NoFit when neither fits."""
    k = max(1, inp.max_staleness)
    found: dict[str, list[Plan]] = {"lockstep": [], "ahead": []}
    failures = []
    tries = [] if lockstep is not None else [("lockstep", placement, 0)]
    tries += [("ahead", how, k) for how in _AHEAD[placement]]
    for key, how, staleness in tries:
        try:
            found[key].append(plan(arch, n, replace(inp, max_staleness=staleness), how))
        except NoFit as e:
            failures.append(e)
    if lockstep is None and not found["lockstep"] and not found["ahead"]:
        raise min(failures, key=lambda e: e.needed)
    best = {key: min(plans, key=lambda p: p.step_s, default=None) for key, plans in found.items()}
    rec = Recommendation(lockstep if lockstep is not None else best["lockstep"], best["ahead"], k)
    if isinstance(rec.chosen, Plan):
        rec.chosen.notes.append(rec.describe())
    return rec
