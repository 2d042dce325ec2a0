"""NeMo RL's published on-policy / one-step-off pairs on the same GPUs, and the planner's estimates.

Each pair is the same model, GPUs, batch and dataset run twice by NeMo RL: on policy (every role
on every GPU, vLLM time-shared with Megatron) and one step off policy (``async_grpo`` with
``max_trajectory_age_steps: 1`` and in-flight weight updates: vLLM on half the GPUs, the policy
and reference on the other half, generation overlapping scoring and training). The measured
speedup is the ratio of their step times; the planner's is the ratio of its two estimates, each
on the peer's own layouts (``megarl.plan.published.estimate``). Only H100 pairs: DeepSeek V3
(multi-head latent attention) is not an architecture the planner models, and the GB200 tables
would need a GPU it has no figures for.

Sources, as read (``NVIDIA-NeMo/RL``, docs/about/performance-summary.md, "H100 BF16"):

- v0.5 table at 108bffdab368507a5500f27089ea2e7d90a06dea ("docs: v0.5 performance results update");
- v0.6 table at 69c7ca1170327f8185a7278166c31968236a841c ("docs: Perf page update for v0.6"), its
  figures unchanged through 7ea279abf (later commits fixed wording only).

| model | ver | GPUs | policy | T-max seq | G-avg seq | G-GBS | T-GBS | gen [TP,PP] | train [TP,CP,EP,PP] | step s |
|---|---|---|---|---|---|---|---|---|---|---|
| Llama-3.1-8B-Instruct | v0.5 | 16 | on | 4,096 | 1,019 | 2,048 | 512 | [1,1] | [1,1,1,1,1,2] (*) | 92.8 |
| Llama-3.1-8B-Instruct | v0.5 | 16 | 1-step off | 4,096 | 1,123 | 2,048 | 512 | [1,1] | [1,1,1,1,1,1] (*) | 64.8 |
| Qwen3-30B-A3B | v0.5 | 32 | on | 4,096 | 3,196 | 2,048 | 512 | [2,1] | [1,1,8,1] | 198 |
| Qwen3-30B-A3B | v0.5 | 32 | 1-step off | 4,096 | 3,201 | 2,048 | 512 | [2,1] | [1,1,8,2] | 154 |
| Qwen3-30B-A3B | v0.6 | 32 | on | 4,096 | 3,203 | 2,048 | 512 | [2,1] | [1,1,8,1] | 192 |
| Qwen3-30B-A3B | v0.6 | 32 | 1-step off | 4,096 | 3,201 | 2,048 | 512 | [2,1] | [1,1,8,2] | 152 |
| Qwen3-235B-A22B | v0.6 | 256 | on | 8,192 | 5,713 | 512 | 512 | [16,1] | [2,2,16,8] | 312 |
| Qwen3-235B-A22B | v0.6 | 256 | 1-step off | 8,192 | 5,721 | 512 | 512 | [8,1] | [4,1,16,8] | 231 |

(*) as printed, six figures for five columns; the recipes give pp 2 on policy and pp 1 one step off,
tp, cp and ep 1.

The split and what the table leaves out come from the recipes the table names
(examples/configs/recipes/llm/performance/, identical at both commits for these files except where
noted): ``grpo-llama3.1-8b-instruct-2n8g[-async-1off].yaml`` (generation on 1 node of 8, training
on the other 8; 64 prompts x 32, activation checkpointing), ``grpo-qwen3-30ba3b-4n8g[-async-1off]
.yaml`` (2 nodes each side; 64 x 32; no activation checkpointing), ``grpo-qwen3-235b-32n8g.yaml``
and ``grpo-qwen3-235b-32n8g-async-1off.yaml`` (the 32-node runs of ``grpo-qwen3-235b-16n8g.yaml``:
16 nodes each side; 16 prompts x 32, activation checkpointing, 11 layers on the first and last
stage). The async recipes set vLLM's ``gpu_memory_utilization`` to 0.8 (on policy: 0.6, from
grpo_math_1B.yaml, which also sets ``expert_tensor_parallel_size: 1``). Not published: prompt
lengths (``PROMPT_LEN`` assumed, as for every NeMo RL row), and per-phase times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.plan.memory import Layout
from megarl.plan.published import NEMO_RL, NEMO_RL_NOTES, NEMO_RL_V05, RUNS, Comparison, PublishedRun, estimate

NEMO_RL_V06 = "69c7ca1170327f8185a7278166c31968236a841c"  # "docs: Perf page update for v0.6"
_TABLE = "docs/about/performance-summary.md (H100 BF16 table)"
_RECIPES = "examples/configs/recipes/llm/performance/"


def _src(commit: str, version: str) -> str:
    return f"{NEMO_RL}@{commit}: {_TABLE}, NeMo RL {version}"


def _off(on: PublishedRun, mean_seq: float, step_s: float, train: Layout, rollout_tp: int, source: str,
         recipe: str) -> PublishedRun:
    """The one-step-off run of ``on``'s workload: vLLM on half of the GPUs at utilization 0.8."""
    return replace(on, name=on.name + " 1-step off", mean_seq=mean_seq, step_s=step_s, train=train,
                   rollout_tp=rollout_tp, source=source, recipe=recipe, rollout_gpus=on.gpus // 2, staleness=1,
                   rollout_utilization=0.8)


