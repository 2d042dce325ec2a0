"""The sync planner, executed in memory: every vLLM shard gets exactly its bytes, once."""

from __future__ import annotations

import pytest
import torch

from megarl.convert.mapping import ShardLayout, hf_tensor_shapes, recipe
from megarl.models.hf_arch import ModelArch, RopeConfig
from megarl.reshard.checksum import region_checksum, tensor_checksum
from megarl.reshard.plan import DestRank, ParamInfo, PlanError, SourceRank, build_plan
from megarl.rollout.vllm_layout import VLLM_LAYOUT, vllm_param_names, vllm_recipe

ARCH = ModelArch(family="llama", vocab_size=250, hidden_size=64, ffn_hidden_size=96, num_layers=4, num_heads=8,
                 num_kv_heads=2, head_dim=8, norm_eps=1e-5, tie_embeddings=False, qkv_bias=True,
                 max_position_embeddings=128, rope=RopeConfig(theta=10000.0))
# Qwen3: replicated QK-norms on both sides, no biases, head_dim 16 (not hidden / heads = 8)
QWEN3 = ModelArch(**{**ARCH.to_dict(), "rope": ARCH.rope, "family": "qwen3", "qkv_bias": False, "head_dim": 16})


def hf_tensors(arch: ModelArch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in hf_tensor_shapes(arch).items()}


def megatron_names(arch: ModelArch, pp_rank: int, pp: int) -> list[str]:
    per_stage = arch.num_layers // pp
    names = ["embedding.word_embeddings.weight"] if pp_rank == 0 else []
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        p = f"decoder.layers.{layer}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.family == "qwen3":
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    if pp_rank == pp - 1:
        names.append("decoder.final_layernorm.weight")
        if not arch.tie_embeddings:
            names.append("output_layer.weight")
    return names


