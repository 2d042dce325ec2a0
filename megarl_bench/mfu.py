"""``megarl bench mfu``: model-FLOPs utilisation of the actor's training step.

The step is the one the actor runs (megatron-core model from megarl's builder, megatron-core DDP
and distributed Adam, next-token loss through megarl's vocab-parallel log-probs), on random
weights and random tokens of an architecture from ``megarl/plan/arch_configs`` (or any HF
``config.json``). Warm-up steps first, then ``steps`` timed steps, the device synchronised
before each clock read.

Model FLOPs per token (what MFU counts; recompute does not add to it):
  forward = 2 x (matmul parameters, output layer included) + attention, where attention is
  2 x 2 x seq x (heads x head_dim) per layer for QK^T and AV, halved because the mask is causal
  (the kernel skips the masked half); training = 3 x forward.
``mfu_full_attention`` beside it counts attention unhalved (the PaLM / Megatron-LM convention), so
the figure compares with papers that use it. Peak: the GPU's dense BF16 datasheet rate from
``megarl.plan.hardware`` (``--peak-tflops`` overrides; required on CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

TARGET_MFU = 0.45  # issue 18's goal for the actor step with Transformer Engine on one H100


@dataclass
class MfuBenchArgs:
    archs: list[str] = field(default_factory=lambda: ["llama3.2-1b", "llama3.2-3b"])
    seq: int = 4096
    micro_batch: int = 1
    microbatches: int = 1
    steps: int = 5
    warmup: int = 2
    dtype: str = "bfloat16"
    recompute: str = "none"  # none | selective | full
    peak_tflops: float | None = None
    profile: bool = False  # also profile two more steps; each row gets its top operators by device time


@dataclass(frozen=True)
class StepFlops:
    matmul_params: int  # parameters that take part in a GEMM per token, output layer included
    attention_flops_causal: int  # forward attention FLOPs per token (QK^T, AV), causal half
    seq: int

    @property
    def train_per_token(self) -> int:
        return 3 * (2 * self.matmul_params + self.attention_flops_causal)

    @property
    def train_per_token_full_attention(self) -> int:
        return 3 * (2 * self.matmul_params + 2 * self.attention_flops_causal)


def step_flops(arch, seq: int) -> StepFlops:
    """Model FLOPs of ``arch`` (a ModelArch, dense) at sequence length ``seq``."""
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h = arch.hidden_size
    per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * arch.ffn_hidden_size
    matmul = arch.num_layers * per_layer + arch.hidden_size * arch.vocab_size
    # mean over positions of a causal row: seq / 2 keys; 2 GEMMs (QK^T, AV), 2 FLOPs per MAC
    attention = arch.num_layers * 2 * 2 * q_dim * seq // 2
    return StepFlops(matmul, attention, seq)


def device_peak_tflops() -> float | None:
    """Dense BF16 peak of this machine's GPU from its name, or None (unknown GPU, or CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from megarl.plan.hardware import GPUS

    name = torch.cuda.get_device_name().lower()
    for key, gpu in GPUS.items():
        if key.split("-")[0] in name:
            return gpu.bf16_tflops
    return None


