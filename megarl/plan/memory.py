"""Bytes per GPU of one role, by component, from the architecture and the layout.

The model counts what megarl's megatron-core setup allocates (``megarl.models.gpt``,
``megarl.models.train``):

- weights: every parameter tensor of the rank's pipeline stage, split by tensor (and
  expert) parallelism exactly as megatron-core splits it; norms and the MoE router are
  replicated; the embedding sits on the first stage, the output layer (or the value
  head) on the last; a tied output layer is a second copy on the last stage when pp > 1.
- gradients: DDP's contiguous ``main_grad`` buffer in fp32 (megarl sets
  ``grad_reduce_in_fp32``), with the distributed optimizer's padding (each parameter
  starts at a multiple of 64 elements, each bucket ends at a multiple of lcm(dp, 128)).
- optimizer: Adam's two fp32 moments, plus fp32 main parameters when the model is
  bf16/fp16; the distributed optimizer shards all of it over the data-parallel ranks
  (expert parameters over the expert-data-parallel ranks). With optimizer CPU offload
  (megatron-core's HybridDeviceOptimizer) ``offload_fraction`` of that shard lives on the
  host (``optimizer_host``, not counted against the GPU).
- activations: tensors saved for backward in one micro-batch, per layer, for the
  attention implementation in use (``flash``: Transformer Engine on GPU; ``sdpa``: the
  CPU local spec with torch's fused kernel; ``unfused``: megatron-core's own local
  attention, which keeps the s x s softmax), times the
  micro-batches a 1F1B pipeline keeps in flight on its first stage. Recompute as
  megatron-core runs it: ``selective`` drops what the recomputed modules saved (their
  inputs stay); ``full`` keeps each recomputed unit's input only, plus one unit's full
  activations while backward recomputes it (``uniform``: units of ``recompute_layers``
  layers; ``block``: the first ``recompute_layers`` layers of a stage, the rest kept).

``megarl bench memory`` measures the same quantities on real megatron-core models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from megarl.models.arch import family_of
from megarl.models.hf_arch import ModelArch
from megarl.plan.lora_memory import layer_adapter_tensors

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "sdpa", "unfused")


@dataclass(frozen=True)
class Layout:
    """One role's parallel layout; ``gpus`` = tp * pp * cp * dp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: tp (megatron-core's default)
    vpp: int | None = None
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard: a stage's tp * cp * dp ranks over etp * ep."""
        return max(1, self.tp * self.cp * self.dp // (self.expert_tp * self.ep))

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp={self.etp}")
        if self.vpp:
            parts.append(f"vpp={self.vpp}")
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What one rank of a Megatron role processes: micro-batch, sequence, precision, recompute."""

    dtype: str = "bfloat16"
    micro_batch: int = 1
    seq_len: int = 4096
    recompute: str = "none"  # none | selective (recompute_modules) | full (units' inputs only)
    attention: str = "flash"  # flash (TE, GPU) | sdpa (local spec + torch SDPA: CPU) | unfused (local spec)
    distributed_optimizer: bool = True
    recompute_method: str = "uniform"  # full: uniform | block
    recompute_layers: int = 1  # full: layers per unit (uniform) or recomputed layers per stage (block)
    recompute_modules: tuple[str, ...] = ("core_attn",)  # selective
    offload_fraction: float = 0.0  # of the optimizer shard kept on the host (0: no offload)
    lora_rank: int = 0  # > 0: LoRA, the base frozen; only the adapters train (megarl.plan.lora_memory)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} must be one of {', '.join(DTYPE_BYTES)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r} must be one of {', '.join(ATTENTION)}")

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass
class Memory:
    """Bytes on one GPU by component; ``total`` is their sum."""

    components: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.components.values())

    def add(self, other: Memory, prefix: str = "") -> Memory:
        merged = dict(self.components)
        for key, value in other.components.items():
            merged[prefix + key] = merged.get(prefix + key, 0.0) + value
        return Memory(merged)


def padded_vocab(arch: ModelArch, tp: int, pad_multiple: int = 128) -> int:
    multiple = math.lcm(pad_multiple, tp)
    return -(-arch.vocab_size // multiple) * multiple


def stage_layer_counts(num_layers: int, layout: Layout) -> list[int]:
    """Transformer layers on each pipeline stage (megatron-core's even or first/last split)."""
    pp, first, last = layout.pp, layout.first_stage_layers, layout.last_stage_layers
    if pp == 1:
        return [num_layers]
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    rest = num_layers - sum(c for c in counts if c is not None)
    middle = sum(c is None for c in counts)
    return [c if c is not None else rest // middle for c in counts]


def layer_tensors(arch: ModelArch, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
    """Element counts of one transformer layer's parameters on one rank: (dense, expert).

    The family's count (``Family.layer_params``), which ``ModelArch.num_parameters`` sums at
    tp = ep = 1: every planner path counts parameters through it."""
    return family_of(arch).layer_params(arch, tp, ep, etp)


def moe_layers(arch: ModelArch) -> int:
    """How many layers hold routed experts (all of a MoE model's, but DeepSeek-V3's first dense ones)."""
    family = family_of(arch)
    return arch.derived("moe_layers", lambda: sum(1 for i in range(arch.num_layers)
                                                  if family.layer_params_at(arch, i, 1, 1)[1]))


def stage_tensors(arch: ModelArch, layout: Layout, stage: int, value_head: bool = False,
                  pad_multiple: int = 128) -> tuple[list[int], list[int]]:
    """Parameter element counts of one rank of ``stage``: (dense, expert). The same stage's
    tensors come back for every dp, cp and micro-batch setting a search tries: counted once."""
    key = ("stage_tensors", layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.first_stage_layers,
           layout.last_stage_layers, stage, value_head, pad_multiple)
    return arch.derived(key, lambda: _stage_tensors(arch, layout, stage, value_head, pad_multiple))


def _stage_tensors(arch: ModelArch, layout: Layout, stage: int, value_head: bool,
                   pad_multiple: int) -> tuple[list[int], list[int]]:
    counts = stage_layer_counts(arch.num_layers, layout)
    first = sum(counts[:stage])
    dense, expert = [], []
    for layer in range(first, first + counts[stage]):  # layers may differ (DeepSeek-V3's first dense ones)
        one_dense, one_expert = family_of(arch).layer_params_at(arch, layer, layout.tp, layout.ep, layout.expert_tp)
        dense += one_dense
        expert += one_expert
    vocab_shard = padded_vocab(arch, layout.tp, pad_multiple) // layout.tp * arch.hidden_size
    if stage == 0:
        dense.append(vocab_shard)
    if stage == layout.pp - 1:
        dense.append(arch.hidden_size)  # final norm
        if value_head:
            dense.append(arch.hidden_size)
        elif not arch.tie_embeddings or layout.pp > 1:
            dense.append(vocab_shard)
    return dense, expert


def grad_buffer_numel(tensors: Sequence[int], dp: int, distributed_optimizer: bool) -> int:
    """Elements of DDP's grad buffer: parameter starts at multiples of 64 and the bucket end at
    a multiple of lcm(dp, 128) under the distributed optimizer (one bucket: no overlap)."""
    return _grad_buffer(_TensorCounts.of(tensors), dp, distributed_optimizer)


def _grad_buffer(counts: _TensorCounts, dp: int, distributed_optimizer: bool) -> int:
    if not counts.total or not distributed_optimizer:
        return counts.total
    divisor = math.lcm(dp, 128)
    return -(-counts.aligned_end // divisor) * divisor


@dataclass(frozen=True)
class _TensorCounts:
    """A list of tensor sizes as DDP's buffer sees it: their sum, and where the last ends with each
    starting at a multiple of 64. A plan search asks for the same stage's under thousands of
    layouts (dp, micro-batches, recompute): counted once per stage (``stage_counts``)."""

    total: int
    aligned_end: int

    @classmethod
    def of(cls, tensors: Sequence[int]) -> _TensorCounts:
        end = 0
        for n in tensors:
            end = -(-end // 64) * 64 + n
        return cls(sum(tensors), end)


def stage_counts(arch: ModelArch, layout: Layout, stage: int, value_head: bool = False,
                 pad_multiple: int = 128) -> tuple[_TensorCounts, _TensorCounts]:
    """``stage_tensors``' (dense, expert) lists, counted."""
    key = ("stage_counts", layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.first_stage_layers,
           layout.last_stage_layers, stage, value_head, pad_multiple)

    def count() -> tuple[_TensorCounts, _TensorCounts]:
        dense, expert = stage_tensors(arch, layout, stage, value_head, pad_multiple)
        return _TensorCounts.of(dense), _TensorCounts.of(expert)

    return arch.derived(key, count)


def layer_activation_bytes(arch: ModelArch, layout: Layout, work: Workload) -> float:
    """Bytes one transformer layer saves for backward in one micro-batch."""
    e, b, s = work.elem, work.micro_batch, work.seq_len // layout.cp
    tp, h, d = layout.tp, arch.hidden_size, arch.head_dim
    t = b * s  # tokens of this rank
    sp = tp if layout.sequence_parallel else 1
    heads = arch.num_heads // tp
    if work.recompute == "full":
        return t * h / sp * e  # only the layer's input; the rest is recomputed in backward
    selective = work.recompute_modules if work.recompute == "selective" else ()
    mlp = _mlp_activation_bytes(arch, layout, work, t)
    if {"mlp", "moe"} & set(selective):
        mlp = 0  # the recomputed MLP keeps only its input, which the norm's output term counts
    if work.attention == "unfused":
        # megatron-core's local spec (CPU): torch RMSNorm keeps its fp32 input, normalised
        # value and 1/rms; the linear keeps its input; k and v are expanded to every head;
        # the softmax keeps its fp32 output (and a copy in the model dtype for the bmm).
        norm = t * (8 * h + 4) + t * h * e
        attn = 4 * t * heads * d * e + s * s + 4 * s * d * e
        if "core_attn" not in selective:
            attn += b * heads * s * s * (4 + (e if e != 4 else 0))
        return 2 * norm + attn + mlp
    if work.attention == "sdpa":
        # the local spec's norms and linears, with torch's fused attention: q, k and v (k, v
        # not expanded), its output and per-row log-sum-exp, the projection's input, RoPE
        norm = t * (8 * h + 4) + t * h * e
        kv_heads = max(1, arch.num_kv_heads // tp)
        # a recomputed core keeps q, k, v (its inputs), not the log-sum-exp
        lse = 0 if "core_attn" in selective else b * heads * s * 4
        attn = (3 * heads + 2 * kv_heads) * t * d * e + lse + 4 * s * d * e
        return 2 * norm + attn + mlp
    # Transformer Engine: fused RMSNorm+linear keeps the norm input, 1/rms and its output;
    # flash attention keeps q, k, v (k, v not expanded), the output and the softmax stats.
    norm = t * h / sp * e * 2 + t * 4 / sp
    lse = 0 if "core_attn" in selective else b * heads * s * 4
    attn = t * (arch.num_heads + 2 * arch.num_kv_heads) * d // tp * e + t * heads * d * e + lse
    return 2 * norm + attn + mlp


def _mlp_activation_bytes(arch: ModelArch, layout: Layout, work: Workload, t: int) -> float:
    """What one layer's MLP saves for backward (dense SwiGLU, or routed experts)."""
    e, tp, h, ffn = work.elem, layout.tp, arch.hidden_size, arch.ffn_hidden_size
    if not arch.is_moe:
        return t * 5 * ffn // tp * e  # fc1 out (2 ffn), silu out, up half, fc2 in
    # megatron-core's MoE layer with the all-to-all dispatcher (counted from the tensors autograd
    # saves in ``megarl bench memory``'s moe case): router logits and scores (fp32); the permuted
    # tokens (top-k copies of each) entering the experts; per routed token in an expert, fc1's
    # output (2 ffn) and four ffn-wide tensors of the SwiGLU with the routing probability
    # applied inside it (megatron-core's experts weigh by the probs before fc2)
    # Each group of etp ranks runs the experts on the tokens of etp sequence-parallel shards (all of
    # the tp group's tokens when etp = tp, its own shard's when etp = 1), at ffn / etp wide.
    topk, etp = arch.moe_topk or 1, layout.expert_tp
    routed = t * topk * etp // tp
    return t * arch.num_experts * 4 * 2 + routed * (h + 6 * ffn // etp) * e + routed * 4


def head_activation_bytes(arch: ModelArch, layout: Layout, work: Workload, pad_multiple: int = 128,
                          value_head: bool = False) -> float:
    """Bytes the last stage saves after the layers: final norm, output input, the loss's softmax."""
    t = work.micro_batch * work.seq_len // layout.cp
    h, e = arch.hidden_size, work.elem
    norm = t * (8 * h + 4) + t * h * e if work.attention != "flash" else t * h * e * 2 + t * 4
    if value_head:
        return norm
    return norm + t * padded_vocab(arch, layout.tp, pad_multiple) // layout.tp * e


def logits_transient_bytes(arch: ModelArch, layout: Layout, work: Workload, pad_multiple: int = 128) -> float:
    """Live but not saved on the last stage while the loss runs: the logits and their fp32 copy."""
    t = work.micro_batch * work.seq_len // layout.cp
    return t * padded_vocab(arch, layout.tp, pad_multiple) // layout.tp * (work.elem + 4)


def in_flight_microbatches(layout: Layout, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations a 1F1B pipeline stage holds at its peak."""
    if layout.pp == 1:
        return 1.0
    held = min(layout.pp - stage, microbatches)
    if layout.vpp:  # interleaved schedule: the first stage warms up a little more
        held *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return held


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimate by stage, for comparison with measurements and for the plan."""

    params: int  # elements
    weights: float
    gradients: float
    optimizer: float
    activations_per_microbatch: float
    activations: float
    logits: float
    optimizer_host: float = 0.0  # offloaded optimizer state, in host memory

    def memory(self) -> Memory:
        return Memory({"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                       "activations": self.activations, "logits": self.logits})


def trained_rank(arch: ModelArch, layout: Layout, work: Workload, stage: int, microbatches: int = 1,
                 value_head: bool = False, pad_multiple: int = 128) -> RankMemory:
    """A trained role's memory on one rank of pipeline ``stage`` (any tp/dp rank: they match)."""
    dense, expert = base_dense, base_expert = stage_counts(arch, layout, stage, value_head, pad_multiple)
    frozen = 0.0
    if work.lora_rank:  # only the adapters train: the base is plain frozen weights, outside DDP
        layers = stage_layer_counts(arch.num_layers, layout)[stage]
        frozen = (dense.total + expert.total) * work.elem
        dense = _TensorCounts.of(layer_adapter_tensors(arch, layout.tp, work.lora_rank, work.lora_targets) * layers)
        expert = _TensorCounts(0, 0)
    dist = work.distributed_optimizer
    dense_buf = _grad_buffer(dense, layout.dp * layout.cp, dist)
    expert_buf = _grad_buffer(expert, layout.expert_dp, dist)
    e = work.elem
    # The distributed optimizer keeps the bf16 weights inside DDP's (padded) param buffer.
    weights = frozen + ((dense_buf + expert_buf) * e if dist and e != 4 else (dense.total + expert.total) * e)
    per_param = 8 + (4 if e != 4 else 0)  # Adam moments + fp32 main params for half precision
    if dist:
        optimizer = per_param * (dense_buf / (layout.dp * layout.cp) + expert_buf / layout.expert_dp)
    else:
        optimizer = per_param * (dense.total + expert.total)
    # CPU offload: megatron-core's hybrid optimizer moves this fraction of the shard's main
    # parameters and moments to the host (and steps them there)
    host = optimizer * work.offload_fraction
    optimizer -= host
    layers = stage_layer_counts(arch.num_layers, layout)[stage]
    act = stage_layer_activation_bytes(arch, layout, work, layers)
    if stage == 0:
        act += work.micro_batch * work.seq_len // layout.cp * 8  # token ids kept by the embedding
    last = stage == layout.pp - 1
    head = head_activation_bytes(arch, layout, work, pad_multiple, value_head) if last else 0.0
    # full uniform recompute reruns a unit in backward, after the head's backward has freed its part:
    # the peak is the larger of the end of forward and the first recomputed unit
    unit = _recompute_unit(arch, layout, work, layers)
    act += max(head, unit)
    held = in_flight_microbatches(layout, stage, microbatches)
    logits = logits_transient_bytes(arch, layout, work, pad_multiple) if last and not value_head else 0.0
    # in-flight micro-batches hold their saved tensors; only one unit is recomputed at a time
    activations = act + (act - unit if unit > head else act) * (held - 1)
    params = base_dense.total + base_expert.total + (dense.total if work.lora_rank else 0)
    return RankMemory(params=params, weights=weights, gradients=(dense_buf + expert_buf) * 4,
                      optimizer=optimizer, activations_per_microbatch=act, activations=activations, logits=logits,
                      optimizer_host=host)


def _recompute_unit(arch: ModelArch, layout: Layout, work: Workload, layers: int) -> float:
    """Activations of the unit full uniform recompute reruns in backward (0 otherwise: block's
    recomputed layers come after the kept ones are freed, one layer at a time)."""
    if work.recompute != "full" or work.recompute_method != "uniform" or not layers:
        return 0.0
    return min(work.recompute_layers, layers) * layer_activation_bytes(arch, layout, replace(work, recompute="none"))


def stage_layer_activation_bytes(arch: ModelArch, layout: Layout, work: Workload, layers: int) -> float:
    """Peak bytes a stage's ``layers`` layers hold for backward in one micro-batch, with recompute."""
    if work.recompute != "full" or not layers:
        return layers * layer_activation_bytes(arch, layout, work)
    unit_input = layer_activation_bytes(arch, layout, work)
    n = min(work.recompute_layers, layers)
    if work.recompute_method == "block":
        # the first n layers keep their inputs, the rest everything; backward reaches the
        # recomputed layers after freeing the kept ones, one layer at a time
        kept = layer_activation_bytes(arch, layout, replace(work, recompute="none"))
        return n * unit_input + max(layers - n, 1) * kept
    # uniform: one input per unit of n layers (the recomputed unit: see trained_rank)
    return -(-layers // n) * unit_input


def trained_memory(arch: ModelArch, layout: Layout, work: Workload, microbatches: int = 1,
                   value_head: bool = False) -> Memory:
    """The busiest pipeline stage's memory (the one that decides whether the layout fits)."""
    ranks = [trained_rank(arch, layout, work, s, microbatches, value_head) for s in range(layout.pp)]
    return max((r.memory() for r in ranks), key=lambda m: m.total)


def inference_memory(arch: ModelArch, layout: Layout, work: Workload, value_head: bool = False) -> Memory:
    """A forward-only role (reference, reward model): weights plus the live tensors of one pass."""
    peak = Memory()
    for stage in range(layout.pp):
        dense, expert = stage_tensors(arch, layout, stage, value_head)
        weights = (sum(dense) + sum(expert)) * work.elem
        # no graph is kept: about two layers' activations are live at a time
        act = 2 * layer_activation_bytes(arch, layout, replace(work, recompute="none"))
        last = stage == layout.pp - 1
        logits = 2 * logits_transient_bytes(arch, layout, work) if last and not value_head else 0.0
        mem = Memory({"weights": weights, "activations": act, "logits": logits})
        if mem.total > peak.total:
            peak = mem
    return peak


@dataclass(frozen=True)
class RolloutShape:
    tp: int = 1
    engines: int = 1
    max_num_seqs: int = 256
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    dtype: str = "bfloat16"
    max_num_batched_tokens: int = 8192
    # vLLM refills a finished sequence's slot at once; False: static batches of max_num_seqs that
    # each run until their own longest response ends (NeMo-Aligner's TRT-LLM rollout micro-batches)
    continuous_batching: bool = True
    # rollout.weights: "fp8" is vLLM's online FP8 (the layers' weights in E4M3, FP8 GEMMs);
    # "model" and "fp8_emulated" (FP8-rounded values stored dequantized) hold the rollout dtype
    weights: str = "model"


def outside_layer_params(arch: ModelArch) -> int:
    """Parameters outside the transformer layers: embeddings, an untied LM head, the final norm."""
    return arch.vocab_size * arch.hidden_size * (1 if arch.tie_embeddings else 2) + arch.hidden_size


def vllm_weight_bytes(arch: ModelArch, roll: RolloutShape, params: float) -> float:
    """Bytes of ``params`` parameters of an engine's model, the embeddings and LM head among them.

    With real FP8 rollout vLLM quantizes the layers' linear weights (MoE experts included) to
    E4M3, one byte each; their scales (one per tensor or per 128 x 128 block) and the layers'
    norms are a rounding error. Embeddings and the LM head stay in the rollout dtype.
    """
    e = DTYPE_BYTES[roll.dtype]
    if roll.weights != "fp8":
        return params * e
    outside = min(outside_layer_params(arch), params)
    return outside * e + (params - outside)


def vllm_kv_bytes_per_token(arch: ModelArch, tp: int, dtype: str) -> float:
    """KV cache bytes per token on one GPU of a TP group (KV heads are replicated below tp).
    Multi-latent attention caches one latent per token and layer (kv_lora_rank + the rope key),
    not keys and values per head, and every TP rank holds all of it."""
    mla = arch.extra.get("mla")
    if mla:
        return arch.num_layers * (mla["kv_lora_rank"] + mla["qk_rope_head_dim"]) * DTYPE_BYTES[dtype]
    kv_heads = max(arch.num_kv_heads // tp, 1)
    return 2 * arch.num_layers * kv_heads * arch.head_dim * DTYPE_BYTES[dtype]


def vllm_memory(arch: ModelArch, roll: RolloutShape, capacity_bytes: float) -> tuple[Memory, float]:
    """(vLLM's memory on one GPU, KV cache bytes it needs for max_num_seqs full sequences).

    vLLM claims ``gpu_memory_utilization`` of the device and fills what its weights and
    activation peak leave with KV cache; that claim is what sits next to other roles.
    """
    e = DTYPE_BYTES[roll.dtype]  # activations stay in the rollout dtype under FP8 weights
    weights = vllm_weight_bytes(arch, roll, arch.num_parameters()) / roll.tp
    h, ffn = arch.hidden_size, arch.ffn_hidden_size * (arch.moe_topk or 1)
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    # the profiling pass: a full batch of tokens through one layer, logits of the sampled rows
    act = roll.max_num_batched_tokens * (2 * h + (2 * ffn + qkv) / roll.tp) * e * 2 \
        + roll.max_num_seqs * arch.vocab_size / roll.tp * 4
    claimed = roll.gpu_memory_utilization * capacity_bytes
    kv = max(claimed - weights - act, 0.0)
    needed = roll.max_num_seqs * roll.max_model_len * vllm_kv_bytes_per_token(arch, roll.tp, roll.dtype)
    return Memory({"vllm_weights": weights, "vllm_activations": act, "vllm_kv_cache": kv}), needed
