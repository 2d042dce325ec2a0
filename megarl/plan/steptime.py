"""An RL step's time from FLOPs, memory bandwidth and link bandwidth (first-order estimates).

- generation: vLLM prefill is compute-bound; each decode step reads the engine's
  weights and its batch's KV cache from HBM (or is compute-bound at large batches),
  plus a fixed per-step cost. An engine decodes until its longest response ends: the
  step count follows the maximum response length, while the batch thins out as shorter
  responses finish (response lengths are spread between 0 and the maximum with the given
  mean, see ``active_fraction``);
- inference: forward passes of the reference, reward model, critic values and the
  actor's old log-probs over every sampled token (mean lengths: sequences are packed);
- training: 3x forward FLOPs per PPO epoch (a recomputed layer runs its forward again:
  4x under full recompute of every layer), stretched by the 1F1B pipeline bubble, plus
  tensor-parallel all-reduces, the distributed optimizer's reduce-scatter/all-gather and,
  with optimizer CPU offload, the host copies and the CPU Adam step of the offloaded part;
- generation run ahead (max_staleness > 0, rollout on GPUs of its own): the engines never
  drain, a step's worth of prompt groups stays in flight (``overlapped_generation_s``);
- weight sync: each rollout GPU receives its shard of the actor's weights; across a split
  the training GPUs send every engine its copy (``split_sync_s``);
- offload (colocated only): the Megatron roles leave the GPU for generation and return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.models.hf_arch import ModelArch
from megarl.plan.hardware import Efficiency, GpuSpec
from megarl.plan.memory import (
    DTYPE_BYTES,
    Layout,
    RolloutShape,
    layer_tensors,
    moe_layers,
    outside_layer_params,
    vllm_kv_bytes_per_token,
    vllm_weight_bytes,
)


@dataclass(frozen=True)
class RLShape:
    """One RL step's data: prompts, samples per prompt, lengths.

    ``response_len`` is the longest response (the generation limit); ``mean_response_len``
    the mean (None: every response runs to the limit, the worst case).
    """

    algo: str = "grpo"  # a registered algorithm; its roles: megarl.plan.roles.roles_for
    prompts: int = 256
    n: int = 8
    prompt_len: int = 1024
    response_len: int = 2048
    ppo_epochs: int = 1
    minibatches: int = 1
    mean_response_len: float | None = None

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def seq_len(self) -> int:
        """The longest sequence: what memory must hold."""
        return self.prompt_len + self.response_len

    @property
    def mean_response(self) -> float:
        return self.response_len if self.mean_response_len is None else min(self.mean_response_len,
                                                                            self.response_len)

    @property
    def mean_seq_len(self) -> float:
        """The mean sequence: what packed forward and backward passes compute over."""
        return self.prompt_len + self.mean_response


@dataclass(frozen=True)
class TrainCost:
    """What a trained role's step costs beyond its layout: recompute and optimizer offload."""

    recompute: str = "none"  # none | selective | full
    recompute_fraction: float = 1.0  # full: share of layers recomputed (block method: n / stage layers)
    offload_fraction: float = 0.0


def active_params(arch: ModelArch) -> float:
    """Parameters one token passes through (MoE: the top-k experts only)."""
    if not arch.is_moe:
        return arch.num_parameters()
    _, experts = layer_tensors(arch, 1, 1)  # every expert of one layer, whole
    per_expert = sum(experts) // arch.num_experts * moe_layers(arch)
    return arch.num_parameters() - per_expert * (arch.num_experts - (arch.moe_topk or 1))


def forward_flops_per_token(arch: ModelArch, context: float) -> float:
    """2 FLOPs per active weight plus causal attention (QK^T and AV) over ``context`` tokens."""
    return 2 * active_params(arch) + 2 * arch.num_layers * arch.num_heads * arch.head_dim * context


def active_fraction(step: float, max_len: float, mean_len: float) -> float:
    """Share of a batch's responses still decoding after ``step`` tokens.

    Lengths are taken to follow (1 - t/max)^k with k = max/mean - 1: mean ``mean_len``, and the
    longest response of a large batch reaches ``max_len`` (RL rollouts do hit the limit).
    """
    if step >= max_len:
        return 0.0
    k = max(max_len / max(mean_len, 1.0) - 1.0, 0.0)
    return (1.0 - step / max_len) ** k


