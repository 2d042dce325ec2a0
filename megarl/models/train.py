"""Training a megatron-core model: DDP wrapping, the optimizer, and one step.

The loss is given as a function of the model output and the microbatch, so the
same step serves language-model loss here and policy / value losses in the RL
roles. Gradients are reduced by megatron-core's DDP over data-parallel ranks
(and, through ``finalize_model_grads``, over tensor-parallel ranks for
sequence-parallel norms and over the pipeline for tied embeddings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megarl.config.schema import OptimizerConfig
from megarl.models.logprobs import token_logprobs
from megarl.platform import current_platform

# (model output, micro-batch) -> (loss, what the step returns for the micro-batch)
LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]


def wrap_ddp(chunks: list, use_distributed_optimizer: bool = True) -> list:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(ddp_chunks: list, cfg: OptimizerConfig):
    """megatron-core's Adam over the DDP-wrapped chunks, from a role's ``optim`` config.
    ``warmup_steps`` is applied by the caller, which sets the learning rate before each step."""
    from megatron.core import optimizer as mcore_optimizer

    config = ddp_chunks[0].config
    return mcore_optimizer.get_megatron_optimizer(
        mcore_optimizer.OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=config.bf16, fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            **offload_kwargs(cfg),
        ),
        ddp_chunks,
    )


def offload_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """megatron-core's optimizer CPU offload fields for a role's ``optim`` section.

    megatron-core's HybridDeviceOptimizer keeps ``offload_fraction`` of the distributed optimizer's
    shard (fp32 main parameters and Adam moments) on the host and steps it there with torch's CPU
    Adam. It runs on the precision-aware optimizer's code path, as Megatron-LM sets them together:
    the hybrid optimizer then holds the fp32 main copies itself (on the host for the offloaded
    part) instead of the distributed optimizer keeping all of them on the device.

    On the CPU platform there is no device memory to free and megatron-core 0.16.1 cannot build
    it (the precision-aware path asks for Transformer Engine's version; without it the hybrid
    optimizer is handed shards torch.optim refuses as non-leaf tensors): offload is left off.
    """
    from megarl.platform import current_platform

    if not cfg.cpu_offload or not current_platform().offloads_optimizer:
        return {}
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": cfg.offload_fraction,
            "use_precision_aware_optimizer": True,
            # the overlap builds one CPU optimizer per parameter and CUDA streams; plain is enough
            "overlap_cpu_optimizer_d2h_h2d": False}


@dataclass
class StepResult:
    """One optimizer step's outcome on this rank."""

    outputs: list  # the last pipeline stage's: what ``loss_fn`` gave for each microbatch; elsewhere []
    updated: bool  # False: the optimizer skipped the step (non-finite gradients)
    grad_norm: float | None
    moe: dict[str, float]  # the MoE router's auxiliary losses (``moe_aux_losses``); {} for a dense model


def train_step(ddp_chunks: list, optimizer, microbatches: list, loss_fn: LossFn,
               forward: Callable[[Any, Any], torch.Tensor], shapes: list[tuple[int, ...]] | None = None
               ) -> StepResult:
    """One optimizer step over ``microbatches``; returns, on the last stage, what ``loss_fn`` gave
    for each microbatch besides its loss (its metrics).

    ``forward(model, batch)`` runs the model on one microbatch; ``loss_fn(output, batch)``
    returns (loss, metrics). ``shapes`` are the microbatches' model input shapes ``[b, s]`` (they
    may differ between microbatches: packed or trimmed rows, ``megarl.models.forward.RowsInputs``);
    without them, each microbatch is a dict whose ``batch["tokens"]`` is the input.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.forward import schedule_shape

    if shapes is None:
        shapes = [tuple(mb["tokens"].shape) for mb in microbatches]
    seq, batch_size = schedule_shape(ddp_chunks, shapes)
    for chunk in ddp_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()

    def step(data_iterator, model):
        batch = next(data_iterator)
        output = forward(model, batch)
        return output, lambda out: loss_fn(out, batch)

    iterators = [iter(microbatches) for _ in ddp_chunks]
    results = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iterators if len(ddp_chunks) > 1 else iterators[0],
        model=ddp_chunks,
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=batch_size,
        forward_only=False,
    )
    updated, grad_norm, _ = optimizer.step()
    return StepResult(results, updated, grad_norm, moe_aux_losses(ddp_chunks[0].config, len(microbatches)))


# megatron-core's names in its aux-loss tracker, by load-balancing type
_AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                   "global_aux_loss": "global_load_balancing_loss"}


def moe_aux_losses(config, microbatches: int) -> dict[str, float]:
    """The MoE router's auxiliary losses of the step just run, unweighted (before their
    coefficients), mean over layers and micro-batches, averaged over data-parallel ranks; the
    tracker is then cleared. Empty for a dense model or a router with no auxiliary loss.

    Collective over the pipeline and data-parallel groups on every rank of the model (each rank's
    config names the same losses). A loss a rank has not recorded (a pipeline stage without MoE
    layers) enters as zeros, so the reduction has the same shape everywhere."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    if not getattr(config, "num_moe_experts", None):
        return {}
    names = []
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type in _AUX_LOSS_NAMES:
        names.append(_AUX_LOSS_NAMES[config.moe_router_load_balancing_type])
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    if not names:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    # a rank whose stage has no MoE layer records nothing: its zeros go on the rank's device (NCCL)
    device = next(iter(tracker.values()))["values"].device if tracker else current_platform().rank_device()
    for name in names:
        tracker.setdefault(name, {"values": torch.zeros(config.num_layers, device=device)})
    reduce_aux_losses_tracker_across_ranks(names)
    out = {name: float(tracker[name]["values"].sum()) / (config.num_layers * microbatches) for name in names}
    clear_aux_losses_tracker()
    return out


def logits_forward(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TP-local logits [b, s, vocab/tp] of ``batch["tokens"]``."""
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, None)


def lm_loss_fn(vocab_size: int) -> LossFn:
    """Mean next-token cross-entropy over ``batch["loss_mask"]``, padded vocab excluded."""

    def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]):
        mask = batch["loss_mask"].float()
        per_token = -token_logprobs(logits, batch["labels"], vocab_size)
        value = (per_token * mask).sum() / mask.sum()
        return value, {"lm_loss": value.detach().clone()}

    return loss
