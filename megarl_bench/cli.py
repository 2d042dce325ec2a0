"""``megarl bench``: benchmarks that print measured/limit ratios from one run."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (weight sync, ...)",
                           description="Benchmarks that print measured figures next to their limits.")
    bench.set_defaults(handler=main)
    bs = bench.add_subparsers(dest="bench_cmd", required=True, metavar="BENCHMARK")
    p = bs.add_parser("refit", help="weight sync Megatron (tp, pp) -> vLLM tp: bytes and time vs raw transfer",
                      description="Syncs a model from an actor group into a vLLM engine and prints, per rollout "
                                  "rank, bytes received / bytes of its shard, the sync time against a raw transfer "
                                  "of the same bytes on the same group, the full-tensor baseline, and peak memory; "
                                  "beside them, the bytes a full-tensor broadcast and vLLM's nccl_m2n (whose "
                                  "fallback sends every fused or renamed tensor whole to every rank) would move.")
    p.add_argument("--model", required=True, help="HF folder, megarl checkpoint or bundled:SmolLM2-135M-Instruct")
    p.add_argument("--train-tp", type=int, default=1)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--train-ep", type=int, default=1, help="expert parallel size of the actor (MoE models)")
    p.add_argument("--train-etp", type=int, default=None,
                   help="expert tensor parallel size of the actor (MoE models; default --train-tp, 1: whole experts)")
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket cap in MiB (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs (median reported)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-baseline", action="store_true", help="skip the full-tensor baseline")
    p.add_argument("--cpu-gemm", default="onednn", choices=["onednn", "torch"],
                   help="rollout.cpu_gemm of the engine (CPU): onednn (default) packs each weight again after "
                        "a sync; torch computes with F.linear on the weight as received")
    p.add_argument("--delta-lr", type=float, default=None,
                   help="after the timed syncs, one real optimizer step at this lr: the fraction of bf16 elements "
                        "it changed and what a changed-elements-only sync would send against the whole shard")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run_refit_cmd)
    from megarl_bench.memory import add_parser as add_memory_parser  # planner memory model vs mcore

    add_memory_parser(bs)
    from megarl_bench import scaling_cli

    scaling_cli.add_parser(bs)
    from megarl_bench import logprob_cli

    logprob_cli.add_parser(bs)
    from megarl_bench.e2e import add_e2e_parser  # megarl vs TRL's GRPOTrainer

    add_e2e_parser(bs)
    from megarl_bench import async_rollout  # rollout ahead of training vs lockstep

    async_rollout.add_parser(bs)
    from megarl_bench import episodes  # multi-turn episodes: overlapping tool calls vs lockstep turns

    episodes.add_parser(bs)
    from megarl_bench import endpoint  # agent episodes through the OpenAI-compatible endpoint vs in process

    endpoint.add_parser(bs)
    from megarl_bench import mfu  # model-FLOPs utilisation of the actor's training step

    mfu.add_parser(bs)


def run_refit_cmd(args: argparse.Namespace) -> int:
    from megarl_bench.refit import RefitArgs, dumps, format_table, memory_overruns, run_refit

    refit = RefitArgs(model=args.model, train_tp=args.train_tp, train_pp=args.train_pp, train_ep=args.train_ep,
                      train_etp=args.train_etp, rollout_tp=args.rollout_tp,
                      bucket_mib=args.bucket_mb, repeats=args.repeats, dtype=args.dtype,
                      baseline=not args.no_baseline, delta_lr=getattr(args, "delta_lr", None),
                      cpu_gemm=getattr(args, "cpu_gemm", "onednn"))
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    result = run_refit(refit, progress=progress)
    print(dumps(result) if args.json else format_table(result), flush=True)
    overruns = memory_overruns(result)
    for line in overruns:  # the promise is every rank within bucket + largest shard: a breach fails the run
        print(f"megarl bench refit: {line}", file=sys.stderr)
    return 1 if overruns else 0


# Options of the benchmarks that count or size something (lists: each entry); a zero divides or
# starts an empty group of ranks, so they are refused before any rank starts.
_AT_LEAST = {"train_tp": 1, "train_pp": 1, "train_ep": 1, "train_etp": 1, "rollout_tp": 1, "repeats": 1, "steps": 1,
             "rounds": 1, "threads": 1, "batch": 1, "seq": 1, "hidden": 1, "layers": 1, "heads": 1, "ffn": 1,
             "vocab": 1, "seq_len": 1,
             "micro_batch": 1, "global_batch": 1, "vocab_pad_multiple": 1, "ranks": 1, "tp": 1, "warmup": 0,
             "staleness": 0, "prompts": 1, "seeds": 0}
_POSITIVE = ("bucket_mb", "tolerance", "delta_lr")


def count_errors(args: argparse.Namespace) -> list[str]:
    """'--flag=value must be ...' for every counting option of ``args`` out of range."""
    errors = []
    for dest, value in vars(args).items():
        flag = "--" + dest.replace("_", "-")
        values = value if isinstance(value, list | tuple) else [value]
        if dest in _AT_LEAST:
            bad = [v for v in values if isinstance(v, int) and v < _AT_LEAST[dest]]
            if bad:
                errors.append(f"{flag}={bad[0]} must be >= {_AT_LEAST[dest]}")
        elif dest in _POSITIVE and isinstance(value, int | float) and not 0 < value < float("inf"):
            errors.append(f"{flag}={value} must be > 0")
    return errors


def _one_line(message: str) -> str:
    """'header:\n  problem' with a single problem reads as one line."""
    lines = message.splitlines()
    return f"{lines[0]} {lines[1].strip()}" if len(lines) == 2 and lines[1].startswith("  ") else message


def main(args: argparse.Namespace) -> int:
    from megarl.config.loader import ConfigError
    from megarl.models.hf_arch import ArchError

    try:
        errors = count_errors(args)
        if errors:
            raise ConfigError("invalid benchmark:\n  " + "\n  ".join(errors))
        return args.run(args)
    except (ConfigError, ArchError, OSError) as e:
        print(f"megarl bench: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
