"""The full-tensor baseline (and fallback) of the weight sync, as peers do it.

The actor gathers each full HF tensor on its rank 0 and sends it, whole, to every
rollout worker, which loads it through vLLM's own ``load_weights`` and keeps its
slice. Each worker receives the whole model: tp_r times its shard.
"""

from __future__ import annotations

import time

import torch

from megarl.convert.mapping import hf_tensor_shapes
from megarl.convert.weights import export_hf_tensors
from megarl.workers.megatron_model import held
from megarl.workers.state import state


def hf_listing(key: str) -> list[tuple[str, list[int], str]]:
    model = held(key)
    dtype = str(model.spec.params_dtype).replace("torch.", "")
    return [(name, list(shape), dtype) for name, shape in hf_tensor_shapes(model.spec.arch).items()]


def send_full_tensors(key: str, destinations: list[int]) -> float:
    """Actor rank function (collective over the actor): gather on rank 0, send to every worker."""
    model = held(key)
    names = [name for name, _, _ in hf_listing(key)]
    group = state["weight_sync"]["group"] if "weight_sync" in state else None
    started = time.perf_counter()

    def emit(name: str, tensor: torch.Tensor) -> None:
        index = torch.tensor([names.index(name)], dtype=torch.int64)
        for dst in destinations:
            group.send([index], dst, 1).wait()
            group.send([tensor], dst, 2).wait()

    export_hf_tensors(model.chunks, model.spec, model.info, emit, model.spec.params_dtype)
    return time.perf_counter() - started
