"""Moving weights between HF tensors and a rank's megatron-core parameters.

``canonical_parameters`` names each local parameter canonically (global layer and
expert index); the mapping's recipe then says which HF pieces make it up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megarl.convert.hf_io import HFReader
from megarl.convert.mapping import ShardLayout, canonical_name, hf_tensor_shapes, recipe
from megarl.distributed.parallel import RankInfo
from megarl.models.gpt import ModelSpec
from megarl.models.lora import is_adapter
from megarl.platform import current_platform


def shard_layout(spec: ModelSpec, info: RankInfo) -> ShardLayout:
    return ShardLayout(tp_rank=info.tp_rank, tp=info.tp, ep_rank=info.ep_rank, ep=info.ep,
                       padded_vocab=spec.padded_vocab, etp_rank=info.etp_rank, etp=info.etp)


def canonical_parameters(chunks: list, spec: ModelSpec, info: RankInfo) -> Iterator[tuple[str, torch.Tensor]]:
    experts_per_rank = (spec.arch.num_experts or 1) // info.ep
    for wrapped in chunks:
        chunk = getattr(wrapped, "module", wrapped)  # megatron DDP wraps the GPTModel
        layers = chunk.decoder.layers
        # + the routers' expert bias: a buffer, not a parameter, but state the HF checkpoint holds
        # (DeepSeek-V3's e_score_correction_bias) and that training moves
        biases = [(name, buf) for name, buf in chunk.named_buffers() if name.endswith(".router.expert_bias")]
        for name, param in [*chunk.named_parameters(), *biases]:
            if is_adapter(name):  # LoRA adapters have no HF tensor of their own (megarl.models.lora)
                continue
            global_layer = None
            if name.startswith("decoder.layers."):
                local = int(name.split(".")[2])
                global_layer = layers[local].layer_number - 1
            yield canonical_name(name, global_layer, info.ep_rank, experts_per_rank), param


def load_hf_weights(chunks: list, reader: HFReader, spec: ModelSpec, info: RankInfo,
                    new_value_head: bool = False) -> int:
    """Fills every parameter of ``chunks`` from the HF checkpoint; returns the count loaded.
    ``new_value_head``: a value head the checkpoint lacks (a language model becoming a reward
    model or critic) keeps its initialisation instead of failing."""
    layout = shard_layout(spec, info)
    count = 0
    fresh_head = new_value_head and spec.value_head and "score.weight" not in reader.names()
    for name, param in canonical_parameters(chunks, spec, info):
        if fresh_head and name == "output_layer.weight":
            continue  # megarl.models.value_head: normal(0, 0.02), the same on every rank (shared seed)
        rec = recipe(spec.arch, name, layout, value_head=spec.value_head)
        if tuple(param.shape) != rec.shape:
            raise ValueError(f"parameter {name}: megatron shard shape {list(param.shape)} != "
                             f"{list(rec.shape)} expected from the HF config (tp_rank {info.tp_rank})")
        with torch.no_grad():
            reader.read_shard_into(rec, param.data)
        count += 1
    return count


def export_hf_tensors(chunks: list, spec: ModelSpec, info: RankInfo,
                      emit: Callable[[str, torch.Tensor], None], dtype: torch.dtype) -> None:
    """Collective: assembles every HF tensor on global rank 0 and passes it to ``emit``.

    Ranks send their shards to rank 0 one parameter at a time; rank 0 keeps only the
    HF tensors still missing pieces, so it holds at most about one layer beyond its
    own shards. Replicas (data- and context-parallel ranks past the first) send nothing.
    """
    layout = shard_layout(spec, info)
    mine = {}
    for name, param in canonical_parameters(chunks, spec, info):
        if info.replica(expert=".local_experts." in name) != 0:
            continue
        if name == "output_layer.weight" and spec.arch.tie_embeddings and not spec.value_head:
            continue  # the tied copy on the last stage; the embedding carries it
        mine[name] = param
    listing = [(name, recipe(spec.arch, name, layout, spec.value_head), p.dtype) for name, p in mine.items()]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, listing)

    shapes = hf_tensor_shapes(spec.arch, spec.value_head)
    # Each HF tensor is complete once all of its rows/columns have arrived.
    remaining = {name: shapes[name][0] for name in shapes}
    needed_dim: dict[str, int] = {}
    open_tensors: dict[str, torch.Tensor] = {}
    # Replicated parameters (norms on every TP rank) are offered by several ranks: take each
    # identical contribution once, from its lowest rank. Every rank derives the same order.
    order, offered = [], set()
    for src, name, rec, dt in sorted(((src, name, rec, dt) for src, items in enumerate(everyone)
                                      for name, rec, dt in items), key=lambda item: _sort_key(item[1], item[0])):
        if (name, rec.pieces) not in offered:
            offered.add((name, rec.pieces))
            order.append((src, name, rec, dt))
    rank = dist.get_rank()
    emitted: set[str] = set()
    for src, name, rec, param_dtype in order:
        if rank not in (0, src):
            continue
        if src == rank:
            shard = mine[name].detach()
            if rank != 0:
                dist.send(shard.contiguous(), dst=0)
                continue
        else:
            # on the rank's device: the default group's backend is NCCL on GPU, which takes no CPU tensor
            shard = torch.empty(rec.shape, dtype=param_dtype, device=current_platform().rank_device())
            dist.recv(shard, src=src)
        offset = 0
        for piece in rec.pieces:
            part = shard.narrow(rec.dim, offset, piece.length)
            offset += piece.length
            if piece.hf is None:
                continue
            full_shape = shapes[piece.hf]
            if piece.hf not in open_tensors:
                open_tensors[piece.hf] = torch.empty(full_shape, dtype=dtype)
                needed_dim[piece.hf] = rec.dim
                remaining[piece.hf] = full_shape[rec.dim]
            open_tensors[piece.hf].narrow(rec.dim, piece.start, piece.length).copy_(part)
            remaining[piece.hf] -= piece.length
            if remaining[piece.hf] == 0:
                if piece.hf in emitted:
                    raise RuntimeError(f"export: {piece.hf} was assembled twice")
                emitted.add(piece.hf)
                emit(piece.hf, open_tensors.pop(piece.hf))
    if rank == 0 and open_tensors:
        raise RuntimeError(f"export incomplete: {sorted(open_tensors)[:5]} still miss pieces")


def _sort_key(name: str, src: int) -> tuple:
    parts = name.split(".")
    if name.startswith("embedding."):
        return (0, 0, name, src)
    if name.startswith("decoder.layers."):
        return (1, int(parts[2]), name, src)
    return (2, 0, name, src)
