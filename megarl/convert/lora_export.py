"""A LoRA role's checkpoint and export: which adapters it holds, and the PEFT adapter folder.

A checkpoint of a LoRA actor is an ordinary megarl checkpoint (its adapters are tensors of the
model's sharded state dict, ``megarl.models.lora.shard_adapter_entries``) plus ``lora.json``, the
adapters' shape, so that a reader builds the same adapters before loading. Its export is the
merged model (W + scale * B @ A, the policy vLLM served) and, in ``adapter/``, the adapters as
PEFT saves them (``adapter_config.json`` + ``adapter_model.safetensors``) on the source model.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config.lora import LORA_TARGETS, LoraConfig
from megarl.models.lora import adapter_pieces, assemble, lora_states, merged_weights
from megarl.utils.atomic import write_text_atomic

LORA_FILE = "lora.json"
ADAPTER_DIR = "adapter"


def lora_config_of(chunks: list) -> LoraConfig | None:
    """The adapters ``chunks`` hold, read off the modules (None: no adapters)."""
    targets, rank, scale, dropout = set(), 0, 1.0, 0.0
    for _, state in lora_states(chunks):
        for adapter in state.adapters.values():
            targets.add(adapter.target)
            rank = adapter.lora_A.shape[0]
        scale, dropout = state.scale, state.dropout
    if not targets:
        return None
    return LoraConfig(rank=rank, alpha=scale * rank, dropout=dropout,
                      target_modules=[t for t in LORA_TARGETS if t in targets])


def write_lora_meta(ckpt_dir: str | Path, chunks: list) -> None:
    """``lora.json`` beside a checkpoint of a LoRA model (nothing for a full one)."""
    cfg = lora_config_of(chunks)
    if cfg is not None:
        write_text_atomic(Path(ckpt_dir) / LORA_FILE, json.dumps(asdict(cfg), indent=2))


def read_lora_meta(ckpt_dir: str | Path) -> LoraConfig | None:
    path = Path(ckpt_dir) / LORA_FILE
    return LoraConfig(**json.loads(path.read_text())) if path.is_file() else None


def merge_into_base(chunks: list) -> None:
    """Writes W + scale * B @ A into every adapted linear's weight and turns the adapters off: the
    chunks then compute the adapted policy with their ordinary weights (what export writes)."""
    merged = merged_weights(chunks)
    with torch.no_grad():
        for module, state in lora_states(chunks):
            module.weight.copy_(merged[id(module.weight)])
            state.enabled = False


def save_peft_adapter(chunks: list, out_dir: str | Path, base_model: str) -> None:
    """Collective: the whole adapters, put together on global rank 0 from every rank's pieces,
    written as a PEFT adapter folder that ``peft.PeftModel.from_pretrained`` loads."""
    from safetensors.torch import save_file

    cfg = lora_config_of(chunks)
    everyone: list = [None] * dist.get_world_size()
    dist.gather_object(adapter_pieces(chunks), everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0 or cfg is None:
        return
    tensors = assemble([piece for rank in everyone for piece in rank])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
              "target_modules": list(cfg.target_modules), "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False}
    write_text_atomic(out / "adapter_config.json", json.dumps(config, indent=2))
