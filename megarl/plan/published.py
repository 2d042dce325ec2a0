"""Published RL step times with their full workloads, and the planner's estimate of each.

Every row names its source (repository, path and the commit read) so the comparison can
be audited. The workload is the peer's recipe: prompts x samples per step, optimizer steps
per step, the longest and the mean sequence, the training and generation layouts, and
whether activations are recomputed. Where the source does not give a figure (prompt
lengths, NeMo-Aligner's training layouts) the row's ``notes`` say what it assumes.

``estimate`` runs the planner's step model on the peer's layouts and placement, not on
layouts of its own choosing: NeMo RL's colocated GRPO (every role on every GPU, vLLM with
continuous batching), its non-colocated one-step-off GRPO (``rollout_gpus``: vLLM on GPUs of its
own running ahead, the policy and reference on the rest; ``published_pairs``), and NeMo-Aligner's
PPO (actor and reference on the actor nodes, which also generate with TensorRT-LLM in static
micro-batches; critic and reward model on their own nodes, scoring and training alongside the
actor).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.models.hf_arch import ModelArch, RopeConfig
from megarl.plan import steptime
from megarl.plan.archs import load_arch
from megarl.plan.hardware import GPUS, Efficiency, GpuSpec
from megarl.plan.memory import Layout, RolloutShape, Workload, inference_memory, trained_memory
from megarl.plan.roles import PlanInputs, rollout_at
from megarl.plan.steptime import RLShape, TrainCost

NEMO_RL = "NVIDIA-NeMo/RL"
NEMO_RL_V05 = "108bffdab368507a5500f27089ea2e7d90a06dea"  # "docs: v0.5 performance results update"
PERF_TABLE = "docs/about/performance-summary.md (NeMo RL v0.5, H100 BF16 table)"
PROMPT_LEN = 200  # assumed: an OpenMathInstruct-2 problem in examples/prompts/cot.txt, not published
NEMO_RL_NOTES = (f"assumed: prompts of {PROMPT_LEN} tokens (the table gives the mean whole sequence, G-Average "
                 "Seq len); Qwen3 architectures from their HF config.json",)


def _qwen3(name: str, hidden: int, ffn: int, layers: int, heads: int, kv: int, experts: int | None = None,
           topk: int | None = None) -> ModelArch:
    """A Qwen3 architecture from its HF config.json figures (QK-norm and the router cost no FLOPs
    worth modelling; family llama is how the planner reads a GQA SwiGLU decoder, mixtral one whose
    MLP is top-k routed SwiGLU experts)."""
    return ModelArch(family="mixtral" if experts else "llama", vocab_size=151936, hidden_size=hidden,
                     ffn_hidden_size=ffn, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=128,
                     norm_eps=1e-6, tie_embeddings=False, qkv_bias=False, max_position_embeddings=40960,
                     rope=RopeConfig(theta=1000000.0), num_experts=experts, moe_topk=topk, extra={"name": name})


@dataclass(frozen=True)
class PublishedRun:
    name: str
    arch: str  # a name from megarl/plan/arch_configs, or a key of QWEN3
    gpus: int
    prompts: int
    samples: int
    minibatches: int  # optimizer steps per RL step (samples x prompts / train global batch)
    max_seq: int  # longest sequence (prompt + response)
    mean_seq: float  # mean generated sequence, as published
    train: Layout
    rollout_tp: int
    recompute: str  # none | full (the recipe's activation_checkpointing)
    step_s: float  # published total step time
    source: str
    recipe: str
    notes: tuple[str, ...] = ()
    algo: str = "grpo"
    prompt_len: int = PROMPT_LEN
    critic_gpus: int = 0  # PPO with the critic and reward model on GPUs of their own
    critic: Layout | None = None
    rollout_batch: int | None = None  # static generation batches of this size (None: vLLM, continuous)
    # the rollout engine's fixed cost per decode step when it is not vLLM's (Efficiency.decode_step_ms)
    decode_step_ms: float | None = None
    # NeMo RL's non-colocated generation: vLLM on GPUs of its own (``gpus`` counts both sides, ``train``
    # is the training GPUs' layout), running ``staleness`` steps ahead (max_trajectory_age_steps)
    rollout_gpus: int = 0
    staleness: int = 0
    rollout_utilization: float = 0.6  # vLLM's gpu_memory_utilization

    def arch_model(self) -> ModelArch:
        return QWEN3[self.arch] if self.arch in QWEN3 else load_arch(self.arch)

    def shape(self) -> RLShape:
        return RLShape(algo=self.algo, prompts=self.prompts, n=self.samples, prompt_len=self.prompt_len,
                       response_len=self.max_seq - self.prompt_len,
                       mean_response_len=self.mean_seq - self.prompt_len, minibatches=self.minibatches)


QWEN3 = {
    # huggingface.co/Qwen/Qwen3-32B config.json
    "qwen3-32b": _qwen3("qwen3-32b", 5120, 25600, 64, 64, 8),
    # huggingface.co/Qwen/Qwen3-30B-A3B config.json (moe_intermediate_size 768, 128 experts, top 8)
    "qwen3-30b-a3b": _qwen3("qwen3-30b-a3b", 2048, 768, 48, 32, 4, experts=128, topk=8),
    # huggingface.co/Qwen/Qwen3-235B-A22B config.json (moe_intermediate_size 1536, 128 experts, top 8)
    "qwen3-235b-a22b": _qwen3("qwen3-235b-a22b", 4096, 1536, 94, 64, 4, experts=128, topk=8),
}

_RECIPES = f"{NEMO_RL}@{NEMO_RL_V05}: examples/configs/recipes/llm/performance/"
ALIGNER = "NVIDIA/NeMo-Aligner"
ALIGNER_COMMIT = "0a225501fc4f924f886f65022f7c1cabab4d377d"
ALIGNER_PROMPT = 400  # assumed: HelpSteer2 prompts (not published with the table)
ALIGNER_MAX_RESPONSE = 1024
# Calibrated: with vLLM's 4 ms both NeMo-Aligner rows came out at half their published time, all of
# it in generation (the guide's paper puts rollout at most of a PPO step). NeMo-Aligner drives
# TensorRT-LLM from NeMo's generation loop on a resharded model; 19 ms per decode step on top of
# the weight and KV reads puts both rows (two scales, one figure) within 10% of their times.
ALIGNER_DECODE_STEP_MS = 19.0

RUNS = [
    PublishedRun("NeMo RL GRPO Llama-3.1-8B-Instruct", "llama3.1-8b", 16, 64, 32, 4, 4096, 1019,
                 Layout(tp=1, pp=2, dp=8), 1, "full", 92.8, f"{NEMO_RL}@{NEMO_RL_V05}: {PERF_TABLE}",
                 _RECIPES + "grpo-llama3.1-8b-instruct-2n8g.yaml (defaults grpo_math_1B.yaml)", NEMO_RL_NOTES),
    PublishedRun("NeMo RL GRPO Qwen3-32B", "qwen3-32b", 32, 64, 32, 4, 4096, 3251,
                 Layout(tp=4, pp=4, dp=2, sequence_parallel=True), 4, "none", 376.0,
                 f"{NEMO_RL}@{NEMO_RL_V05}: {PERF_TABLE}", _RECIPES + "grpo-qwen3-32b-4n8g.yaml", NEMO_RL_NOTES),
    PublishedRun("NeMo RL GRPO Qwen3-30B-A3B", "qwen3-30b-a3b", 32, 64, 32, 4, 4096, 3196,
                 Layout(tp=1, pp=1, dp=32, ep=8), 2, "none", 198.0,
                 f"{NEMO_RL}@{NEMO_RL_V05}: {PERF_TABLE}", _RECIPES + "grpo-qwen3-30ba3b-4n8g.yaml", NEMO_RL_NOTES),
    PublishedRun("NeMo RL GRPO Qwen3-235B-A22B", "qwen3-235b-a22b", 128, 16, 32, 1, 8192, 5700,
                 Layout(tp=2, pp=8, cp=2, dp=4, ep=16, etp=1, sequence_parallel=True, first_stage_layers=11,
                        last_stage_layers=11), 16, "full", 431.0,
                 f"{NEMO_RL}@{NEMO_RL_V05}: {PERF_TABLE}", _RECIPES + "grpo-qwen3-235b-16n8g.yaml", NEMO_RL_NOTES),
] + [
    # docs/user-guide/rlhf.rst, "PPO Performance Results with TensorRT-LLM": Llama3 70B actor and
    # reward model (critic) on HelpSteer2 prompts, num_rollout_samples=1024, global_batch_size=128,
    # reshard on (TP-only generation); mean tokens generated per sample as published
    PublishedRun(f"NeMo-Aligner PPO Llama3-70B {nodes}+{nodes // 2} nodes", "llama3.1-70b", nodes * 12, 1024, 1,
                 8, ALIGNER_PROMPT + ALIGNER_MAX_RESPONSE, ALIGNER_PROMPT + generated,
                 Layout(tp=8, pp=4, dp=nodes // 4, sequence_parallel=True), 8, "selective", step,
                 f"{ALIGNER}@{ALIGNER_COMMIT}: docs/user-guide/rlhf.rst (PPO Performance Results with TensorRT-LLM)",
                 f"{ALIGNER}@{ALIGNER_COMMIT}: docs/user-guide/rlhf.rst (the PPO actor and critic commands: "
                 "rollout_micro_batch_size=8, activations_checkpoint_granularity=selective, offload_adam_states)",
                 notes=(f"assumed: prompts of {ALIGNER_PROMPT} tokens and responses of at most "
                        f"{ALIGNER_MAX_RESPONSE} (length_params.max_length in the guide); training layouts tp8 pp4 "
                        "(not published); Llama-3.1-70B's architecture for Llama3-70B",),
                 algo="ppo", prompt_len=ALIGNER_PROMPT, critic_gpus=nodes * 4,
                 critic=Layout(tp=8, pp=4, dp=nodes // 8, sequence_parallel=True), rollout_batch=8,
                 decode_step_ms=ALIGNER_DECODE_STEP_MS)
    for nodes, generated, step in ((8, 350.7, 366.7), (16, 323.3, 190.4))
]


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    times: dict[str, float]
    overlapped: bool = False  # generation overlaps scoring and training (one step off or more)

    @property
    def estimate_s(self) -> float:
        t = self.times
        if self.overlapped:
            return max(t["generation"], t["inference"] + t["training"]) + t["weight sync"]
        return sum(t.values())

    @property
    def ratio(self) -> float:
        return self.estimate_s / self.run.step_s

    @property
    def step_s(self) -> float:  # a search.Option, to weigh against plans
        return self.estimate_s

    @property
    def placement(self) -> str:
        return f"published {'split' if self.run.rollout_gpus or self.run.critic_gpus else 'colocated'}"


def estimate(run: PublishedRun, gpu: GpuSpec | None = None, eff: Efficiency | None = None) -> Comparison:
    """The planner's step time for ``run``'s model, GPUs, layouts, placement and workload."""
    gpu, eff = gpu or GPUS["h100-80gb"], eff or Efficiency()
    if run.decode_step_ms is not None:
        eff = replace(eff, decode_step_ms=run.decode_step_ms)
    if run.critic_gpus:
        return _estimate_split_ppo(run, gpu, eff)
    if run.rollout_gpus:
        return _estimate_split(run, gpu, eff)
    arch, rl = run.arch_model(), run.shape()
    # NeMo RL's vLLM defaults: gpu_memory_utilization 0.6 (grpo_math_1B.yaml), max_num_seqs 256
    inp = PlanInputs(gpu, rl, eff, max_num_seqs=256)
    rollout = rollout_at(arch, run.gpus, inp, run.rollout_utilization, run.rollout_tp)
    if rollout is None:
        raise ValueError(f"{run.name}: vLLM tp={run.rollout_tp} holds no sequence at utilization "
                         f"{run.rollout_utilization}")
    cost = TrainCost(recompute=run.recompute)
    # old log-probs of the policy and the reference's, over every generated token
    inference = 2 * steptime.forward_s(arch, run.gpus, rl, gpu, eff)
    work = Workload(micro_batch=1, seq_len=rl.seq_len, recompute=run.recompute)
    micro = max(1, rl.sequences // (run.train.dp * rl.minibatches))
    resident = trained_memory(arch, run.train, work, micro).total + inference_memory(arch, run.train, work).total
    return Comparison(run, {
        "generation": rollout.time_s,
        "inference": inference,
        "training": steptime.training_s(arch, run.train, 1, cost, rl, gpu, eff),
        "weight sync": steptime.weight_sync_s(arch, rollout.shape, True, gpu, eff),
        "offload": steptime.offload_s(resident, gpu),
    })


def _estimate_split(run: PublishedRun, gpu: GpuSpec, eff: Efficiency) -> Comparison:
    """NeMo RL's GRPO with generation on GPUs of its own: the policy and the reference score and
    train on the training GPUs (nothing offloaded), vLLM generates on the others, and the refit
    crosses the split. Run ahead (``staleness`` > 0) the phases overlap: the step is
    max(generation, inference + training) + weight sync (``Comparison.estimate_s``)."""
    arch, rl = run.arch_model(), run.shape()
    train_gpus = run.gpus - run.rollout_gpus
    inp = PlanInputs(gpu, rl, eff, max_num_seqs=256, max_staleness=run.staleness)
    rollout = rollout_at(arch, run.rollout_gpus, inp, run.rollout_utilization, run.rollout_tp)
    if rollout is None:
        raise ValueError(f"{run.name}: vLLM tp={run.rollout_tp} holds no sequence at utilization "
                         f"{run.rollout_utilization}")
    return Comparison(run, {
        "generation": rollout.time_s,
        "inference": 2 * steptime.forward_s(arch, train_gpus, rl, gpu, eff),
        "training": steptime.training_s(arch, run.train, 1, TrainCost(recompute=run.recompute), rl, gpu, eff),
        "weight sync": steptime.split_sync_s(arch, rollout.shape, train_gpus, gpu, eff),
    }, overlapped=run.staleness > 0)


def _estimate_split_ppo(run: PublishedRun, gpu: GpuSpec, eff: Efficiency) -> Comparison:
    """NeMo-Aligner's PPO: generation on the actor's GPUs in static batches, then the actor side
    (its old log-probs, the reference's) and the critic side (values, rewards) score side by side,
    then both train side by side; Adam states leave the actor's GPUs while it generates."""
    arch, rl = run.arch_model(), run.shape()
    actor_gpus = run.gpus - run.critic_gpus
    shape = RolloutShape(tp=run.rollout_tp, engines=actor_gpus // run.rollout_tp,
                         max_num_seqs=run.rollout_batch or 256, max_model_len=rl.seq_len,
                         continuous_batching=run.rollout_batch is None)
    cost = TrainCost(recompute=run.recompute)
    work = Workload(micro_batch=1, seq_len=rl.seq_len, recompute=run.recompute)
    critic = run.critic or run.train
    micro = max(1, rl.sequences // (run.train.dp * rl.minibatches))
    adam = trained_memory(arch, run.train, work, micro).components["optimizer"]
    return Comparison(run, {
        "generation": steptime.generation_s(arch, shape, rl, gpu, eff),
        "inference": 2 * max(steptime.forward_s(arch, actor_gpus, rl, gpu, eff),
                             steptime.forward_s(arch, run.critic_gpus, rl, gpu, eff)),
        "training": max(steptime.training_s(arch, run.train, 1, cost, rl, gpu, eff),
                        steptime.training_s(arch, critic, 1, cost, rl, gpu, eff)),
        "weight sync": steptime.weight_sync_s(arch, shape, True, gpu, eff),
        "offload": steptime.offload_s(adam, gpu),
    })


def format_comparison(rows: list[Comparison]) -> str:
    lines = [f"{'run':<36} {'GPUs':>4} {'workload':<38} {'published s':>11} {'estimate s':>10} {'ratio':>6}"]
    for c in rows:
        r = c.run
        work = (f"{r.prompts}x{r.samples}, seq {r.mean_seq:.0f}/{r.max_seq}, {r.minibatches} opt steps")
        lines.append(f"{r.name:<36} {r.gpus:>4} {work:<38} {r.step_s:>11.1f} {c.estimate_s:>10.1f} {c.ratio:>6.2f}")
        lines.append("      " + ", ".join(f"{k} {v:.1f}" for k, v in c.times.items()))
    return "\n".join(lines)
