"""Options of ``megarl bench scaling`` (parsed without importing torch: --help stays fast)."""

from __future__ import annotations

import argparse


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_parser(bs: argparse._SubParsersAction) -> None:
    p = bs.add_parser(
        "scaling", help="strong/weak scaling of the training step and the weight sync over 1..N ranks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Times the actor's training step (forward, backward, gradient reduction, Adam) of a llama-like\n"
            "megatron-core model with random weights, and the weight sync from an actor of N ranks (tp=N)\n"
            "into one vLLM engine against a raw transfer of the same bytes, for each rank count in --ranks.\n"
            "Ranks are Ray actors (gloo on CPU, NCCL on GPU): on a cluster they spread over its nodes.\n\n"
            "Modes of the training step:\n"
            "  dp-strong  one global batch (--global-batch) split over N data-parallel ranks\n"
            "  dp-weak    global-batch / max(ranks) sequences per rank: the global batch grows with N\n"
            "  tp-strong  the global batch on one replica, the model split over N tensor-parallel ranks\n"
            "  pp-strong  the global batch on one replica, the layers split over N pipeline stages\n\n"
            "Efficiency = throughput per rank relative to the fewest ranks N0: T0*N0/(N*TN) in strong modes,\n"
            "T0/TN in weak ones; for the weight sync, raw transfer time / sync time. Prints one table per\n"
            "curve and writes scaling.json and scaling.png (efficiency vs ranks) under --out.\n\n"
            "Defaults are tiny so that a 2-core machine finishes in minutes; on a cluster pass real sizes,\n"
            "e.g. --hidden 4096 --layers 32 --heads 32 --ffn 11008 --vocab 32000 --seq-len 4096 --dtype bfloat16."),
    )
    p.add_argument("--ranks", type=_int_list, default=(1, 2, 4, 8),
                   help="rank counts, comma-separated (default 1,2,4,8)")
    p.add_argument("--modes", type=_str_list, default=("dp-strong", "dp-weak", "tp-strong"),
                   help="training-step modes, comma-separated: dp-strong, dp-weak, tp-strong, pp-strong "
                        "(default dp-strong,dp-weak,tp-strong)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    p.add_argument("--heads", type=int, default=8, help="attention heads, as many KV heads (default 8)")
    p.add_argument("--ffn", type=int, default=None, help="MLP intermediate size (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size (default 2048)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step in the strong modes (default micro-batch x lcm of --ranks)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps / syncs first (default 1)")
    p.add_argument("--repeats", type=int, default=4, help="timed steps / syncs; the median is reported (default 4)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--no-sync", action="store_true", help="skip the weight sync (no vLLM engine)")
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallelism of the engine (default 1)")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="weight-sync bucket cap in MiB (default 64)")
    p.add_argument("--out", default="megarl-bench-scaling",
                   help="folder for scaling.json and scaling.png (default ./megarl-bench-scaling)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(run=run_cmd)


def run_cmd(args: argparse.Namespace) -> int:
    from megarl_bench.scaling import ScalingArgs, dumps, format_tables, progress_printer, run_scaling, write_outputs

    scaling = ScalingArgs(
        ranks=args.ranks, modes=args.modes, hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn,
        vocab=args.vocab, seq_len=args.seq_len, micro_batch=args.micro_batch, global_batch=args.global_batch,
        warmup=args.warmup, repeats=args.repeats, dtype=args.dtype, sync=not args.no_sync,
        rollout_tp=args.rollout_tp, bucket_mib=args.bucket_mb,
    )
    progress = progress_printer(to_stderr=args.json)
    result = run_scaling(scaling, progress=progress)
    written = write_outputs(result, args.out) if args.out else []
    print(dumps(result) if args.json else format_tables(result), flush=True)
    if written:
        progress("wrote " + ", ".join(written))
    return 0
