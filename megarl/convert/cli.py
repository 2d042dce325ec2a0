"""``megarl convert``: HF ⇄ megatron-core checkpoints at any (tp, pp), and parity checks.

Every subcommand checks its inputs first (config vs tensors, layout vs model,
output path) and only then starts the ranks it needs; outputs are written to a
temporary directory and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import sys
import time

from megarl.config.loader import ConfigError
from megarl.config.schema import DTYPES, ParallelConfig
from megarl.models.hf_arch import ArchError, ModelArch
from megarl.models.layout import parallel_errors

DESCRIPTION = """Convert checkpoints between Hugging Face and megatron-core (dist_checkpointing).

  hf-to-mcore   HF folder (safetensors)  -> megarl checkpoint at --tp/--pp
  mcore-to-hf   megarl checkpoint        -> HF folder (safetensors + config + tokenizer)
  reshard       megarl checkpoint        -> megarl checkpoint at a new --tp/--pp
  verify        run one token batch through transformers and through the Megatron model
                at --tp/--pp; print max |dlogit|, mean |dlogprob|, top-1 agreement;
                exit 1 above --tol

megarl starts the ranks itself (tp*pp*ep processes, fewer at --etp 1); do not wrap it in torchrun.
"""


def _layout_args(p: argparse.ArgumentParser, default_tp: int | None = 1) -> None:
    p.add_argument("--tp", type=int, default=default_tp, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert-tensor-parallel size (MoE models): how many ranks split each expert; "
                        "default: --tp; 1 keeps every expert whole")


def add_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="convert and verify checkpoints (HF <-> megatron-core)",
                          description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    conv.set_defaults(handler=main)
    cs = conv.add_subparsers(dest="convert_cmd", required=True, metavar="COMMAND")

    p = cs.add_parser("hf-to-mcore", help="HF folder -> megatron-core checkpoint")
    p.add_argument("--hf", required=True,
                   help="HF model folder (config.json + safetensors), or bundled:SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, help="output checkpoint folder (must not exist)")
    _layout_args(p)
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype of the checkpoint (default: the HF config's dtype)")
    p.add_argument("--vocab-pad-multiple", type=int, default=128,
                   help="pad the vocabulary to a multiple of lcm(this, tp) (default 128)")
    p.add_argument("--value-head", action="store_true",
                   help="the HF model is a sequence classifier (score head): build a value/reward model")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_hf_to_mcore)

    p = cs.add_parser("mcore-to-hf", help="megatron-core checkpoint -> HF folder")
    p.add_argument("--ckpt", required=True, help="megarl checkpoint folder")
    p.add_argument("--out", required=True, help="output HF folder (must not exist)")
    _layout_args(p)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="dtype of the exported tensors")
    p.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors file")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="export without tokenizer files (transformers loads it; vLLM then needs "
                        "skip_tokenizer_init); by default a checkpoint without a tokenizer is refused")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_mcore_to_hf)

    p = cs.add_parser("reshard", help="megatron-core checkpoint -> the same at a new layout")
    p.add_argument("--ckpt", required=True, help="megarl checkpoint folder")
    p.add_argument("--out", required=True, help="output checkpoint folder (must not exist)")
    _layout_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_reshard)

    p = cs.add_parser("verify", help="logit parity: transformers vs the Megatron model")
    p.add_argument("--hf", required=True, help="HF model folder (the reference), or bundled:NAME")
    p.add_argument("--ckpt", default=None, help="megarl checkpoint (default: load --hf directly)")
    _layout_args(p)
    p.add_argument("--tol", type=float, default=1e-3, help="max |dlogit| allowed (default 1e-3)")
    p.add_argument("--batch", type=int, default=2, help="sequences in the token batch")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random token batch (used when the model has no tokenizer)")
    p.set_defaults(func=cmd_verify)


def _parallel(args: argparse.Namespace) -> ParallelConfig:
    par = ParallelConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    par.world_size = par.fewest_ranks
    return par


def _check_layout(arch: ModelArch, par: ParallelConfig, padded_vocab: int | None = None) -> None:
    errors = parallel_errors(arch, par, "--layout")
    errors = [e.replace("--layout.", "--") for e in errors]
    if padded_vocab is not None and padded_vocab % par.tp:
        errors.append(f"--tp={par.tp} does not divide the checkpoint's padded vocabulary "
                      f"({padded_vocab}); convert from HF again with this tp")
    if errors:
        raise ConfigError("invalid layout:\n  " + "\n  ".join(errors))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _report(what: str, stats: list[dict], started: float, moved_key: str | None, weights_bytes: int) -> None:
    worst = max(stats, key=lambda s: s["peak_above_baseline"])
    print(f"{what}: {time.time() - started:.1f} s on {len(stats)} rank(s)", flush=True)
    if moved_key:
        moved = sum(s.get(moved_key, 0) for s in stats)
        print(f"  {_human(moved)} of weights converted (model: {_human(weights_bytes)})")
    print(f"  peak memory per rank {_human(max(s['peak_rss'] for s in stats))}; the most any rank added "
          f"to its start-up footprint: {_human(worst['peak_above_baseline'])} for "
          f"{_human(worst['weights_bytes'])} of its own weights (rank {worst['rank']})", flush=True)


def _arch_bytes(arch: ModelArch, dtype: str) -> int:
    return arch.num_parameters() * (4 if dtype == "float32" else 2)


def _pool(world: int):
    from megarl.distributed.spmd import SpmdPool

    print(f"starting {world} rank(s)...", flush=True)
    return SpmdPool(world)


def _resolve_hf(args: argparse.Namespace) -> None:
    from megarl.models.bundled import resolve_model_path

    args.hf = str(resolve_model_path(args.hf))


def _write_with_ranks(args: argparse.Namespace, par: ParallelConfig, job, **kwargs) -> tuple[list[dict], float]:
    """Runs ``job`` on fresh ranks, writing into a temporary sibling of --out renamed on success."""
    from megarl.utils.atomic import atomic_dir

    started = time.time()
    with atomic_dir(args.out, overwrite=args.overwrite) as tmp, _pool(par.world_size) as pool:
        stats = pool.run(job, out_dir=str(tmp), parallel=par, **kwargs)
    return stats, started


def _checked_hf(hf_dir: str, value_head: bool = False) -> ModelArch:
    """The architecture of an HF folder whose config and tensors were checked against each other."""
    from megarl.convert.hf_io import HFReader, check_hf_checkpoint
    from megarl.convert.mapping import hf_tensor_shapes
    from megarl.convert.preflight import hf_config_arch

    arch = hf_config_arch(hf_dir)
    reader = HFReader(hf_dir)
    try:
        check_hf_checkpoint(reader, hf_tensor_shapes(arch, value_head))
    finally:
        reader.close()
    return arch


def cmd_hf_to_mcore(args: argparse.Namespace) -> int:
    from megarl.convert import jobs

    _resolve_hf(args)
    arch = _checked_hf(args.hf, args.value_head)
    par = _parallel(args)
    _check_layout(arch, par)
    if args.vocab_pad_multiple < 1:
        raise ConfigError(f"--vocab-pad-multiple={args.vocab_pad_multiple} must be >= 1")
    dtype = args.dtype or (arch.dtype if arch.dtype in DTYPES else "float32")
    stats, started = _write_with_ranks(args, par, jobs.hf_to_mcore, hf_dir=str(args.hf), dtype=dtype,
                                       vocab_pad_multiple=args.vocab_pad_multiple, value_head=args.value_head)
    _report(f"wrote {args.out} (tp={par.tp}, pp={par.pp}, {dtype})", stats, started, "bytes_read",
            _arch_bytes(arch, dtype))
    return 0


def _checkpoint_arch(ckpt: str) -> tuple[ModelArch, dict]:
    """The architecture and metadata of a megarl checkpoint, its dist checkpoint files checked."""
    from megarl.convert.checkpoint import read_meta
    from megarl.convert.preflight import check_dist_checkpoint

    meta = read_meta(ckpt)
    check_dist_checkpoint(ckpt)
    return ModelArch.from_dict(meta["arch"]), meta


def _checkpoint_and_layout(args: argparse.Namespace) -> tuple[ModelArch, dict, ParallelConfig]:
    arch, meta = _checkpoint_arch(args.ckpt)
    par = _parallel(args)
    _check_layout(arch, par, meta["padded_vocab"])
    return arch, meta, par


def cmd_mcore_to_hf(args: argparse.Namespace) -> int:
    from megarl.convert import jobs
    from megarl.convert.preflight import check_exportable

    arch, meta, par = _checkpoint_and_layout(args)
    check_exportable(args.ckpt, arch, tokenizer=not args.no_tokenizer)
    stats, started = _write_with_ranks(args, par, jobs.mcore_to_hf, ckpt_dir=str(args.ckpt), dtype=args.dtype,
                                       max_shard_bytes=int(args.max_shard_size * 1024**3))
    _report(f"wrote HF folder {args.out}", stats, started, "bytes_written",
            _arch_bytes(arch, args.dtype or meta["dtype"]))
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from megarl.convert import jobs

    _, _, par = _checkpoint_and_layout(args)
    stats, started = _write_with_ranks(args, par, jobs.reshard, ckpt_dir=str(args.ckpt))
    _report(f"wrote {args.out} (tp={par.tp}, pp={par.pp})", stats, started, None, 0)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:

    from megarl.convert import jobs
    from megarl.convert.parity import compare_logits, hf_reference_logits, verification_tokens

    _resolve_hf(args)
    arch = _checked_hf(args.hf)  # transformers gets only a folder whose config and tensors agree
    padded = None
    if args.ckpt:
        ckpt_arch, meta = _checkpoint_arch(args.ckpt)
        if meta["value_head"]:
            raise ConfigError(f"{args.ckpt} is a value model (megarl.json value_head: true); verify compares "
                              "language-model logits")
        diffs = arch.mismatches(ckpt_arch)
        if diffs:
            raise ConfigError(f"{args.ckpt} does not match {args.hf}/config.json:\n  " + "\n  ".join(diffs))
        padded = meta["padded_vocab"]
    par = _parallel(args)
    _check_layout(arch, par, padded)
    if args.seq > arch.max_position_embeddings:
        raise ConfigError(f"--seq={args.seq} exceeds max_position_embeddings={arch.max_position_embeddings}")
    tokens = verification_tokens(args.hf, args.batch, args.seq, args.seed)
    started = time.time()
    reference = hf_reference_logits(args.hf, tokens)
    microbatches = par.pp if par.vpp else 1
    if microbatches > 1 and args.batch % microbatches:
        raise ConfigError(f"--batch={args.batch} must be a multiple of --pp={par.pp} with --vpp")
    with _pool(par.world_size) as pool:
        if args.ckpt:
            stats = pool.run(jobs.checkpoint_logits, ckpt_dir=str(args.ckpt), parallel=par, tokens=tokens,
                             num_microbatches=microbatches)
        else:
            stats = pool.run(jobs.hf_logits, hf_dir=str(args.hf), parallel=par, tokens=tokens,
                             num_microbatches=microbatches)
    megatron = next(s["logits"] for s in stats if s["logits"] is not None)
    result = compare_logits(reference, megatron)
    source = args.ckpt or args.hf
    print(f"verify {source} at tp={par.tp} pp={par.pp}{f' vpp={par.vpp}' if par.vpp else ''}"
          f"{f' ep={par.ep}' if par.ep > 1 else ''} against transformers "
          f"({args.batch}x{args.seq} tokens, fp32, eager attention, {time.time() - started:.1f} s):")
    print(f"  max |dlogit|      {result.max_abs_logit:.3e}  (tolerance {args.tol:.1e})")
    print(f"  mean |dlogprob|   {result.mean_abs_logprob:.3e}")
    print(f"  top-1 agreement   {result.top1_agreement:.4f}")
    ok = result.max_abs_logit <= args.tol
    print("PASS" if ok else "FAIL: logits differ beyond the tolerance", flush=True)
    return 0 if ok else 1


def main(args: argparse.Namespace) -> int:
    from megarl.distributed.spmd import PoolTooWide, SpmdError
    from megarl.platform.safe_checkpoint import UnsafeCheckpointError

    try:
        return args.func(args)
    except (ConfigError, ArchError, UnsafeCheckpointError, FileExistsError, FileNotFoundError, PoolTooWide) as e:
        print(f"megarl convert: error: {e}", file=sys.stderr)
        return 2
    except SpmdError as e:
        print(f"megarl convert {args.convert_cmd}: failed, nothing was written: {e}", file=sys.stderr)
        return 1
