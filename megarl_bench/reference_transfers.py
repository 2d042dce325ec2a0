"""Reference transfers the refit benchmarks compare the weight sync against (not used in runs).

- raw: the plan's bytes between the same (source, destination) pairs, as plain buffers;
  the floor any sync over the same links can reach.
- full-tensor: the peers' way. The actor gathers each full HF tensor on its rank 0 and
  sends it, whole, to every rollout worker, which loads it through vLLM's own
  ``load_weights`` and keeps its slice; each worker receives tp_r times its shard.

Both run over the sync group a ``WeightSync`` set up, after its ``setup()``.
"""

from __future__ import annotations

import time

import torch

from megarl.convert.mapping import hf_tensor_shapes
from megarl.convert.weights import export_hf_tensors
from megarl.workers.megatron_model import held
from megarl.workers.state import state
from megarl.workers.sync_fns import SYNC_STATE_KEY
from megarl.workers.weight_sync import WeightSync


def hf_listing(key: str) -> list[tuple[str, list[int], str]]:
    model = held(key)
    dtype = str(model.spec.params_dtype).replace("torch.", "")
    return [(name, list(shape), dtype) for name, shape in hf_tensor_shapes(model.spec.arch).items()]


def send_full_tensors(key: str, destinations: list[int]) -> float:
    """Actor rank function (collective over the actor): gather on rank 0, send to every worker."""
    model = held(key)
    names = [name for name, _, _ in hf_listing(key)]
    group = state[SYNC_STATE_KEY]["group"] if SYNC_STATE_KEY in state else None
    started = time.perf_counter()

    def emit(name: str, tensor: torch.Tensor) -> None:
        index = torch.tensor([names.index(name)], dtype=torch.int64)
        for dst in destinations:
            group.send([index], dst, 1).wait()
            group.send([tensor], dst, 2).wait()

    export_hf_tensors(model.chunks, model.spec, model.info, emit, model.spec.params_dtype)
    return time.perf_counter() - started


def send_raw(pairs: dict[int, list[tuple[int, int]]]) -> float | None:
    """Sends plain buffers of the given sizes to each destination: the raw-transfer reference."""
    import time

    if SYNC_STATE_KEY not in state:
        return None
    group = state[SYNC_STATE_KEY]["group"]
    buffers = [(dst, torch.empty(nbytes, dtype=torch.uint8)) for dst, nbytes in pairs.get(group.rank, [])]
    started = time.perf_counter()
    works = [group.send([buffer], dst, 0) for dst, buffer in buffers]
    for work in works:
        work.wait()
    return time.perf_counter() - started


def raw_transfer_seconds(sync: WeightSync) -> float:
    """The plan's bytes between the same (source, destination) pairs as plain buffers."""
    import ray

    pairs: dict[int, dict[int, int]] = {}
    for t in sync.plan.transfers:
        pairs.setdefault(t.src, {}).setdefault(t.dst, 0)
        pairs[t.src][t.dst] += t.nbytes
    send = {src: sorted(d.items()) for src, d in pairs.items()}
    recv: dict[int, list[tuple[int, int]]] = {}
    for src, dsts in pairs.items():
        for dst, nbytes in dsts.items():
            recv.setdefault(dst, []).append((src, nbytes))
    started = time.perf_counter()
    pending = sync.actor.submit(send_raw, pairs=send)
    ray.get([e.receive_raw.remote({d.rank: recv.get(d.rank, []) for d in ws})
             for e, ws in zip(sync.engines, sync.destinations, strict=True)], timeout=sync.timeout_s)
    pending.result(sync.timeout_s)
    return time.perf_counter() - started


def full_tensor_seconds(sync: WeightSync) -> tuple[float, dict[int, int]]:
    """The peers' way: every full tensor to every worker, loaded by vLLM (seconds, bytes per worker)."""
    import ray

    listing = sync.actor.run_on([0], hf_listing, key=sync.model_key)[0]
    destinations = [d.rank for workers in sync.destinations for d in workers]
    started = time.perf_counter()
    pending = sync.actor.submit(send_full_tensors, key=sync.model_key, destinations=destinations)
    received = ray.get([e.receive_full_tensors.remote(listing) for e in sync.engines], timeout=sync.timeout_s)
    pending.result(sync.timeout_s)
    seconds = time.perf_counter() - started
    return seconds, {w["rank"]: w["bytes_received"] for engine in received for w in engine}
