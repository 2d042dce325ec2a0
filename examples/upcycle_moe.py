"""Sparse upcycling: a dense Llama-family checkpoint -> a Mixtral checkpoint whose E experts are
copies of the dense MLP, with a fresh router.

With top-k = E every token goes to every expert and the routing weights sum to one, so the
upcycled model computes exactly what the dense one did: a MoE model that already answers the
demo's task, for running RL on mixture-of-experts on a CPU (examples/moe_grpo.sh). Training
then tells the experts apart. Writes HF safetensors (per-expert tensors, as Mixtral checkpoints
name them), the config and the tokenizer files.

Usage: python examples/upcycle_moe.py SOURCE OUT [--experts 2] [--topk 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megarl.models.bundled import resolve_model_path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "special_tokens_map.json")
_DENSE_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's names of gate, up, down


def upcycle(source: Path, out: Path, experts: int, topk: int, seed: int = 0) -> None:
    cfg = json.loads((source / "config.json").read_text())
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise SystemExit(f"{source}: model_type {cfg.get('model_type')!r}; upcycling reads a Llama or Mistral model")
    if not 2 <= topk <= experts:
        # top 1 renormalised weighs the chosen expert 1; megatron-core routes top 1 only with the
        # softmax over all experts first (weight p), another function
        raise SystemExit(f"--topk={topk} must be in [2, --experts={experts}]")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{source}: no *.safetensors")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            layer, sep, rest = name.partition(".mlp.")
            if not sep:
                tensors[name] = tensor
                continue
            kind = rest.split(".")[0]
            for e in range(experts):
                tensors[f"{layer}.block_sparse_moe.experts.{e}.{_DENSE_MLP[kind]}.weight"] = tensor.clone()
            router = f"{layer}.block_sparse_moe.gate.weight"
            if router not in tensors:
                hidden = tensor.shape[1] if kind != "down_proj" else tensor.shape[0]
                tensors[router] = (torch.randn(experts, hidden, generator=generator) * 0.02).to(tensor.dtype)
    moe = {**cfg, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
           "num_experts_per_tok": topk, "router_aux_loss_coef": 0.0, "output_router_logits": False}
    moe.pop("mlp_bias", None)
    moe.pop("pretraining_tp", None)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "model.safetensors.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    partial.rename(out / "model.safetensors")
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    (out / "config.json").write_text(json.dumps(moe, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="HF folder or bundled:SmolLM2-135M-Instruct")
    parser.add_argument("out")
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    args = parser.parse_args(argv)
    upcycle(Path(resolve_model_path(args.source)), Path(args.out), args.experts, args.topk)
    print(f"wrote {args.out}: {args.experts} experts, top {args.topk}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
