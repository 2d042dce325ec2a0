"""``megarl bench scaling``: strong and weak scaling of the training step and the weight sync.

For each rank count N (default 1, 2, 4, 8) one WorkerGroup of N ranks (Ray places
them: one machine here, a cluster there; gloo on CPU, NCCL on GPU) times:

- the actor's training step (forward, backward, gradient reduction, Adam) of a
  llama-like megatron-core model with random weights, in each mode:
    dp-strong  one global batch split over N data-parallel ranks;
    dp-weak    a fixed batch per rank, so the global batch grows with N;
    tp-strong  the same global batch, the model split over N tensor-parallel ranks;
    pp-strong  the same global batch, the layers split over N pipeline stages;
- the weight sync (megarl's converter) from that actor, split tp=N, into one vLLM
  engine started once for all N, against the raw transfer of the same bytes
  between the same pairs of ranks (the two interleaved, so noise slows both).

Efficiency is throughput per rank relative to the smallest rank count N0:
speedup = throughput(N) / throughput(N0), efficiency = speedup * N0 / N. With a
fixed global batch (strong) that is T0*N0 / (N*TN); with fixed work per rank
(weak) it is T0 / TN. The weight sync moves the same bytes at every N; its
efficiency is raw transfer time / sync time (1.0: the converter costs nothing
over moving the bytes).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from megarl.config.schema import ParallelConfig
from megarl.utils.cores import usable_cores

MODES = ("dp-strong", "dp-weak", "tp-strong", "pp-strong")
DEFAULT_MODES = ("dp-strong", "dp-weak", "tp-strong")
SYNC_CURVE = "weight-sync"
_SYNC_KEY = "scaling_sync"


@dataclass
class ScalingArgs:
    ranks: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = DEFAULT_MODES
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    ffn: int | None = None  # default 4 * hidden
    vocab: int = 2048
    seq_len: int = 128
    micro_batch: int = 2
    global_batch: int | None = None  # sequences per step in strong modes; default micro_batch * lcm(ranks)
    warmup: int = 1
    repeats: int = 4
    dtype: str | None = None  # default: bfloat16 on GPU, float32 on CPU
    sync: bool = True
    rollout_tp: int = 1
    bucket_mib: float = 64.0

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def strong_batch(self) -> int:
        if self.global_batch is not None:
            return self.global_batch
        return self.micro_batch * math.lcm(*self.ranks)

    @property
    def weak_batch_per_rank(self) -> int:
        """Sequences per rank in dp-weak: the per-rank share of dp-strong at the largest N."""
        return self.strong_batch // max(self.ranks)


# --------------------------------------------------------------------------- pure parts


def hf_config(args: ScalingArgs) -> dict[str, Any]:
    """The llama config of the benchmark model (what vLLM reads; megarl parses it into a ModelArch)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
        "hidden_size": args.hidden, "intermediate_size": args.ffn_size, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
        "head_dim": args.hidden // args.heads if args.heads else 0,
        "max_position_embeddings": max(args.seq_len + 1, 256), "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": args.dtype or "float32",
    }


def layout(mode: str, ranks: int) -> ParallelConfig:
    """The megatron-core layout of ``mode`` on ``ranks`` ranks."""
    if mode.startswith("dp-"):
        return ParallelConfig(world_size=ranks)
    if mode == "tp-strong":
        return ParallelConfig(tp=ranks, world_size=ranks)
    if mode == "pp-strong":
        return ParallelConfig(pp=ranks, world_size=ranks)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def sequences_per_replica(args: ScalingArgs, mode: str, ranks: int) -> int:
    """Sequences one data-parallel replica trains on per step in ``mode`` at ``ranks`` ranks."""
    if mode == "dp-strong":
        return args.strong_batch // ranks
    if mode == "dp-weak":
        return args.weak_batch_per_rank
    return args.strong_batch  # tp/pp: one replica holds the whole global batch


def tokens_per_step(args: ScalingArgs, mode: str, ranks: int) -> int:
    replicas = ranks if mode.startswith("dp-") else 1
    return replicas * sequences_per_replica(args, mode, ranks) * args.seq_len


