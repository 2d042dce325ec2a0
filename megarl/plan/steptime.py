"""An RL step's time from FLOPs, memory bandwidth and link bandwidth (first-order estimates).

- generation: vLLM prefill is compute-bound; each decode step reads the engine's
  weights and its batch's KV cache from HBM (or is compute-bound at large batches);
- inference: forward passes of the reference, reward model, critic values and the
  actor's old log-probs over every sampled sequence;
- training: 3x forward FLOPs (4x with full recompute) per PPO epoch, stretched by the
  1F1B pipeline bubble, plus tensor-parallel all-reduces and the distributed optimizer's
  reduce-scatter/all-gather;
- weight sync: each rollout GPU receives its shard of the actor's weights;
- offload (colocated only): the Megatron roles leave the GPU for generation and return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.models.hf_arch import ModelArch
from megarl.plan.hardware import Efficiency, GpuSpec
from megarl.plan.memory import DTYPE_BYTES, Layout, RolloutShape, vllm_kv_bytes_per_token


@dataclass(frozen=True)
class RLShape:
    """One RL step's data: prompts, samples per prompt, lengths."""

    algo: str = "grpo"  # grpo (actor, reference) | ppo (+ critic, reward model)
    prompts: int = 256
    n: int = 8
    prompt_len: int = 1024
    response_len: int = 2048
    ppo_epochs: int = 1
    minibatches: int = 1

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


def active_params(arch: ModelArch) -> float:
    """Parameters one token passes through (MoE: the top-k experts only)."""
    if not arch.is_moe:
        return arch.num_parameters()
    expert = 3 * arch.hidden_size * arch.ffn_hidden_size * arch.num_layers
    return arch.num_parameters() - expert * (arch.num_experts - (arch.moe_topk or 1))


def forward_flops_per_token(arch: ModelArch, context: float) -> float:
    """2 FLOPs per active weight plus causal attention (QK^T and AV) over ``context`` tokens."""
    return 2 * active_params(arch) + 2 * arch.num_layers * arch.num_heads * arch.head_dim * context


def generation_s(arch: ModelArch, roll: RolloutShape, rl: RLShape, gpu: GpuSpec, eff: Efficiency) -> float:
    per_engine = math.ceil(rl.sequences / roll.engines)
    flops = gpu.bf16_tflops * 1e12 * roll.tp
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm_efficiency * roll.tp
    weights = arch.num_parameters() * DTYPE_BYTES[roll.dtype]
    kv_token = vllm_kv_bytes_per_token(arch, roll.tp, roll.dtype) * roll.tp
    total, left = 0.0, per_engine
    while left > 0:
        batch = min(left, roll.max_num_seqs)
        left -= batch
        total += batch * rl.prompt_len * forward_flops_per_token(arch, rl.prompt_len / 2) / (flops * eff.prefill_mfu)
        context = rl.prompt_len + rl.response_len / 2  # the average decode step's context
        read = weights + batch * context * kv_token
        compute = batch * forward_flops_per_token(arch, context) / (flops * eff.prefill_mfu)
        total += rl.response_len * max(read / hbm, compute)
    return total


def forward_s(arch: ModelArch, gpus: int, rl: RLShape, gpu: GpuSpec, eff: Efficiency) -> float:
    tokens = rl.sequences * rl.seq_len
    return tokens * forward_flops_per_token(arch, rl.seq_len / 2) / (gpus * gpu.bf16_tflops * 1e12 * eff.prefill_mfu)


def link_gbps(gpus: int, gpu: GpuSpec) -> float:
    """The slowest link a group of ``gpus`` ranks crosses: NVLink inside a node, else the NIC."""
    return gpu.nvlink_gbps if gpus <= gpu.gpus_per_node else gpu.interconnect_gbps


def training_s(arch: ModelArch, layout: Layout, micro_batch: int, recompute: str, rl: RLShape,
               gpu: GpuSpec, eff: Efficiency) -> float:
    tokens = rl.sequences * rl.seq_len * rl.ppo_epochs
    passes = 4 if recompute == "full" else 3
    compute = passes * tokens * forward_flops_per_token(arch, rl.seq_len / 2) / (
        layout.gpus * gpu.bf16_tflops * 1e12 * eff.train_mfu)
    microbatches = max(1, rl.sequences // (layout.dp * rl.minibatches * micro_batch))
    bubble = 1 + (layout.pp - 1) / (microbatches * (layout.vpp or 1))
    # distributed optimizer per optimizer step: reduce-scatter fp32 grads, all-gather bf16 params
    shard = arch.num_parameters() / (layout.tp * layout.pp)
    dp_group = layout.dp * layout.cp
    comm = (dp_group - 1) / dp_group * shard * 6 / (link_gbps(layout.gpus, gpu) * 1e9 * eff.link_efficiency)
    # tensor parallelism: 4 all-reduces (2 forward, 2 backward) of each layer's hidden states,
    # over NVLink inside a node; each pipeline stage runs its layers for the dp shard's tokens
    tp_bytes = tokens / layout.dp * arch.num_layers / layout.pp * 4 * arch.hidden_size * 2
    tp_comm = tp_bytes * 2 * (layout.tp - 1) / layout.tp / (link_gbps(layout.tp, gpu) * 1e9 * eff.link_efficiency)
    return compute * bubble + tp_comm + comm * rl.minibatches * rl.ppo_epochs


def weight_sync_s(arch: ModelArch, roll: RolloutShape, colocated: bool, gpu: GpuSpec, eff: Efficiency) -> float:
    shard = arch.num_parameters() * DTYPE_BYTES[roll.dtype] / roll.tp
    link = gpu.nvlink_gbps if colocated else gpu.interconnect_gbps
    return shard / (link * 1e9 * eff.link_efficiency)


def offload_s(bytes_per_gpu: float, gpu: GpuSpec) -> float:
    """Colocated: the Megatron roles' bytes leave the GPU before generation and come back after."""
    return 2 * bytes_per_gpu / (gpu.pcie_gbps * 1e9)
