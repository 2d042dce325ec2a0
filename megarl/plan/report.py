"""Text rendering of a plan: layouts, per-GPU memory by component, step time, hardware figures."""

from __future__ import annotations

from dataclasses import asdict

from megarl.plan.hardware import GIB, Efficiency, GpuSpec
from megarl.plan.search import Plan
from megarl.plan.steptime import RLShape


def format_plan(plan: Plan, gpu: GpuSpec, eff: Efficiency, rl: RLShape, title: str) -> str:
    lines = [f"{title}: {plan.placement}, {plan.gpus} x {gpu.name} ({gpu.memory_gib:.1f} GiB each)", "",
             "layouts"]
    for name, role in plan.roles.items():
        recompute = f", {role.recompute}" if role.saver is not None else ""
        split = (f", first/last stage layers {role.layout.first_stage_layers}/{role.layout.last_stage_layers}"
                 if role.layout.first_stage_layers else "")
        lines.append(f"  {name:<13} {role.layout.describe()} ({role.layout.gpus} GPUs{recompute}{split})")
    s = plan.rollout.shape
    lines.append(f"  {'rollout':<13} vLLM tp={s.tp} x {s.engines} engines, max_num_seqs={s.max_num_seqs}, "
                 f"gpu_memory_utilization={s.gpu_memory_utilization:.2f}"
                 + (f", weights {s.weights}" if s.weights != "model" else ""))
    lines += ["", "per-GPU memory (GiB) by component, per group of GPUs (peak phase)"]
    for group, mem in plan.per_gpu.items():
        verdict = "fits" if mem.total <= plan.capacity else f"OVER by {(mem.total - plan.capacity) / GIB:.1f}"
        lines.append(f"  {group}: {mem.total / GIB:.1f} of {plan.capacity / GIB:.1f} ({verdict})")
        for comp, value in mem.components.items():
            lines.append(f"      {comp:<30} {value / GIB:8.2f}")
    kv = plan.rollout.memory.components.get("vllm_kv_cache", 0.0)
    lines.append(f"  vLLM KV cache needed for max_num_seqs x max_model_len: {plan.rollout.kv_needed / GIB:.1f} GiB "
                 f"per GPU, available {kv / GIB:.1f}")
    for problem in plan.problems:
        lines.append(f"  PROBLEM: {problem}")
    lines += ["", f"step time estimate (s), {rl.prompts} prompts x {rl.n} samples, prompt {rl.prompt_len} + "
                  f"response up to {rl.response_len} (mean {rl.mean_response:.0f}) tokens"]
    for phase, t in plan.times.items():
        lines.append(f"  {phase:<13} {t:9.1f}")
    if plan.overlapped:
        lines.append(f"  {'total':<13} {plan.step_s:9.1f}  (rollout ahead: max(generation, inference + training) "
                     f"+ weight sync; these GPUs in lockstep {sum(plan.times.values()):.1f})")
    else:
        lines.append(f"  {'total':<13} {plan.step_s:9.1f}")
    lines += ["", "hardware and efficiency figures used (override with the flags shown)"]
    flags = {"memory_gib": "--gpu-memory-gib", "bf16_tflops": "--gpu-tflops", "fp8_tflops": "--gpu-fp8-tflops",
             "hbm_gbps": "--hbm-gbps",
             "nvlink_gbps": "--nvlink-gbps", "interconnect_gbps": "--interconnect-gbps", "pcie_gbps": "--pcie-gbps",
             "gpus_per_node": "--gpus-per-node"}
    for key, flag in flags.items():
        value = getattr(gpu, key)
        lines.append(f"  {key:<18} {'none' if value is None else value:>8} ({flag})")
    for key, value in asdict(eff).items():
        lines.append(f"  {key:<18} {value:>8} (--{key.replace('_', '-')})")
    for note in plan.notes:
        lines.append(f"note: {note}")
    lines.append("verdict: " + ("FITS" if plan.fits else f"DOES NOT FIT (peak {plan.peak / GIB:.1f} GiB)"))
    return "\n".join(lines)
