"""GPU figures the planner uses: memory, dense BF16 (and FP8) FLOPs, HBM and link bandwidths.

Published datasheet numbers (SXM parts); every one can be overridden on the command
line, and the plan prints the figures it used. Memory is what the device reports
(e.g. an "80 GB" H100 reports 81559 MiB), not the marketing figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float  # device memory as reported by the driver
    bf16_tflops: float  # dense BF16 tensor-core peak
    hbm_gbps: float  # HBM bandwidth, GB/s
    nvlink_gbps: float  # per-GPU intra-node bandwidth, one direction, GB/s
    interconnect_gbps: float  # per-GPU inter-node bandwidth (InfiniBand / RoCE), GB/s
    pcie_gbps: float = 25.0  # host <-> GPU for offloading, one direction, sustained (pinned memory)
    gpus_per_node: int = 8
    fp8_tflops: float | None = None  # dense FP8 tensor-core peak; None: no FP8 tensor cores

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


GPUS: dict[str, GpuSpec] = {
    # H100 SXM5: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, NVLink4 450 GB/s per direction,
    # one 400 Gb/s NIC per GPU; 1979 TFLOPS dense FP8.
    "h100-80gb": GpuSpec("h100-80gb", 79.6, 989.0, 3350.0, 450.0, 50.0, fp8_tflops=1979.0),
    # H200 SXM: the H100's compute with 141 GB HBM3e at 4.8 TB/s.
    "h200-141gb": GpuSpec("h200-141gb", 140.4, 989.0, 4800.0, 450.0, 50.0, fp8_tflops=1979.0),
    # A100 SXM4 80GB: 312 TFLOPS dense BF16, 2.04 TB/s HBM2e, NVLink3 300 GB/s per direction,
    # one 200 Gb/s NIC per GPU; no FP8 tensor cores.
    "a100-80gb": GpuSpec("a100-80gb", 80.0, 312.0, 2039.0, 300.0, 25.0),
}


def gpu_spec(name: str, **overrides: float | None) -> GpuSpec:
    """The named GPU with the given fields replaced (None values are ignored)."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return replace(GPUS[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that real kernels reach, and fixed costs; printed and overridable.

    Calibrated against published step times (``megarl.plan.published``, checked by
    tests/test_published.py): the defaults put every published run within 30% of its figure.
    An on-policy step is the sum of its phases, which leaves open how it splits between
    generation and training; NeMo RL's one-step-off runs on the same GPUs (``published_pairs``,
    tests/test_published_pairs.py) are bound by one side, which pins it: with the earlier 0.30
    training MFU and 70% of HBM in decode, Llama-3.1-8B's training side alone (8 GPUs) came out at
    1.28x the whole measured one-step-off step, and Qwen3-32B's on-policy generation 70 s under
    what its total leaves it. The three figures marked below were fitted once, together, over
    all of those rows (no figure per row), to put every predicted speedup within 15% of NeMo RL's.
    """

    # Megatron BF16 training of a packed RL batch (fitted with the one-step-off pairs; was 0.30)
    train_mfu: float = 0.40
    prefill_mfu: float = 0.5  # vLLM prefill and Megatron forward-only passes
    # vLLM decode's share of HBM bandwidth, weights and paged KV reads together (fitted with the
    # one-step-off pairs; was 0.7)
    hbm_efficiency: float = 0.6
    link_efficiency: float = 0.7  # NCCL bus bandwidth vs link peak
    overhead_gib: float = 4.0  # per GPU: CUDA context, NCCL buffers, allocator fragmentation
    # per decode step of a vLLM engine: scheduling, sampling and launches that no bandwidth explains
    decode_step_ms: float = 4.0
    # MoE layers (token dispatch, small per-expert GEMMs) reach this share of the dense MFU in
    # training and scoring; without it the published MoE runs came out 13-35% under (fitted with
    # the one-step-off pairs, whose Qwen3-30B-A3B steps are bound by training; was 0.4 of 0.30)
    moe_mfu_factor: float = 0.25
    # torch's CPU Adam, per rank (a node's cores shared by its 8 ranks), parameters per second
    cpu_adam_params_per_s: float = 2.0e8
