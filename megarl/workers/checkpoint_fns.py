"""Rank functions that save and restore a trained role: weights, optimizer, RNG, step counters.

Weights and optimizer go through megatron-core's dist_checkpointing (the optimizer
in its fully reshardable form, so a run can resume at another layout); each rank
adds a small file with its RNG states and counters. The directory is also a
megarl checkpoint (``megarl.json``), so ``megarl convert mcore-to-hf`` exports it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config.schema import OptimizerConfig
from megarl.convert.checkpoint import (
    HF_DIR,
    forked_write_results_queue,
    hf_side_dir,
    load_dist_checkpoint,
    model_sharded_state_dict,
    write_meta,
)
from megarl.convert.lora_export import write_lora_meta
from megarl.platform.safe_checkpoint import load_weights_only
from megarl.workers.megatron_model import held

# Reshardable to any layout on resume. "mem_efficient": the state is gathered on data-parallel
# rank 0 only, not on every rank (megatron-core's default all-gathers all of it everywhere: at
# dp=2 on the MoE demo, +10.8 GiB of host memory for the save instead of +6.4).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True}


class _OptimizerStateOnDpRankZero(logging.Filter):
    """Drops megatron-core's warning that a rank's common state dict lacks rank 0's optimizer
    ``param_state``: in the mem_efficient format only data-parallel rank 0 holds it, by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("common state dict differs" in text and "Keys only on rank 0: []" in text
                    and text.rstrip().endswith("'param_state')], Mismatched keys: []"))


def _state(model, is_loading: bool) -> dict:
    sd = model_sharded_state_dict(model.chunks)
    if model.optimizer is not None:
        if len(model.chunks) != 1:
            raise NotImplementedError("optimizer checkpoints of interleaved (vpp) models are not supported yet")
        sd["optimizer"] = model.optimizer.sharded_state_dict(sd["model"], is_loading=is_loading,
                                                             metadata=OPTIMIZER_METADATA)
    return sd


def _adam_states(model) -> list[dict]:
    return [state for opt in model.optimizers() for state in opt.optimizer.state.values()]


def _adam_step(model) -> float:
    """torch Adam's per-parameter step count, which megatron's checkpoint does not keep."""
    if model.optimizer is None:
        return 0.0
    steps = [float(state["step"]) for state in _adam_states(model) if "step" in state]
    return max(steps, default=0.0)


def _extras_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "rank_state" / f"rank{dist.get_rank()}.pt"


def save(key: str, out_dir: str, source: str) -> None:
    """Collective over the role: writes its checkpoint into ``out_dir`` (which must exist)."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    model = held(key)
    validation_log = logging.getLogger("megatron.core.dist_checkpointing.validation")
    quiet = _OptimizerStateOnDpRankZero()
    validation_log.addFilter(quiet)
    try:
        with forked_write_results_queue():
            dist_checkpointing.save(_state(model, is_loading=False), out_dir)
    finally:
        validation_log.removeFilter(quiet)
    extras = _extras_path(out_dir)
    extras.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"cpu_rng": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
                "optimizer_steps": model.extra.get("optimizer_steps", 0), "adam_step": _adam_step(model)}, extras)
    if dist.get_rank() == 0:
        from megarl.convert.hf_io import copy_side_files

        spec = model.spec
        (Path(out_dir) / HF_DIR).mkdir(exist_ok=True)
        # From the folder the files are in: a bundled model's cache folder, a checkpoint's hf/
        # (the source path itself holds none of them in either case).
        copy_side_files(hf_side_dir(source), Path(out_dir) / HF_DIR)
        write_meta(out_dir, spec.arch, spec.padded_vocab, spec.precision.dtype, spec.parallel, spec.value_head,
                   source=source)
        write_lora_meta(out_dir, model.chunks)  # a LoRA model's adapters, for whoever reads it back
    dist.barrier()


def load(key: str, ckpt_dir: str, optim: OptimizerConfig | None) -> None:
    """Restores weights and (with ``optim``) optimizer state into the held model."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megarl.workers.updates import ensure_optimizer

    model = held(key)
    if optim is not None:
        ensure_optimizer(model, optim)
        # torch Adam creates its state lazily; the loader needs it to exist.
        for opt in model.optimizers():
            opt._init_optimizer_states_with_dummy_values()
    loaded = load_dist_checkpoint(_state(model, is_loading=True), ckpt_dir)
    keys = ["model"] if len(model.chunks) == 1 else [f"model{i}" for i in range(len(model.chunks))]
    for chunk, name in zip(model.chunks, keys, strict=True):
        getattr(chunk, "module", chunk).load_state_dict(loaded[name], strict=True)
    if optim is not None:
        model.optimizer.load_state_dict(loaded["optimizer"])
    extras_file = _extras_path(ckpt_dir)
    if extras_file.exists():
        extras = load_weights_only(extras_file, str(extras_file))
        torch.set_rng_state(extras["cpu_rng"])
        get_cuda_rng_tracker().set_states(extras["tracker"])
        model.extra["optimizer_steps"] = int(extras["optimizer_steps"])
        if optim is not None:
            # Adam's bias correction needs the step count back. Each parameter gets its own
            # tensor: megatron's dummy-state init shares one among all, which Adam would then
            # advance once per parameter on every step.
            for state in _adam_states(model):
                if "step" in state:
                    state["step"] = torch.tensor(float(extras["adam_step"]), dtype=state["step"].dtype)