def rollout_token_s(arch: ModelArch, roll: RolloutShape, context: float, gpu: GpuSpec, eff: Efficiency) -> float:
    """Compute seconds of one token through one engine at ``context`` tokens of attention.

    With real FP8 rollout the layers' GEMMs run at the GPU's FP8 rate where it has FP8 tensor
    cores (Hopper: twice BF16); elsewhere vLLM runs FP8 weights through BF16 GEMMs (Ampere's
    weight-only path), so only the bytes shrink. Attention and the LM head stay BF16.
    """
    bf16 = gpu.bf16_tflops * 1e12 * roll.tp * eff.prefill_mfu
    flops = forward_flops_per_token(arch, context)
    if roll.weights != "fp8" or not gpu.fp8_tflops:
        return flops / bf16
    gemm = 2 * (active_params(arch) - outside_layer_params(arch))
    return gemm / (gpu.fp8_tflops * 1e12 * roll.tp * eff.prefill_mfu) + (flops - gemm) / bf16


def decode_step_s(arch: ModelArch, roll: RolloutShape, active: float, context: float, gpu: GpuSpec,
                  eff: Efficiency) -> float:
    """One decode step of one engine with ``active`` sequences of ``context`` tokens."""
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm_efficiency * roll.tp
    params = float(arch.num_parameters())
    if arch.is_moe:  # a small batch touches only the experts its tokens are routed to: each expert is
        # missed by all of a layer's ``active`` tokens, top-k each (routing taken as uniform), with
        # probability (1 - k/E)^active
        touched = 1.0 - (1.0 - (arch.moe_topk or 1) / arch.num_experts) ** active
        params = active_params(arch) + (arch.num_parameters() - active_params(arch)) * touched
    weights = vllm_weight_bytes(arch, roll, params)
    kv = active * context * vllm_kv_bytes_per_token(arch, roll.tp, roll.dtype) * roll.tp
    compute = active * rollout_token_s(arch, roll, context, gpu, eff)
    return max((weights + kv) / hbm, compute) + eff.decode_step_ms / 1e3


