"""Rank functions of a role that holds a megatron-core model between calls.

A WorkerGroup runs these on every rank. The model, its spec, the rank's place in
the layout and (once training) its optimizer live in the rank's ``state`` under a
key, so several calls (load, score, train, sync) work on the same model.
megatron-core's parallel state is per process: a process holds one layout at a
time, and ``unload`` releases it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megarl.config.lora import LoraConfig
from megarl.config.schema import MoeConfig, ParallelConfig, PrecisionConfig, RecomputeConfig
from megarl.distributed.parallel import RankInfo, megatron_parallel
from megarl.models.gpt import ModelSpec, build_model_chunks
from megarl.workers.state import state


@dataclass
class HeldModel:
    spec: ModelSpec
    info: RankInfo
    chunks: list
    layout_context: Any  # the open megatron_parallel context
    optimizer: Any = None
    extra: dict = field(default_factory=dict)

    def optimizers(self) -> list:
        """The megatron optimizers behind ``optimizer`` (a ChainedOptimizer holds one per
        parameter group kind, e.g. dense and expert); empty before the role first trains."""
        if self.optimizer is None:
            return []
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))


def held(key: str) -> HeldModel:
    return state.require(key)


def load(key: str, source: str, parallel: ParallelConfig, dtype: str = "float32", value_head: bool = False,
         seed: int = 1234, timeout_minutes: int = 30, recompute: RecomputeConfig | None = None,
         new_value_head: bool = False, moe: MoeConfig | None = None, lora: LoraConfig | None = None) -> dict:
    """Builds the model at ``parallel`` and fills it from an HF folder or a megarl checkpoint;
    ``recompute`` is the role's activation recompute, ``moe``
    a MoE model's routing in training;
    ``new_value_head`` lets a value head that an HF language model lacks start from its init;
    ``lora`` (enabled) adds adapters and freezes the rest (``megarl.models.lora``)."""
    from megarl.convert.checkpoint import is_megarl_checkpoint, load_model
    from megarl.convert.hf_io import HFReader
    from megarl.convert.jobs import spec_from_checkpoint
    from megarl.convert.weights import load_hf_weights
    from megarl.models.bundled import resolve_model_path
    from megarl.models.hf_arch import arch_from_hf_dir

    if key in state:
        unload(key)
    path = str(resolve_model_path(source))
    context = megatron_parallel(parallel, seed=seed, timeout_minutes=timeout_minutes)
    info = context.__enter__()
    try:
        if is_megarl_checkpoint(path):
            spec = replace(spec_from_checkpoint(path, parallel, dtype), recompute=recompute, moe=moe)
            fresh_head = value_head and not spec.value_head
            if fresh_head and not new_value_head:
                raise ValueError(f"{source} is a language model's checkpoint (no value head): it cannot score as a "
                                 "reward model; train one with `megarl rm`")
            spec = replace(spec, value_head=spec.value_head or value_head)
            chunks = build_model_chunks(spec)
            load_model(chunks, path, keep_output_layer=fresh_head)
        else:
            spec = ModelSpec(arch_from_hf_dir(path), parallel, PrecisionConfig(dtype=dtype), value_head=value_head,
                             recompute=recompute, moe=moe)
            chunks = build_model_chunks(spec)
            reader = HFReader(path)
            load_hf_weights(chunks, reader, spec, info, new_value_head=new_value_head)
            reader.close()
        if lora is not None and lora.enabled:
            from megarl.models.lora import apply_lora

            apply_lora(chunks, spec, info.tp_rank, info.tp, lora)
    except BaseException:
        context.__exit__(None, None, None)
        raise
    state[key] = HeldModel(spec, info, chunks, context)
    return {"rank": info.rank, "tp_rank": info.tp_rank, "pp_rank": info.pp_rank, "dp_rank": info.dp_rank}


def unload(key: str) -> None:
    model = state.pop(key, None)
    if model is not None:
        model.chunks.clear()
        model.layout_context.__exit__(None, None, None)


def token_logprobs(key: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """log p(tokens[:, 1:]) [b, s-1] under the model (one copy, from the reporting rank)."""
    from megarl.models.forward import forward_outputs
    from megarl.models.logprobs import token_logprobs as logprobs_of

    model = held(key)
    outputs = forward_outputs(model.chunks, [tokens])
    if outputs is None:
        return None
    with torch.no_grad():
        result = logprobs_of(outputs[0][:, :-1], tokens[:, 1:], model.spec.arch.vocab_size).float().cpu()
    return result if model.info.tp_rank == 0 and model.info.replica() == 0 else None


def lm_train_step(key: str, tokens: torch.Tensor, lr: float = 1e-3) -> float | None:
    """One optimizer step of next-token loss on ``tokens`` (the global batch, split over dp)."""
    from megarl.config.schema import OptimizerConfig
    from megarl.models.train import build_optimizer, lm_loss_fn, logits_forward, train_step, wrap_ddp

    model = held(key)
    if model.optimizer is None:
        model.chunks = wrap_ddp(model.chunks)
        model.optimizer = build_optimizer(model.chunks, OptimizerConfig(lr=lr))
    local = tokens.chunk(model.info.dp)[model.info.dp_rank]
    batch = {"tokens": local[:, :-1].contiguous(), "labels": local[:, 1:].contiguous(),
             "loss_mask": torch.ones_like(local[:, 1:], dtype=torch.float)}
    result = train_step(model.chunks, model.optimizer, [batch], lm_loss_fn(model.spec.arch.vocab_size),
                        logits_forward)
    return float(result.outputs[0]["lm_loss"]) if result.outputs else None