def scaling_rows(points: Sequence[tuple[int, float, float]]) -> list[dict[str, float]]:
    """Per (ranks, seconds, work per step) point: throughput, speedup and efficiency vs the fewest ranks.

    speedup = throughput(N) / throughput(N0); efficiency = speedup * N0 / N. Work per step
    fixed (strong scaling) gives T0*N0 / (N*TN); work growing with N (weak) gives T0 / TN.
    """
    if not points:
        return []
    ordered = sorted(points)
    base_ranks, base_seconds, base_work = ordered[0]
    base_rate = base_work / base_seconds
    rows = []
    for ranks, seconds, work in ordered:
        speedup = (work / seconds) / base_rate
        rows.append({"ranks": ranks, "seconds": seconds, "work": work, "per_second": work / seconds,
                     "speedup": speedup, "efficiency": speedup * base_ranks / ranks})
    return rows


def sync_rows(points: Sequence[dict[str, float]]) -> list[dict[str, float]]:
    """Per rank count: GB/s of the sync and of the raw transfer, efficiency (raw / sync), time vs N0."""
    ordered = sorted(points, key=lambda p: p["ranks"])
    rows = []
    for p in ordered:
        rows.append({**p, "gb_per_s": p["bytes"] / p["sync_seconds"] / 1e9,
                     "raw_gb_per_s": p["bytes"] / p["raw_seconds"] / 1e9,
                     "efficiency": p["raw_seconds"] / p["sync_seconds"],
                     "speedup": ordered[0]["sync_seconds"] / p["sync_seconds"]})
    return rows


def machine_description() -> dict[str, Any]:
    """What the numbers ran on: this node's cores, the backend, and the GPUs if any."""
    import torch

    from megarl.platform import current_platform

    platform = current_platform()
    cores = usable_cores()
    info: dict[str, Any] = {"cores": cores, "backend": platform.backend, "device": platform.name}
    if hasattr(os, "getloadavg"):  # other work on the machine slows every rank count differently
        info["load_average_1min"] = round(os.getloadavg()[0], 2)
    if platform.is_gpu:
        info["gpus"] = torch.cuda.device_count()
        info["gpu_name"] = torch.cuda.get_device_name(0)
    return info


def check_args(args: ScalingArgs) -> list[str]:
    """Every problem with ``args``, each naming its option (empty: the benchmark can start)."""
    from megarl.models.hf_arch import ArchError, arch_from_hf_config
    from megarl.models.layout import parallel_errors

    errors = []
    if not args.ranks or any(r < 1 for r in args.ranks) or len(set(args.ranks)) != len(args.ranks):
        errors.append(f"--ranks must be distinct positive integers, got {list(args.ranks)}")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        errors.append(f"--modes: unknown mode(s) {unknown}; modes: {', '.join(MODES)}")
    positive = {"--hidden": args.hidden, "--layers": args.layers, "--heads": args.heads, "--vocab": args.vocab,
                "--seq-len": args.seq_len, "--micro-batch": args.micro_batch, "--repeats": args.repeats,
                "--rollout-tp": args.rollout_tp, "--ffn": args.ffn_size}
    errors += [f"{name}={value} must be >= 1" for name, value in positive.items() if value < 1]
    if args.warmup < 0:
        errors.append(f"--warmup={args.warmup} must be >= 0")
    if args.bucket_mib <= 0:
        errors.append(f"--bucket-mb={args.bucket_mib} must be > 0")
    if args.dtype not in (None, "float32", "bfloat16"):
        errors.append(f"--dtype={args.dtype!r} must be float32 or bfloat16")
    if errors:
        return errors
    if args.hidden % args.heads:
        return [f"--heads={args.heads} does not divide --hidden={args.hidden}"]
    if args.sync and args.hidden // args.heads < 32:
        errors.append(f"--hidden/--heads = head dim {args.hidden // args.heads}: vLLM's CPU attention needs "
                      ">= 32 (pass fewer --heads, or --no-sync)")
    try:
        arch = arch_from_hf_config(hf_config(args), source="the benchmark model (--hidden, --heads, ...)")
    except ArchError as e:
        return errors + [str(e)]
    batch = args.strong_batch
    if batch % args.micro_batch:
        errors.append(f"--global-batch={batch} is not a multiple of --micro-batch={args.micro_batch}")
    for ranks in args.ranks:
        for mode in args.modes:
            errors += [e.replace("--layout.", f"--modes {mode} at {ranks} ranks: ")
                       for e in parallel_errors(arch, layout(mode, ranks), "--layout")]
            per_replica = sequences_per_replica(args, mode, ranks)
            if per_replica < 1 or per_replica % args.micro_batch or (
                    mode == "dp-strong" and batch % ranks):
                errors.append(f"--modes {mode} at {ranks} ranks: the global batch of {batch} sequences does not "
                              f"split into micro-batches of {args.micro_batch} per rank (pass --global-batch, "
                              f"a multiple of --micro-batch x each rank count)")
        if args.sync:
            errors += [e.replace("--sync.", f"weight sync (actor tp={ranks}): ")
                       for e in parallel_errors(arch, ParallelConfig(tp=ranks, world_size=ranks), "--sync")]
    if args.sync and args.heads % args.rollout_tp:
        errors.append(f"--rollout-tp={args.rollout_tp} does not divide --heads={args.heads}")
    return errors