def sources(arch, hf, tp, pp, padded_vocab=256):
    out, tensors = [], {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = pp_rank * tp + tp_rank
            layout = ShardLayout(tp_rank=tp_rank, tp=tp, padded_vocab=padded_vocab)
            mine = {}
            for name in megatron_names(arch, pp_rank, pp):
                rec = recipe(arch, name, layout)
                parts = [hf[p.hf].narrow(rec.dim, p.start, p.length) if p.hf else
                         torch.zeros([p.length if i == rec.dim else s for i, s in enumerate(rec.shape)])
                         for p in rec.pieces]
                mine[name] = torch.cat(parts, dim=rec.dim)
            tensors[rank] = mine
            out.append(SourceRank(rank, layout, {n: ParamInfo(tuple(t.shape), "float32") for n, t in mine.items()}))
    return out, tensors


def dests(arch, tp, first_rank):
    out = []
    for r in range(tp):
        params = {n: ParamInfo(vllm_recipe(arch, n, r, tp).shape, "float32") for n in vllm_param_names(arch)}
        out.append(DestRank(first_rank + r, r, tp, params))
    return out


def expected_vllm_shard(arch, hf, name, tp_rank, tp):
    rec = vllm_recipe(arch, name, tp_rank, tp)
    parts = [hf[p.hf].narrow(rec.dim, p.start, p.length) if p.hf else
             torch.zeros([p.length if i == rec.dim else s for i, s in enumerate(rec.shape)]) for p in rec.pieces]
    return torch.cat(parts, dim=rec.dim)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("rollout_tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_plan_delivers_each_shard_exactly(tp, pp, rollout_tp, tied):
    _delivers_each_shard_exactly(ModelArch(**{**ARCH.to_dict(), "rope": ARCH.rope, "tie_embeddings": tied}),
                                 tp, pp, rollout_tp)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("rollout_tp", [1, 2, 4])
def test_plan_delivers_each_qwen3_shard_exactly(tp, pp, rollout_tp):
    assert {"model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight"} <= set(
        vllm_param_names(QWEN3))
    _delivers_each_shard_exactly(QWEN3, tp, pp, rollout_tp)


def _delivers_each_shard_exactly(arch, tp, pp, rollout_tp):
    hf = hf_tensors(arch)
    srcs, src_tensors = sources(arch, hf, tp, pp)
    dsts = dests(arch, rollout_tp, first_rank=len(srcs))
    plan = build_plan(arch, srcs, dsts, VLLM_LAYOUT, bucket_bytes=4096)
    received = {d.rank: {n: torch.full(vllm_recipe(arch, n, d.tp_rank, rollout_tp).shape, float("nan"))
                         for n in d.params} for d in dsts}
    for t in plan.transfers:
        target = received[t.dst][t.dst_param].narrow(t.dim, t.dst_offset, t.length)
        assert torch.isnan(target).all(), f"{t.dst_param} on rank {t.dst} written twice"
        target.copy_(src_tensors[t.src][t.src_param].narrow(t.dim, t.src_offset, t.length))
    for d in dsts:
        for name, tensor in received[d.rank].items():
            expected = expected_vllm_shard(arch, hf, name, d.tp_rank, rollout_tp)
            real = ~torch.isnan(tensor)
            # only vocab padding rows stay unwritten (vLLM keeps them zero)
            assert torch.equal(tensor[real], expected[real]), name
            assert (expected[~real] == 0).all(), name
    assert plan.received_bytes() == plan.needed_bytes
    assert all(sum(t.nbytes for t in bucket) <= 4096 for bucket in plan.buckets)


def test_fragments_checksums_agree():
    arch = ARCH
    hf = hf_tensors(arch)
    srcs, src_tensors = sources(arch, hf, 2, 2)
    dsts = dests(arch, 2, first_rank=len(srcs))
    plan = build_plan(arch, srcs, dsts, VLLM_LAYOUT, bucket_bytes=10_000)
    sent: dict = {}
    for s in srcs:
        fragment = plan.fragment(s.rank)
        for bucket in fragment["buckets"]:
            for message in bucket["send"]:
                for (name, dim, offset, length), (dst_name, dst_offset) in zip(
                        message["items"], message["destinations"], strict=True):
                    shape = fragment["peer_shapes"][str(message["peer"])][dst_name]
                    key = (message["peer"], dst_name)
                    values = src_tensors[s.rank][name].narrow(dim, offset, length)
                    sent[key] = sent.get(key, 0.0) + region_checksum(values, tuple(shape), dim, dst_offset)
    for d in dsts:
        for name in d.params:
            shard = expected_vllm_shard(arch, hf, name, d.tp_rank, 2)
            assert abs(sent[(d.rank, name)] - tensor_checksum(shard)) < 1e-6 * max(1.0, abs(sent[(d.rank, name)]))
    # rows swapped inside a shard change the checksum
    shard = expected_vllm_shard(arch, hf, "model.layers.0.self_attn.qkv_proj.weight", 0, 2)
    assert tensor_checksum(shard) != tensor_checksum(shard.flip(0))


def test_engine_of_another_model_is_refused():
    hf = hf_tensors(ARCH)
    srcs, _ = sources(ARCH, hf, 1, 1)
    other = ModelArch(**{**ARCH.to_dict(), "rope": ARCH.rope, "hidden_size": 32, "head_dim": 4})
    with pytest.raises(PlanError, match=r"model\.embed_tokens\.weight on vLLM TP rank 0/1 has shape \[256, 32\]"):
        build_plan(ARCH, srcs, dests(other, 1, first_rank=1), VLLM_LAYOUT, bucket_bytes=4096)
    fewer = ModelArch(**{**ARCH.to_dict(), "rope": ARCH.rope, "num_layers": 2})
    with pytest.raises(PlanError, match=r"does not match the actor \(4 layers.*missing \['model\.layers\.2"):
        build_plan(ARCH, srcs, dests(fewer, 1, first_rank=1), VLLM_LAYOUT, bucket_bytes=4096)


def test_sources_that_do_not_cover_the_model_are_refused():
    hf = hf_tensors(ARCH)
    srcs, _ = sources(ARCH, hf, 1, 2)
    with pytest.raises(PlanError, match=r"no actor rank holds rows/columns 0\.\. of model\.layers\.2"):
        build_plan(ARCH, srcs[:1], dests(ARCH, 1, first_rank=2), VLLM_LAYOUT, bucket_bytes=4096)


def test_the_destination_layout_is_the_callers():
    """The planner knows no engine's layout: any DestinationLayout it is given is filled exactly.
    Here an engine that holds every HF tensor whole, on each of two ranks."""
    from megarl.models.recipes import Piece, Recipe
    from megarl.reshard.plan import DestinationLayout

    shapes = hf_tensor_shapes(ARCH)

    def whole(arch, name, tp_rank, tp, ep):  # along the dim the actor splits (the planner needs the same one)
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        return Recipe(dim, (Piece(name, 0, shapes[name][dim]),), shapes[name])

    whole_tensors = DestinationLayout(engine="whole-tensor", recipe=whole,
                                      param_names=lambda arch, ep_rank, ep: list(hf_tensor_shapes(arch)))
    hf = hf_tensors(ARCH)
    srcs, src_tensors = sources(ARCH, hf, 2, 2)
    dsts = [DestRank(len(srcs) + r, r, 2, {n: ParamInfo(s, "float32") for n, s in shapes.items()}) for r in range(2)]
    plan = build_plan(ARCH, srcs, dsts, whole_tensors, bucket_bytes=4096)
    for d in dsts:
        received = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
        for t in (t for t in plan.transfers if t.dst == d.rank):
            received[t.dst_param].narrow(t.dim, t.dst_offset, t.length).copy_(
                src_tensors[t.src][t.src_param].narrow(t.dim, t.src_offset, t.length))
        assert all(torch.equal(received[n], hf[n]) for n in shapes)
    # a mismatch is reported in the engine's own name
    with pytest.raises(PlanError, match=r"the whole-tensor engine's model does not match the actor"):
        build_plan(ARCH, srcs, dests(ARCH, 1, first_rank=len(srcs)), whole_tensors, bucket_bytes=4096)
