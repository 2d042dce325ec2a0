"""The Megatron side of a weight sync: which shards a rank sources, and sending them.

Only the first replica of each (tp, pp[, ep]) coordinate sources weights (the other
data- and context-parallel ranks hold the same values, ``RankInfo.replica``), and the
tied output layer of the last pipeline stage is left to the embedding it copies.
"""

from __future__ import annotations

import torch

from megarl.convert.weights import canonical_parameters, shard_layout
from megarl.distributed.parallel import RankInfo
from megarl.models.gpt import ModelSpec
from megarl.models.lora import has_lora, merged_weights
from megarl.reshard.checksum import region_checksum
from megarl.reshard.plan import ParamInfo, dtype_of


def source_tensors(chunks: list, spec: ModelSpec, info: RankInfo) -> dict[str, torch.Tensor]:
    """Canonical name → tensor of every shard this rank sources (empty for replicas). A LoRA
    actor's adapted linears go out merged (W + scale * B @ A, ``megarl.models.lora``): the engine
    serves the adapted policy with its ordinary weights, the same bytes as a full model's."""
    out = {}
    merged = merged_weights(chunks) if info.replica() == 0 and has_lora(chunks) else {}
    for name, param in canonical_parameters(chunks, spec, info):
        if info.replica(expert=".local_experts." in name) != 0:
            continue
        if name == "output_layer.weight" and spec.arch.tie_embeddings and not spec.value_head:
            continue
        out[name] = merged.get(id(param), param.data)
    return out


def source_meta(chunks: list, spec: ModelSpec, info: RankInfo) -> dict | None:
    """What the planner needs from this rank, or None if it sources nothing."""
    tensors = source_tensors(chunks, spec, info)
    if not tensors:
        return None
    return {
        "layout": shard_layout(spec, info),
        "params": {name: ParamInfo(tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in tensors.items()},
    }


def expected_checksums(fragment: dict, chunks: list, spec: ModelSpec, info: RankInfo
                       ) -> dict[tuple[int, str], float]:
    """Checksums of what this rank sends, placed where each destination puts it."""
    tensors = source_tensors(chunks, spec, info)
    sums: dict[tuple[int, str], float] = {}
    for bucket in fragment["buckets"]:
        for message in bucket["send"]:
            for (name, dim, offset, length), (dst_name, dst_offset) in zip(
                    message["items"], message["destinations"], strict=True):
                # as sent: in the message's dtype (an FP32 actor sends a BF16 engine BF16 values)
                values = tensors[name].narrow(dim, offset, length).to(dtype_of(message["dtype"]))
                shape = fragment["peer_shapes"][str(message["peer"])][dst_name]
                key = (message["peer"], dst_name)
                sums[key] = sums.get(key, 0.0) + region_checksum(values, tuple(shape), dim, dst_offset)
    return sums