# --------------------------------------------------------------------------- driver


def run_scaling(args: ScalingArgs, progress: Callable[..., None] = print) -> dict[str, Any]:
    """Runs the benchmark; returns the result (see ``format_tables``). Raises ConfigError on bad args."""
    import ray

    from megarl.cluster.ray_env import ensure_ray
    from megarl.config.loader import ConfigError
    from megarl.platform import current_platform

    errors = check_args(args)
    if errors:
        raise ConfigError("invalid benchmark:\n  " + "\n  ".join(errors))
    platform = current_platform()
    dtype = args.dtype or platform.default_dtype
    config = hf_config(args) | {"torch_dtype": dtype}
    ensure_ray()
    if platform.is_gpu:
        _check_gpus(args, ray.cluster_resources().get("GPU", 0))
    started = time.perf_counter()
    load_at_start = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    engine, model_dir = (_start_vllm(config, args, dtype, progress) if args.sync else (None, None))
    curves: dict[str, list[tuple[int, float, float]]] = {m: [] for m in args.modes}
    step_times: dict[str, dict[int, list[float]]] = {m: {} for m in args.modes}
    sync_points: list[dict[str, float]] = []
    threads: dict[int, int] = {}
    try:
        for ranks in sorted(args.ranks):
            progress(f"[{time.perf_counter() - started:.0f} s] starting {ranks} rank(s)...")
            _run_rank_count(args, ranks, config, dtype, engine, curves, step_times, sync_points, threads, progress)
    finally:
        if engine is not None:
            ray.kill(engine)
        if model_dir is not None:
            import shutil

            shutil.rmtree(model_dir, ignore_errors=True)
    from megarl.models.hf_arch import arch_from_hf_config

    machine = machine_description() | {"load_average_1min_at_start": load_at_start}
    return {
        "machine": machine, "dtype": dtype,
        "args": asdict(args) | {"ffn": args.ffn_size, "global_batch": args.strong_batch},
        "params": arch_from_hf_config(config).num_parameters(), "threads_per_rank": threads,
        "train": {mode: scaling_rows(points) for mode, points in curves.items()},
        "step_seconds": step_times,
        "sync": sync_rows(sync_points) if args.sync else None,
        "wall_seconds": time.perf_counter() - started,
    }


def _check_gpus(args: ScalingArgs, gpus: float) -> None:
    from megarl.config.loader import ConfigError

    need = max(args.ranks) + (args.rollout_tp if args.sync else 0)
    if need > gpus:
        raise ConfigError(f"--ranks up to {max(args.ranks)}" + (f" plus the vLLM engine (--rollout-tp "
                          f"{args.rollout_tp})" if args.sync else "") + f" need {need} GPUs; Ray has {gpus:g} "
                          "(pass smaller --ranks, or --no-sync)")


