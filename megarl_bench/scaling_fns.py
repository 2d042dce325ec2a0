"""Rank functions of ``megarl bench scaling`` (run on every rank of its WorkerGroup).

The model is megatron-core's, randomly initialised from a ModelArch: the benchmark
measures time, so no weights are read, and a cluster user can ask for any size.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.schema import ParallelConfig, PrecisionConfig
from megarl.distributed.parallel import megatron_parallel
from megarl.models.gpt import ModelSpec, build_model_chunks
from megarl.models.hf_arch import ModelArch
from megarl.platform import current_platform
from megarl.workers.megatron_model import HeldModel, unload
from megarl.workers.state import state


def _wait_for_device() -> None:
    current_platform().synchronize()


def time_train_steps(arch: dict[str, Any], parallel: ParallelConfig, dtype: str, seq_len: int, micro_batch: int,
                     micro_batches: int, warmup: int, repeats: int, seed: int = 0) -> dict[str, Any] | None:
    """Seconds of each timed optimizer step (after ``warmup`` untimed ones), from rank 0.

    Each data-parallel rank trains on ``micro_batches`` micro-batches of ``micro_batch``
    random sequences of ``seq_len`` tokens per step; tensor/pipeline ranks of one replica
    see the same data. A barrier before and after each step makes rank 0's clock the
    slowest rank's: a step is done when every rank is done.
    """
    from megarl.config.schema import OptimizerConfig
    from megarl.models.train import build_optimizer, lm_loss_fn, logits_forward, train_step, wrap_ddp

    model_arch = ModelArch.from_dict(arch)
    spec = ModelSpec(model_arch, parallel, PrecisionConfig(dtype=dtype))
    device = current_platform().rank_device()
    with megatron_parallel(parallel, seed=seed) as info:
        chunks = wrap_ddp(build_model_chunks(spec))
        optimizer = build_optimizer(chunks, OptimizerConfig(lr=1e-4))
        generator = torch.Generator().manual_seed(seed * 1000 + info.dp_rank)
        batches = []
        for _ in range(micro_batches):
            tokens = torch.randint(0, model_arch.vocab_size, (micro_batch, seq_len + 1), generator=generator)
            tokens = tokens.to(device)
            batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                            "loss_mask": torch.ones(micro_batch, seq_len, device=device)})
        times = []
        for step in range(warmup + repeats):
            _wait_for_device()
            dist.barrier()
            started = time.perf_counter()
            result = train_step(chunks, optimizer, batches, lm_loss_fn(model_arch.vocab_size), logits_forward)
            _wait_for_device()
            dist.barrier()
            seconds = time.perf_counter() - started
            if not result.updated:
                raise RuntimeError(f"the optimizer skipped step {step} (non-finite gradients?)")
            if step >= warmup:
                times.append(seconds)
        del chunks, optimizer, batches
    if dist.get_rank() != 0:
        return None
    return {"seconds": times, "threads": torch.get_num_threads()}


def hold_random_model(key: str, arch: dict[str, Any], parallel: ParallelConfig, dtype: str,
                      seed: int = 0) -> None:
    """Builds a randomly initialised model at ``parallel`` and keeps it under ``key`` (for a weight sync)."""
    unload(key)
    spec = ModelSpec(ModelArch.from_dict(arch), parallel, PrecisionConfig(dtype=dtype))
    context = megatron_parallel(parallel, seed=seed)
    info = context.__enter__()
    try:
        chunks = build_model_chunks(spec)
    except BaseException:
        context.__exit__(None, None, None)
        raise
    state[key] = HeldModel(spec, info, chunks, context)
