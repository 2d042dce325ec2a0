"""Rank functions that copy a trained role's state into host memory and back (``trainer.snapshot: memory``).

A restart in place (``megarl.trainer.restarts``) brings a role's ranks back from a copy taken
after the last step instead of from the last checkpoint on disk. The copy is rank-local: the
restarted group has the same layout, so rank r gets back exactly what rank r gave, and nothing
is resharded or gathered. It holds what the next step reads: the model's parameters, the torch
optimizer behind megatron's (its fp32 main parameters, which a distributed or mixed-precision
optimizer keeps apart from the model's, and Adam's moments and step counts), the RNG states
and megarl's optimizer step counter (the learning-rate warm-up reads it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from megarl.config.schema import OptimizerConfig
from megarl.workers.megatron_model import held


@dataclass
class OptimizerCopy:
    """One torch optimizer's parameters (in its param_groups' order) and their states."""

    params: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]]


@dataclass
class RankSnapshot:
    chunks: list[dict[str, Any]]  # each model chunk's state dict
    optimizers: list[OptimizerCopy] | None  # None: the role has not trained yet (no optimizer built)
    optimizer_steps: int
    cpu_rng: torch.Tensor
    tracker_rng: dict[str, torch.Tensor]  # megatron's model-parallel RNG tracker
    cuda_rng: list[torch.Tensor]  # the devices' default generators (none on CPU)


def _host(value: torch.Tensor) -> torch.Tensor:
    return value.detach().to("cpu", copy=True)


def _copied(state: dict) -> dict:
    """A module's state dict in host memory (its extra states, where a module has them, copied as they are)."""
    return {k: _host(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


def _torch_optimizers(model) -> list[torch.optim.Optimizer]:
    return [opt.optimizer for opt in model.optimizers()]


def take(key: str) -> RankSnapshot:
    """A copy of this rank's state of the model held under ``key``, in host memory."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    model = held(key)
    chunks = [_copied(getattr(c, "module", c).state_dict()) for c in model.chunks]
    optimizers = None
    if model.optimizer is not None:
        optimizers = []
        for opt in _torch_optimizers(model):
            params = [p for group in opt.param_groups for p in group["params"]]
            optimizers.append(OptimizerCopy([_host(p) for p in params],
                                            [{k: _host(v) for k, v in opt.state.get(p, {}).items()} for p in params]))
    return RankSnapshot(chunks, optimizers, int(model.extra.get("optimizer_steps", 0)), torch.get_rng_state(),
                        {k: _host(v) for k, v in get_cuda_rng_tracker().get_states().items()},
                        [_host(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [])


def restore(key: str, snapshot: RankSnapshot, optim: OptimizerConfig) -> None:
    """Puts ``snapshot`` (this rank's, from ``take``) back into the model held under ``key``,
    freshly loaded at the same layout; builds the optimizer first if the snapshot has one."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megarl.workers.updates import ensure_optimizer

    model = held(key)
    if snapshot.optimizers is not None:
        ensure_optimizer(model, optim)  # wraps the chunks in DDP, as the first update did
    for chunk, saved in zip(model.chunks, snapshot.chunks, strict=True):
        getattr(chunk, "module", chunk).load_state_dict(saved, strict=True)
    with torch.no_grad():
        for opt, saved in zip(_torch_optimizers(model), snapshot.optimizers or [], strict=True):
            params = [p for group in opt.param_groups for p in group["params"]]
            for param, value, state in zip(params, saved.params, saved.states, strict=True):
                # after the model's: the main copies a mixed-precision optimizer steps are its own
                param.copy_(value.to(param.device))
                if state:  # each parameter its own tensors (Adam advances its step in place)
                    opt.state[param] = {k: v.to(param.device if v.dim() else "cpu", copy=True)
                                        for k, v in state.items()}
    model.extra["optimizer_steps"] = snapshot.optimizer_steps
    torch.set_rng_state(snapshot.cpu_rng)
    get_cuda_rng_tracker().set_states(snapshot.tracker_rng)
    if snapshot.cuda_rng:
        torch.cuda.set_rng_state_all(snapshot.cuda_rng)