def _start_vllm(config: dict[str, Any], args: ScalingArgs, dtype: str, progress) -> tuple[Any, str]:
    """One engine for every rank count: the model's config only, weights random (the sync overwrites them)."""
    import tempfile

    from megarl.rollout.remote import start_engine, wait_ready
    from megarl_bench.reference_engine import ReferenceTransferEngine

    model_dir = tempfile.mkdtemp(prefix="megarl-scaling-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    progress(f"starting vLLM (tp={args.rollout_tp}) for the weight sync...")
    engine = start_engine(model_dir, tp=args.rollout_tp, dtype=dtype, max_model_len=256, max_num_seqs=4,
                          engine_class=ReferenceTransferEngine,
                          load_format="dummy")
    try:
        wait_ready([engine])
    except BaseException:
        import ray

        ray.kill(engine)
        raise
    return engine, model_dir


def _run_rank_count(args: ScalingArgs, ranks: int, config: dict[str, Any], dtype: str, engine: Any,
                    curves: dict, step_times: dict, sync_points: list, threads: dict, progress) -> None:
    from megarl.models.hf_arch import arch_from_hf_config
    from megarl.platform import current_platform
    from megarl.workers import WorkerGroup
    from megarl_bench import scaling_fns

    arch = arch_from_hf_config(config).to_dict()
    group = WorkerGroup("scaling", ranks, num_gpus_per_rank=current_platform().gpus_per_rank)
    try:
        for mode in args.modes:
            per_replica = sequences_per_replica(args, mode, ranks)
            result = group.run(scaling_fns.time_train_steps, arch=arch, parallel=layout(mode, ranks), dtype=dtype,
                               seq_len=args.seq_len, micro_batch=args.micro_batch,
                               micro_batches=per_replica // args.micro_batch, warmup=args.warmup,
                               repeats=args.repeats)[0]
            seconds = statistics.median(result["seconds"])
            threads[ranks] = result["threads"]
            step_times[mode][ranks] = result["seconds"]
            curves[mode].append((ranks, seconds, tokens_per_step(args, mode, ranks)))
            progress(f"  {mode} at {ranks} rank(s): step {seconds:.3f} s (median of {args.repeats})")
        if engine is not None:
            sync_points.append(_time_sync(args, group, ranks, arch, dtype, engine, progress))
    finally:
        group.shutdown()


def _time_sync(args: ScalingArgs, group, ranks: int, arch: dict[str, Any], dtype: str, engine: Any,
               progress) -> dict[str, float]:
    from megarl.workers.weight_sync import WeightSync
    from megarl_bench import scaling_fns
    from megarl_bench.reference_transfers import raw_transfer_seconds

    group.run(scaling_fns.hold_random_model, key=_SYNC_KEY, arch=arch,
              parallel=ParallelConfig(tp=ranks, world_size=ranks), dtype=dtype)
    sync = WeightSync(group, _SYNC_KEY, [engine], bucket_bytes=int(args.bucket_mib * 2**20))
    sync.setup()
    try:
        for _ in range(max(1, args.warmup)):  # at least one: one-time allocations on both sides
            first = sync.sync()
            raw_transfer_seconds(sync)
        sync_s, raw_s = [], []
        for _ in range(args.repeats):
            sync_s.append(sync.sync().seconds)
            raw_s.append(raw_transfer_seconds(sync))
    finally:
        sync.close()
    point = {"ranks": ranks, "bytes": sum(first.received.values()), "sync_seconds": statistics.median(sync_s),
             "raw_seconds": statistics.median(raw_s), "bytes_ratio": first.bytes_ratio}
    progress(f"  weight sync from tp={ranks}: {point['sync_seconds']:.3f} s, raw {point['raw_seconds']:.3f} s")
    return point


# --------------------------------------------------------------------------- output


def _machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    where = (f"{m['gpus']} x {m['gpu_name']} on this node, NCCL" if m["device"] == "cuda"
             else f"CPU, gloo, {m['cores']} cores on this node")
    over = [n for n in result["args"]["ranks"] if m["device"] != "cuda" and n > m["cores"]]
    note = (f"; {', '.join(map(str, over))} ranks oversubscribe the {m['cores']} cores, so their "
            "efficiency falls" if over else "")
    threads = ", ".join(f"{n}:{t}" for n, t in sorted(result["threads_per_rank"].items()))
    line = f"machine: {where}{note} (torch threads per rank, by rank count: {threads})"
    if "load_average_1min" in m:  # busy machines slow each rank count differently: say how busy it was
        line += (f"\nload: 1-min load average {m.get('load_average_1min_at_start')} at start, "
                 f"{m['load_average_1min']:g} at the end (the benchmark's own ranks included)")
    return line


_MODE_TEXT = {
    "dp-strong": "global batch of {gb} sequences split over N data-parallel ranks; efficiency = {strong}",
    "dp-weak": "{wb} sequences per rank, global batch N*{wb}; efficiency = {weak}",
    "tp-strong": "global batch of {gb} sequences, model split over N tensor-parallel ranks; efficiency = {strong}",
    "pp-strong": "global batch of {gb} sequences, layers split over N pipeline stages; efficiency = {strong}",
}


def _formulas(n0: int) -> dict[str, str]:
    """The efficiency formulas relative to the fewest ranks ``n0``, as printed."""
    strong = "T1/(N*TN)" if n0 == 1 else f"{n0}*T{n0}/(N*TN)"
    return {"strong": strong, "weak": f"T{n0}/TN"}


def format_tables(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"megarl bench scaling: llama-like {result['params'] / 1e6:.2f}M params (hidden {a['hidden']}, "
        f"{a['layers']} layers, {a['heads']} heads, ffn {a['ffn']}, vocab {a['vocab']}), {result['dtype']}, "
        f"seq {a['seq_len']}, micro-batch {a['micro_batch']}; median of {a['repeats']} steps after "
        f"{a['warmup']} warm-up",
        _machine_line(result),
    ]
    for mode, rows in result["train"].items():
        lines += ["", f"training step, {mode}: " + _MODE_TEXT[mode].format(
            gb=a["global_batch"], wb=a["global_batch"] // max(a["ranks"]), **_formulas(min(a["ranks"])))]
        lines.append(f"{'ranks':>5} | {'step s':>8} | {'tokens/s':>10} | {'speedup':>7} | {'efficiency':>10}")
        for r in rows:
            lines.append(f"{r['ranks']:>5} | {r['seconds']:>8.3f} | {r['per_second']:>10.0f} | "
                         f"{r['speedup']:>7.2f} | {r['efficiency']:>10.2f}")
    if result["sync"]:
        rows = result["sync"]
        lines += ["", f"weight sync, actor tp=N -> vLLM tp={a['rollout_tp']} (same bytes at every N); "
                      "efficiency = raw transfer time / sync time"]
        lines.append(f"{'ranks':>5} | {'bytes':>10} | {'sync s':>8} | {'GB/s':>7} | {'raw s':>8} | "
                     f"{'raw GB/s':>8} | {'efficiency':>10} | {'T' + str(rows[0]['ranks']) + '/TN':>6}")
        for r in rows:
            lines.append(f"{r['ranks']:>5} | {r['bytes'] / 2**20:>6.1f} MiB | {r['sync_seconds']:>8.3f} | "
                         f"{r['gb_per_s']:>7.3f} | {r['raw_seconds']:>8.3f} | {r['raw_gb_per_s']:>8.3f} | "
                         f"{r['efficiency']:>10.2f} | {r['speedup']:>6.2f}")
    lines += ["", f"total {result['wall_seconds']:.0f} s"]
    return "\n".join(lines)


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=True)


def write_outputs(result: dict[str, Any], out: str) -> list[str]:
    """scaling.json and scaling.png under ``out``; returns the paths written."""
    from megarl_bench.scaling_plot import plot_efficiency

    os.makedirs(out, exist_ok=True)
    json_path = os.path.join(out, "scaling.json")
    with open(json_path, "w") as f:
        f.write(dumps(result))
    png_path = os.path.join(out, "scaling.png")
    plot_efficiency(result, png_path)
    return [json_path, png_path]


def progress_printer(to_stderr: bool) -> Callable[..., None]:
    if to_stderr:
        return lambda *a: print(*a, file=sys.stderr, flush=True)
    return lambda *a: print(*a, flush=True)