_LLAMA_ON, _QWEN30_ON = RUNS[0], RUNS[2]
_QWEN30_ON_V06 = replace(_QWEN30_ON, mean_seq=3203, step_s=192.0, source=_src(NEMO_RL_V06, "v0.6"),
                         recipe=f"{NEMO_RL}@{NEMO_RL_V06}: {_RECIPES}grpo-qwen3-30ba3b-4n8g.yaml")
_QWEN235_ON_V06 = PublishedRun(
    "NeMo RL GRPO Qwen3-235B-A22B 256", "qwen3-235b-a22b", 256, 16, 32, 1, 8192, 5713,
    Layout(tp=2, pp=8, cp=2, dp=8, ep=16, etp=1, sequence_parallel=True, first_stage_layers=11,
           last_stage_layers=11), 16, "full", 312.0, _src(NEMO_RL_V06, "v0.6"),
    f"{NEMO_RL}@{NEMO_RL_V06}: {_RECIPES}grpo-qwen3-235b-32n8g.yaml (defaults grpo-qwen3-235b-16n8g.yaml)",
    NEMO_RL_NOTES)


@dataclass(frozen=True)
class Pair:
    on: PublishedRun
    off: PublishedRun

    @property
    def measured_speedup(self) -> float:
        return self.on.step_s / self.off.step_s


PAIRS = [
    Pair(_LLAMA_ON, _off(_LLAMA_ON, 1123, 64.8, Layout(tp=1, pp=1, dp=8), 1, _src(NEMO_RL_V05, "v0.5"),
                         f"{NEMO_RL}@{NEMO_RL_V05}: {_RECIPES}grpo-llama3.1-8b-instruct-2n8g-async-1off.yaml")),
    Pair(_QWEN30_ON, _off(_QWEN30_ON, 3201, 154.0, Layout(tp=1, pp=2, dp=8, ep=8), 2, _src(NEMO_RL_V05, "v0.5"),
                          f"{NEMO_RL}@{NEMO_RL_V05}: {_RECIPES}grpo-qwen3-30ba3b-4n8g-async-1off.yaml")),
    Pair(_QWEN30_ON_V06, _off(_QWEN30_ON_V06, 3201, 152.0, Layout(tp=1, pp=2, dp=8, ep=8), 2,
                              _src(NEMO_RL_V06, "v0.6"),
                              f"{NEMO_RL}@{NEMO_RL_V06}: {_RECIPES}grpo-qwen3-30ba3b-4n8g-async-1off.yaml")),
    Pair(_QWEN235_ON_V06, _off(_QWEN235_ON_V06, 5721, 231.0,
                               Layout(tp=4, pp=8, dp=4, ep=16, etp=1, sequence_parallel=True, first_stage_layers=11,
                                      last_stage_layers=11), 8, _src(NEMO_RL_V06, "v0.6"),
                               f"{NEMO_RL}@{NEMO_RL_V06}: {_RECIPES}grpo-qwen3-235b-32n8g-async-1off.yaml")),
]


@dataclass(frozen=True)
class PairEstimate:
    pair: Pair
    on: Comparison
    off: Comparison

    @property
    def predicted_speedup(self) -> float:
        return self.on.estimate_s / self.off.estimate_s

    @property
    def speedup_ratio(self) -> float:
        """Predicted over measured speedup: 1 is exact."""
        return self.predicted_speedup / self.pair.measured_speedup


def estimate_pair(pair: Pair) -> PairEstimate:
    return PairEstimate(pair, estimate(pair.on), estimate(pair.off))


def format_pairs(rows: list[PairEstimate]) -> str:
    lines = [f"{'pair':<38} {'GPUs':>4} {'on s':>6} {'est':>6} {'ratio':>5} {'off s':>6} {'est':>6} {'ratio':>5} "
             f"{'speedup':>7} {'pred':>5} {'p/m':>5}"]
    for e in rows:
        on, off = e.pair.on, e.pair.off
        lines.append(f"{on.name:<38} {on.gpus:>4} {on.step_s:>6.1f} {e.on.estimate_s:>6.1f} {e.on.ratio:>5.2f} "
                     f"{off.step_s:>6.1f} {e.off.estimate_s:>6.1f} {e.off.ratio:>5.2f} "
                     f"{e.pair.measured_speedup:>7.2f} {e.predicted_speedup:>5.2f} {e.speedup_ratio:>5.2f}")
        for label, c in (("on ", e.on), ("off", e.off)):
            lines.append(f"      {label} " + ", ".join(f"{k} {v:.1f}" for k, v in c.times.items()))
    return "\n".join(lines)