def generation_s(arch: ModelArch, roll: RolloutShape, rl: RLShape, gpu: GpuSpec, eff: Efficiency) -> float:
    """One engine's rollout of its share of the batch (the engines run in parallel).

    Continuous batching keeps ``max_num_seqs`` sequences running while the queue lasts
    (each slot turns over every mean-length steps); then the last full batch drains until
    its longest response ends.
    """
    per_engine = math.ceil(rl.sequences / roll.engines)
    batch = min(per_engine, roll.max_num_seqs)
    longest, mean = rl.response_len, rl.mean_response
    prefill = per_engine * rl.prompt_len * rollout_token_s(arch, roll, rl.prompt_len / 2, gpu, eff)
    if not roll.continuous_batching:
        return prefill + math.ceil(per_engine / batch) * static_batch_s(arch, roll, rl, batch, gpu, eff)
    queued_steps = max(per_engine - batch, 0) * mean / batch
    full = queued_steps * decode_step_s(arch, roll, batch, rl.prompt_len + mean / 2, gpu, eff)
    chunk = max(1, longest // 256)  # integrate the tail in chunks of steps
    tail = 0.0
    for start in range(0, longest, chunk):
        mid = start + chunk / 2
        active = batch * active_fraction(mid, longest, mean)
        if active < 1.0 / per_engine:
            continue
        tail += chunk * decode_step_s(arch, roll, max(active, 1.0), rl.prompt_len + mid, gpu, eff)
    return prefill + full + tail


def live_context(rl: RLShape) -> float:
    """Mean context of the sequences decoding at once when engines run continuously: a response
    of length L is live for L steps, so the live ones are length-weighted (under the
    ``active_fraction`` distribution: prompt + max * mean / (max + mean))."""
    longest, mean = rl.response_len, rl.mean_response
    return rl.prompt_len + longest * mean / (longest + mean)


def group_span(rl: RLShape) -> float:
    """Expected decode steps a group of ``rl.n`` samples lasts: until its longest response ends."""
    longest, mean = rl.response_len, rl.mean_response
    chunk = max(1, longest // 256)
    return sum(chunk * (1.0 - (1.0 - active_fraction(start + chunk / 2, longest, mean)) ** rl.n)
               for start in range(0, longest, chunk))


def overlapped_generation_s(arch: ModelArch, roll: RolloutShape, rl: RLShape, staleness: int, gpu: GpuSpec,
                            eff: Efficiency) -> float:
    """One step's generation when the engines run ahead on GPUs of their own (max_staleness = k > 0).

    The engines never drain: up to k steps' worth of prompt groups are in flight, and a group is
    handed on (its slot refilled with the next step's) when its longest sample ends, as NeMo RL's
    async GRPO with in-flight weight updates runs (``num_prompts_per_step * max_trajectory_age_steps``
    groups in flight). A group holds its slot for ``group_span`` steps while its samples, on average
    ``mean`` of them, decode: on average ``in_flight * mean / span`` sequences decode at once, at
    most ``max_num_seqs`` (beyond that vLLM refills a slot per sequence from its queue). The step's
    tokens at that batch set the time; the drained tail of the lockstep batch is gone.
    """
    per_engine = math.ceil(rl.sequences / roll.engines)
    mean = rl.mean_response
    active = max(1.0, min(float(roll.max_num_seqs), per_engine * staleness * mean / group_span(rl)))
    prefill = per_engine * rl.prompt_len * rollout_token_s(arch, roll, rl.prompt_len / 2, gpu, eff)
    return prefill + per_engine * mean / active * decode_step_s(arch, roll, active, live_context(rl), gpu, eff)


def megatron_mfu(arch: ModelArch, mfu: float, eff: Efficiency) -> float:
    """A Megatron pass's MFU: MoE layers reach a fraction of the dense figure."""
    return mfu * (eff.moe_mfu_factor if arch.is_moe else 1.0)


def static_batch_s(arch: ModelArch, roll: RolloutShape, rl: RLShape, batch: int, gpu: GpuSpec,
                   eff: Efficiency) -> float:
    """Decode of one static batch: it runs while any of its ``batch`` responses does, so its
    length is the batch's longest (the expectation of the maximum of ``batch`` draws)."""
    longest, mean = rl.response_len, rl.mean_response
    chunk = max(1, longest // 256)
    total = 0.0
    for start in range(0, longest, chunk):
        mid = start + chunk / 2
        alive = active_fraction(mid, longest, mean)
        running = 1.0 - (1.0 - alive) ** batch  # P(some response of the batch still decodes)
        if running < 1e-6:
            continue
        active = max(1.0, batch * alive / running)  # responses decoding, given the batch still runs
        total += chunk * running * decode_step_s(arch, roll, active, rl.prompt_len + mid, gpu, eff)
    return total


def forward_s(arch: ModelArch, gpus: int, rl: RLShape, gpu: GpuSpec, eff: Efficiency) -> float:
    tokens = rl.sequences * rl.mean_seq_len
    return tokens * forward_flops_per_token(arch, rl.mean_seq_len / 2) / (
        gpus * gpu.bf16_tflops * 1e12 * megatron_mfu(arch, eff.prefill_mfu, eff))


def link_gbps(gpus: int, gpu: GpuSpec) -> float:
    """The slowest link a group of ``gpus`` ranks crosses: NVLink inside a node, else the NIC."""
    return gpu.nvlink_gbps if gpus <= gpu.gpus_per_node else gpu.interconnect_gbps


def training_s(arch: ModelArch, layout: Layout, micro_batch: int, cost: TrainCost | str, rl: RLShape,
               gpu: GpuSpec, eff: Efficiency) -> float:
    if isinstance(cost, str):
        cost = TrainCost(recompute=cost)
    tokens = rl.sequences * rl.mean_seq_len * rl.ppo_epochs
    # backward is twice the forward; a fully recomputed layer runs its forward once more, a
    # selective one only its attention core (the s^2 part)
    passes = 3.0
    if cost.recompute == "full":
        passes += cost.recompute_fraction
    per_token = forward_flops_per_token(arch, rl.mean_seq_len / 2)
    if cost.recompute == "selective":
        passes += 2 * arch.num_layers * arch.num_heads * arch.head_dim * rl.mean_seq_len / 2 / per_token
    # the routed experts' GEMMs run at their roofline share: few rows per expert make them read
    # weights more than they multiply (expert_gemm_efficiency)
    routed = routed_flops_per_token(arch)
    per_token += routed * (1 / expert_gemm_efficiency(arch, layout, micro_batch * rl.mean_seq_len, gpu, eff) - 1)
    compute = passes * tokens * per_token / (layout.gpus * gpu.bf16_tflops * 1e12 * megatron_mfu(arch, eff.train_mfu,
                                                                                                 eff))
    microbatches = max(1, rl.sequences // (layout.dp * rl.minibatches * micro_batch))
    bubble = 1 + (layout.pp - 1) / (microbatches * (layout.vpp or 1))
    # distributed optimizer per optimizer step: reduce-scatter fp32 grads, all-gather bf16 params;
    # dense shards over the dp * cp replicas, expert shards over the expert-data-parallel ones
    experts = expert_params(arch)
    shard = (arch.num_parameters() - experts) / (layout.tp * layout.pp)
    expert_shard = experts / (layout.expert_tp * layout.ep * layout.pp)
    dp_group, edp = layout.dp * layout.cp, layout.expert_dp
    # megatron-core orders ranks tp, cp, dp, pp: a dp group spans tp * cp * dp consecutive GPUs
    dp_link = link_gbps(layout.tp * dp_group, gpu) * 1e9 * eff.link_efficiency
    comm = ((dp_group - 1) / dp_group * shard + (edp - 1) / edp * expert_shard) * 6 / dp_link
    # pipeline: each micro-batch's activations go forward and their gradients back over every
    # stage boundary; the slowest boundary (across nodes once the pipeline leaves one) sets the pace
    p2p = 0.0
    if layout.pp > 1:
        mb_bytes = micro_batch * rl.mean_seq_len / layout.cp / layout.tp * arch.hidden_size * 2
        p2p = 2 * microbatches * rl.minibatches * rl.ppo_epochs * mb_bytes / (
            link_gbps(layout.gpus, gpu) * 1e9 * eff.link_efficiency)
    # tensor parallelism: 4 all-reduces (2 forward, 2 backward) of each layer's hidden states,
    # over NVLink inside a node; each pipeline stage runs its layers for the dp shard's tokens.
    # An MoE layer's MLP half is the token exchange instead (moe_token_exchange_s).
    tp_bytes = tokens / (layout.dp * layout.cp) * arch.num_layers / layout.pp * 4 * arch.hidden_size * 2
    if arch.is_moe:
        tp_bytes /= 2
    tp_comm = tp_bytes * 2 * (layout.tp - 1) / layout.tp / (link_gbps(layout.tp, gpu) * 1e9 * eff.link_efficiency)
    steps = rl.minibatches * rl.ppo_epochs
    return (compute * bubble + tp_comm + context_parallel_exchange_s(arch, layout, tokens, gpu, eff) + p2p
            + moe_token_exchange_s(arch, layout, tokens, gpu, eff)
            + (comm + optimizer_offload_s(arch, layout, cost, gpu, eff)) * steps)


def context_parallel_exchange_s(arch: ModelArch, layout: Layout, tokens: float, gpu: GpuSpec,
                                eff: Efficiency) -> float:
    """Context parallelism's traffic, per rank, not overlapped with compute (conservative): every
    layer each rank receives the keys and values of the other cp - 1 shares of its sequences
    (bf16, its tp share of the query groups) and, backward, sends their gradients the same way."""
    if layout.cp == 1:
        return 0.0
    kv = 2 * arch.num_kv_heads * arch.head_dim / layout.tp * 2  # keys and values of one token, bf16
    per_layer = tokens / layout.dp * (layout.cp - 1) / layout.cp * kv
    return 2 * per_layer * arch.num_layers / layout.pp / (
        link_gbps(layout.tp * layout.cp, gpu) * 1e9 * eff.link_efficiency)


def expert_params(arch: ModelArch) -> float:
    """The routed experts' parameters, all layers (0 for a dense model)."""
    if not arch.is_moe:
        return 0.0
    _, experts = layer_tensors(arch, 1, 1)
    return float(sum(experts) * moe_layers(arch))


def routed_flops_per_token(arch: ModelArch) -> float:
    """Forward FLOPs of the top-k routed experts' weights per token (0 for a dense model)."""
    if not arch.is_moe:
        return 0.0
    return 2 * expert_params(arch) / arch.num_experts * (arch.moe_topk or 1)


def expert_gemm_efficiency(arch: ModelArch, layout: Layout, micro_batch_tokens: float, gpu: GpuSpec,
                           eff: Efficiency) -> float:
    """The share of tensor-core speed one rank's expert GEMMs reach, by the roofline.

    A micro-batch's tokens on a rank (its sequence-parallel shard) join those of the other
    ranks of its expert group (ep * etp of them) and split over the experts, top-k each: each
    expert's fc1 ``[rows, H] x [H, 2I/etp]`` and fc2 ``[rows, I/etp] x [I/etp, H]`` reads its
    whole weight for ``rows`` rows. Below ~peak FLOPs / HBM bytes rows (~420 on an H100 at 70%
    of its HBM) that read, not the multiply, sets the time. This is why expert parallelism pays
    on few GPUs: at ep = 1 each of a layer's 128 experts sees a sixteenth of a top-8 micro-batch,
    at ep = 8 half of it. 1 for a dense model."""
    if not arch.is_moe:
        return 1.0
    hidden, etp = arch.hidden_size, layout.expert_tp
    inter = arch.ffn_hidden_size / etp  # a MoE architecture's ffn_hidden_size is each expert's
    rows = (micro_batch_tokens / (layout.tp * layout.cp) * layout.ep * etp * (arch.moe_topk or 1)
            / arch.num_experts)
    compute = memory = 0.0
    for k, n in ((hidden, 2 * inter), (inter, hidden)):
        compute += 2 * rows * k * n / (gpu.bf16_tflops * 1e12)
        memory += 2 * (rows * k + k * n + rows * n) / (gpu.hbm_gbps * 1e9 * eff.hbm_efficiency)
    return compute / max(compute, memory)


def moe_token_exchange_s(arch: ModelArch, layout: Layout, tokens: float, gpu: GpuSpec, eff: Efficiency) -> float:
    """megatron-core's all-to-all dispatcher, per MoE layer and rank: each of the rank's tokens
    (its sequence-parallel shard) goes in top-k copies to the ranks of their experts and back
    (dispatch and combine, forward and backward: 4 exchanges; (ep-1)/ep of the copies leave the
    rank), then the etp ranks splitting each expert all-gather their tokens and reduce-scatter
    the outputs (4 more, (etp-1) shares each). etp = 1 keeps the second part off the wire."""
    if not arch.is_moe:
        return 0.0
    per_rank = tokens / layout.dp / layout.tp * arch.num_layers / layout.pp * (arch.moe_topk or 1)
    copy = arch.hidden_size * 2  # bf16 hidden states
    ep, etp = layout.ep, layout.expert_tp
    a2a = 4 * per_rank * copy * (ep - 1) / ep / (link_gbps(etp * ep, gpu) * 1e9 * eff.link_efficiency)
    gather = 4 * per_rank * copy * (etp - 1) / (link_gbps(etp, gpu) * 1e9 * eff.link_efficiency)
    return a2a + gather


def optimizer_offload_s(arch: ModelArch, layout: Layout, cost: TrainCost, gpu: GpuSpec, eff: Efficiency) -> float:
    """Per optimizer step with CPU offload: the offloaded shard's fp32 grads down and updated
    params up over PCIe, and torch's CPU Adam over it (GPU Adam on the rest is negligible)."""
    if cost.offload_fraction <= 0:
        return 0.0
    shard = arch.num_parameters() / (layout.tp * layout.pp * layout.dp * layout.cp) * cost.offload_fraction
    return shard * 8 / (gpu.pcie_gbps * 1e9) + shard / eff.cpu_adam_params_per_s


def weight_sync_s(arch: ModelArch, roll: RolloutShape, colocated: bool, gpu: GpuSpec, eff: Efficiency) -> float:
    # real FP8 rollout too: the sync sends unquantized weights, vLLM quantizes them on arrival
    shard = arch.num_parameters() * DTYPE_BYTES[roll.dtype] / roll.tp
    link = gpu.nvlink_gbps if colocated else gpu.interconnect_gbps
    return shard / (link * 1e9 * eff.link_efficiency)


def split_sync_s(arch: ModelArch, roll: RolloutShape, train_gpus: int, gpu: GpuSpec, eff: Efficiency) -> float:
    """The refit across a split: every engine receives the whole model (each of its tp GPUs its
    shard) from the ``train_gpus`` training GPUs, which send the engines' copies between them; the
    slower side sets the time, over NVLink when both sides share a node, else the NIC."""
    total = arch.num_parameters() * DTYPE_BYTES[roll.dtype] * roll.engines
    link = link_gbps(train_gpus + roll.engines * roll.tp, gpu) * 1e9 * eff.link_efficiency
    return max(total / (roll.engines * roll.tp), total / train_gpus) / link


def offload_s(bytes_per_gpu: float, gpu: GpuSpec) -> float:
    """Colocated: the Megatron roles' bytes leave the GPU before generation and come back after."""
    return 2 * bytes_per_gpu / (gpu.pcie_gbps * 1e9)
