"""Rank functions of the LoRA tests (tests/test_lora.py), run on a shared SpmdPool."""

from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarl.config.lora import LoraConfig
from megarl.config.schema import ParallelConfig, PrecisionConfig
from megarl.convert.hf_io import HFReader
from megarl.convert.weights import load_hf_weights
from megarl.distributed.parallel import megatron_parallel
from megarl.models.gpt import ModelSpec, build_model_chunks
from megarl.models.hf_arch import arch_from_hf_dir
from megarl.models.logprobs import token_logprobs
from megarl.models.lora import adapter_pieces, adapters_disabled, apply_lora, assemble, load_adapters
from megarl.models.train import logits_forward


def lora_forward_grads(hf_dir: str, adapter_dir: str, parallel: ParallelConfig, tokens: torch.Tensor,
                       lora: LoraConfig) -> dict | None:
    """The adapted model's logits, its mean next-token NLL's adapter gradients (whole PEFT tensors)
    and the base's logits with the adapters off, from tensor rank 0 of the first replica."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    with megatron_parallel(parallel) as info:
        arch = arch_from_hf_dir(hf_dir)
        spec = ModelSpec(arch, parallel, PrecisionConfig("float32"))
        chunks = build_model_chunks(spec)
        load_hf_weights(chunks, HFReader(hf_dir), spec, info)
        trainable = apply_lora(chunks, spec, info.tp_rank, info.tp, lora)
        load_adapters(chunks, load_file(f"{adapter_dir}/adapter_model.safetensors"))
        model = chunks[0]
        logits = logits_forward(model, {"tokens": tokens})
        loss = -token_logprobs(logits[:, :-1], tokens[:, 1:], arch.vocab_size).mean()
        loss.backward()
        with torch.no_grad(), adapters_disabled(chunks):
            base = logits_forward(model, {"tokens": tokens})
        full = gather_from_tensor_model_parallel_region(logits.detach())[..., :arch.vocab_size]
        base = gather_from_tensor_model_parallel_region(base)[..., :arch.vocab_size]
        pieces = [None] * info.tp
        dist.all_gather_object(pieces, adapter_pieces(chunks, grads=True), group=ps.get_tensor_model_parallel_group())
        frozen_with_grad = [n for n, p in model.named_parameters() if ".lora." not in n
                            and (p.requires_grad or p.grad is not None)]
        if info.tp_rank != 0 or info.dp_rank != 0:
            return None
        return {"logits": full, "base": base, "grads": assemble([p for rank in pieces for p in rank]),
                "trainable": trainable, "frozen_with_grad": frozen_with_grad}


def adapted_and_base_logprobs(key: str, tokens: torch.Tensor) -> dict | None:
    """A held LoRA model's log-probs of ``tokens`` with its adapters on and off (its reference), and
    the names of any trainable parameter that is not an adapter (the reporting rank's)."""
    from megarl.models.lora import is_adapter
    from megarl.workers.megatron_model import held, token_logprobs

    model = held(key)
    adapted = token_logprobs(key, tokens)
    with adapters_disabled(model.chunks):
        base = token_logprobs(key, tokens)
    trainable = [n for c in model.chunks for n, p in c.named_parameters() if p.requires_grad and not is_adapter(n)]
    return None if adapted is None else {"adapted": adapted, "base": base, "trainable_base": trainable}