def check_args(args: MfuBenchArgs) -> None:
    from megarl.config.loader import ConfigError
    from megarl.plan.archs import load_arch

    errors = []
    for name in args.archs:
        try:
            arch = load_arch(name)
        except Exception as e:  # noqa: BLE001 - each bad name becomes one line
            errors.append(f"--arch {name}: {e}")
            continue
        if arch.is_moe:
            errors.append(f"--arch {name}: MoE FLOPs are not counted by this benchmark (dense models only)")
    if args.seq < 2 or args.micro_batch < 1 or args.microbatches < 1 or args.steps < 1 or args.warmup < 0:
        errors.append("--seq must be >= 2, --micro-batch, --microbatches and --steps >= 1, --warmup >= 0")
    if args.dtype not in ("bfloat16", "float32"):
        errors.append(f"--dtype must be bfloat16 or float32, got {args.dtype}")
    if args.recompute not in ("none", "selective", "full"):
        errors.append(f"--recompute must be none, selective or full, got {args.recompute}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        errors.append("--peak-tflops must be > 0")
    if errors:
        raise ConfigError("invalid benchmark:\n  " + "\n  ".join(errors))


def _profiled_ops(step, rows: int = 25) -> str:
    """torch.profiler's table of the top operators by device time (self CPU time on CPU) over two
    calls of ``step``: where the step's time goes, for the MFU gap."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": not ours to act on
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=activities) as prof:
            for _ in range(2):
                step()
    sort_by = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)


def train_steps_on_rank(arch_name: str, seq: int, micro_batch: int, microbatches: int, steps: int, warmup: int,
                        dtype: str, recompute: str, profile: bool = False) -> dict[str, Any]:
    """Builds the model on this rank and times ``steps`` training steps (SpmdPool rank function)."""
    import torch

    from megarl.config.schema import OptimizerConfig, ParallelConfig, PrecisionConfig, RecomputeConfig
    from megarl.distributed.parallel import megatron_parallel
    from megarl.models.gpt import ModelSpec, build_model_chunks
    from megarl.models.train import build_optimizer, lm_loss_fn, logits_forward, train_step, wrap_ddp
    from megarl.plan.archs import load_arch
    from megarl.platform import current_platform

    platform = current_platform()
    arch = load_arch(arch_name)
    spec = ModelSpec(arch, ParallelConfig(), PrecisionConfig(dtype=dtype), recompute=RecomputeConfig(recompute))
    device = platform.rank_device()
    with megatron_parallel(spec.parallel):
        try:
            chunks = wrap_ddp(build_model_chunks(spec))
            optimizer = build_optimizer(chunks, OptimizerConfig(lr=1e-5))
            g = torch.Generator().manual_seed(0)
            batches = []
            for _ in range(microbatches):
                tokens = torch.randint(0, arch.vocab_size, (micro_batch, seq + 1), generator=g).to(device)
                batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                                "loss_mask": torch.ones(micro_batch, seq, device=device)})
            loss_fn = lm_loss_fn(arch.vocab_size)
            times, losses = [], []
            if platform.is_gpu:
                torch.cuda.reset_peak_memory_stats()
            for i in range(warmup + steps):
                platform.synchronize()
                start = time.perf_counter()
                result = train_step(chunks, optimizer, batches, loss_fn, logits_forward)
                platform.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
                    losses.append(float(result.outputs[-1]["lm_loss"]))
            peak_gib = torch.cuda.max_memory_allocated() / 2**30 if platform.is_gpu else None
            ops = None
            if profile:
                def one_step():
                    train_step(chunks, optimizer, batches, loss_fn, logits_forward)
                    platform.synchronize()
                ops = _profiled_ops(one_step)
        except torch.cuda.OutOfMemoryError as e:
            return {"error": f"out of device memory: {str(e).splitlines()[0]}"}
        params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return {"seconds": sorted(times)[len(times) // 2], "all_seconds": times, "losses": losses, "params": params,
            "layer_spec": platform.layer_spec_kind,
            "peak_gib": peak_gib, "device": torch.cuda.get_device_name() if platform.is_gpu else "cpu",
            **({"profile": ops} if ops is not None else {})}


def run_mfu_bench(args: MfuBenchArgs, progress=print) -> dict[str, Any]:
    from megarl.distributed.spmd import SpmdPool
    from megarl.plan.archs import load_arch

    check_args(args)
    peak = args.peak_tflops or device_peak_tflops()
    rows = []
    for name in args.archs:
        progress(f"{name}: building the model and timing {args.warmup} + {args.steps} steps of "
                 f"{args.microbatches} x {args.micro_batch} x {args.seq} tokens...")
        with SpmdPool(1) as pool:  # a fresh process per model: device memory starts empty
            (out,) = pool.run(train_steps_on_rank, arch_name=name, seq=args.seq, micro_batch=args.micro_batch,
                              microbatches=args.microbatches, steps=args.steps, warmup=args.warmup,
                              dtype=args.dtype, recompute=args.recompute, profile=args.profile)
        row: dict[str, Any] = {"arch": name, **out}
        if "error" not in out:
            flops = step_flops(load_arch(name), args.seq)
            tokens = args.seq * args.micro_batch * args.microbatches
            row["tokens_per_s"] = tokens / out["seconds"]
            row["model_tflops"] = flops.train_per_token * row["tokens_per_s"] / 1e12
            row["model_tflops_full_attention"] = flops.train_per_token_full_attention * row["tokens_per_s"] / 1e12
            if peak:
                row["mfu"] = row["model_tflops"] / peak
                row["mfu_full_attention"] = row["model_tflops_full_attention"] / peak
                row["mfu_over_target"] = row["mfu"] / TARGET_MFU
        rows.append(row)
    return {"args": asdict(args), "peak_tflops": peak, "target_mfu": TARGET_MFU, "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    a = result["args"]
    peak = result["peak_tflops"]
    lines = [f"actor training step, {a['dtype']}, {a['microbatches']} x {a['micro_batch']} x {a['seq']} tokens, "
             f"recompute {a['recompute']}, median of {a['steps']} steps after {a['warmup']} warm-up",
             f"peak {peak} TFLOP/s dense; MFU counts causal attention as half (mfu_full: unhalved); "
             f"target MFU {result['target_mfu']:.2f}",
             f"{'arch':<14}{'params':>8}{'spec':>6}{'s/step':>8}{'tok/s':>9}{'TFLOP/s':>9}{'MFU':>7}"
             f"{'MFUfull':>8}{'/target':>8}{'peakGiB':>8}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['arch']:<14}  {r['error']}")
            continue
        mfu = f"{r['mfu']:>7.3f}{r['mfu_full_attention']:>8.3f}{r['mfu_over_target']:>8.2f}" if "mfu" in r \
            else f"{'-':>7}{'-':>8}{'-':>8}"
        mem = f"{r['peak_gib']:>8.1f}" if r["peak_gib"] is not None else f"{'-':>8}"
        lines.append(f"{r['arch']:<14}{r['params'] / 1e9:>7.2f}B{r['layer_spec']:>6}{r['seconds']:>8.3f}"
                     f"{r['tokens_per_s']:>9.0f}{r['model_tflops']:>9.1f}{mfu}{mem}")
    return "\n".join(lines)


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)


def add_parser(bs: argparse._SubParsersAction) -> None:
    p = bs.add_parser("mfu", help="model-FLOPs utilisation of the actor training step (random weights)",
                      formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    p.add_argument("--arch", default="llama3.2-1b,llama3.2-3b",
                   help="architectures, comma-separated: names from megarl/plan/arch_configs or config.json paths "
                        "(default llama3.2-1b,llama3.2-3b)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch (default 1)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per step (default 1)")
    p.add_argument("--steps", type=int, default=5, help="timed steps; the median is reported (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="parameters and compute (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation recompute (default none)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak in TFLOP/s (default: the GPU's datasheet BF16 rate; "
                        "without it on CPU no MFU is printed)")
    p.add_argument("--profile", action="store_true",
                   help="profile two more steps and print each model's top operators by device time")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run_mfu_cmd)


def run_mfu_cmd(args: argparse.Namespace) -> int:
    from megarl.platform import current_platform

    bench = MfuBenchArgs(archs=[a for a in args.arch.split(",") if a.strip()], seq=args.seq,
                         micro_batch=args.micro_batch, microbatches=args.microbatches, steps=args.steps,
                         warmup=args.warmup, dtype=args.dtype or current_platform().default_dtype,
                         recompute=args.recompute, peak_tflops=args.peak_tflops, profile=args.profile)
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    result = run_mfu_bench(bench, progress=progress)
    if not args.json:
        for row in result["rows"]:
            if "profile" in row:
                print(f"{row['arch']}: top operators over two profiled steps\n{row['profile']}")
    print(dumps(result) if args.json else format_table(result), flush=True)
    return 1 if any("error" in r for r in result["rows"]) else 0
