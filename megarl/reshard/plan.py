"""Shard-to-shard weight sync plans: Megatron (TP, PP[, EP]) ranks → rollout engine (vLLM) TP ranks.

Both sides describe their shards as recipes of HF tensor pieces (see
``megarl.convert.mapping``): the sources by megatron-core's layout, the destinations
by the ``DestinationLayout`` the rollout backend passes in (vLLM's is
``megarl.rollout.vllm_layout.VLLM_LAYOUT``). The planner intersects them per HF tensor, so each
destination rank receives exactly the slices of its own shard, each from one
source, once. Source replicas (norms on every TP rank) are spread over
destinations. A plan is built once from metadata both sides report; its
fingerprint lets each side detect a stale plan (shapes or layout changed)
instead of silently reusing it.

The plan is cut into buckets of at most ``bucket_bytes`` and, inside a bucket,
into messages: a transfer whose regions are contiguous on both sides travels
alone and lands in place (zero copy); the others between one (source,
destination) pair are packed into a single message.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megarl.convert.mapping import Recipe, ShardLayout, recipe
from megarl.models.hf_arch import ModelArch

_ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class PlanError(ValueError):
    """The two sides do not fit together; the message names the parameter or field."""


@dataclass(frozen=True)
class DestinationLayout:
    """How a rollout engine lays out a model's weights over its tensor-parallel ranks."""

    engine: str  # names the engine in messages ("vLLM")
    # (arch, ep_rank, ep) -> every parameter of one engine rank
    param_names: Callable[[ModelArch, int, int], list[str]]
    # (arch, name, tp_rank, tp, ep) -> its HF pieces
    recipe: Callable[[ModelArch, str, int, int, int], Recipe]


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch."


@dataclass(frozen=True)
class SourceRank:
    """A Megatron rank that holds unique weights (data-parallel rank 0)."""

    rank: int  # rank in the sync group
    layout: ShardLayout
    params: dict[str, ParamInfo]  # canonical megatron name -> info


@dataclass(frozen=True)
class DestRank:
    """A rollout engine's worker (a vLLM worker)."""

    rank: int  # rank in the sync group
    tp_rank: int
    tp: int
    params: dict[str, ParamInfo]  # the engine's parameter name -> logical shape and dtype
    # the engine's expert parallelism: its MoE experts split whole over ep ranks (1: over tp)
    ep_rank: int = 0
    ep: int = 1


@dataclass(frozen=True)
class Transfer:
    src: int
    src_param: str
    dst: int
    dst_param: str
    dim: int
    src_offset: int
    dst_offset: int
    length: int
    row_elements: int  # elements per unit of `length` (the product of the other dims)
    dtype: str  # the destination's dtype: what travels

    @property
    def nbytes(self) -> int:
        return self.length * self.row_elements * _ELEMENT_SIZE[self.dtype]


@dataclass
class SyncPlan:
    plan_id: str
    transfers: list[Transfer]
    buckets: list[list[Transfer]]
    needed_bytes: dict[int, int]  # destination rank -> bytes of its shard (padding excluded)
    dest_shapes: dict[int, dict[str, tuple[int, ...]]]
    source_fingerprints: dict[int, str] = field(default_factory=dict)
    dest_fingerprints: dict[int, str] = field(default_factory=dict)

    def received_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.dst] += t.nbytes
        return dict(out)

    def fragment(self, rank: int) -> dict:
        """What one rank of the sync group executes, as plain JSON-able data."""
        return _fragment(self, rank)


def meta_fingerprint(params: dict[str, ParamInfo]) -> str:
    text = json.dumps(sorted((name, list(info.shape), info.dtype) for name, info in params.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_dest(arch: ModelArch, dest: DestRank, layout: DestinationLayout) -> dict[str, Recipe]:
    expected = layout.param_names(arch, dest.ep_rank, dest.ep)
    missing = sorted(set(expected) - set(dest.params))
    extra = sorted(set(dest.params) - set(expected))
    if missing or extra:
        detail = []
        if missing:
            detail.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if extra:
            detail.append(f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}")
        raise PlanError(f"the {layout.engine} engine's model does not match the actor ({arch.num_layers} layers, "
                        f"tied embeddings={arch.tie_embeddings}): {'; '.join(detail)}")
    recipes = {}
    for name in expected:
        rec = layout.recipe(arch, name, dest.tp_rank, dest.tp, dest.ep)
        got = dest.params[name].shape
        if tuple(got) != rec.shape:
            raise PlanError(f"the {layout.engine} engine's model does not match the actor: {name} on "
                            f"{layout.engine} TP rank {dest.tp_rank}/{dest.tp} has shape {list(got)}, the actor's "
                            f"architecture gives "
                            f"{list(rec.shape)} (hidden={arch.hidden_size}, heads={arch.num_heads}, "
                            f"kv_heads={arch.num_kv_heads}, ffn={arch.ffn_hidden_size}, vocab={arch.vocab_size})")
        recipes[name] = rec
    return recipes


@dataclass(frozen=True)
class _SourcePiece:
    rank: int
    param: str
    dim: int
    start: int  # in the HF tensor
    stop: int
    offset: int  # in the source shard
    row_elements: int
    dtype: str


def _source_index(arch: ModelArch, sources: list[SourceRank], value_head: bool) -> dict[str, list[_SourcePiece]]:
    index: dict[str, list[_SourcePiece]] = defaultdict(list)
    for src in sources:
        for name, info in src.params.items():
            rec = recipe(arch, name, src.layout, value_head)
            if tuple(info.shape) != rec.shape:
                raise PlanError(f"actor rank {src.rank}: {name} has shape {list(info.shape)}, its layout gives "
                                f"{list(rec.shape)}")
            offset = 0
            for piece in rec.pieces:
                if piece.hf is not None:
                    index[piece.hf].append(_SourcePiece(src.rank, name, rec.dim, piece.start, piece.stop, offset,
                                                        _row_elements(rec.shape, rec.dim), info.dtype))
                offset += piece.length
    for pieces in index.values():
        pieces.sort(key=lambda p: (p.start, p.rank))
    return index


def _row_elements(shape: tuple[int, ...], dim: int) -> int:
    n = 1
    for i, size in enumerate(shape):
        if i != dim:
            n *= size
    return n


def _cover(hf: str, start: int, stop: int, candidates: list[_SourcePiece], balance: int
           ) -> list[tuple[_SourcePiece, int, int]]:
    """Splits [start, stop) of ``hf`` over source pieces; replicas are chosen by ``balance``."""
    out, position = [], start
    while position < stop:
        covering = [c for c in candidates if c.start <= position < c.stop]
        if not covering:
            raise PlanError(f"no actor rank holds rows/columns {position}.. of {hf}")
        chosen = covering[balance % len(covering)]
        end = min(stop, chosen.stop)
        out.append((chosen, position, end))
        position = end
    return out


def build_plan(arch: ModelArch, sources: list[SourceRank], dests: list[DestRank], layout: DestinationLayout,
               bucket_bytes: int, value_head: bool = False) -> SyncPlan:
    """The transfers that give every destination its own shard (as ``layout`` cuts it), in buckets."""
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    index = _source_index(arch, sources, value_head)
    transfers: list[Transfer] = []
    needed: dict[int, int] = {}
    shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    for dest in dests:
        recipes = _check_dest(arch, dest, layout)
        shapes[dest.rank] = {name: rec.shape for name, rec in recipes.items()}
        needed[dest.rank] = 0
        for name, rec in recipes.items():
            dtype = dest.params[name].dtype
            row = _row_elements(rec.shape, rec.dim)
            offset = 0
            for piece in rec.pieces:
                if piece.hf is not None:
                    needed[dest.rank] += piece.length * row * _ELEMENT_SIZE[dtype]
                    for src, lo, hi in _cover(piece.hf, piece.start, piece.stop, index.get(piece.hf, []), dest.rank):
                        if src.dim != rec.dim:
                            raise PlanError(f"{piece.hf}: the actor splits dim {src.dim}, {layout.engine} "
                                            f"dim {rec.dim}")
                        transfers.append(Transfer(
                            src=src.rank, src_param=src.param, dst=dest.rank, dst_param=name, dim=rec.dim,
                            src_offset=src.offset + lo - src.start, dst_offset=offset + lo - piece.start,
                            length=hi - lo, row_elements=row, dtype=dtype))
                offset += piece.length
    transfers = _merge_adjacent(transfers)
    buckets = _bucketize(transfers, bucket_bytes)
    plan_id = hashlib.sha256(json.dumps(
        [arch.to_dict(), bucket_bytes, value_head,
         sorted((s.rank, meta_fingerprint(s.params)) for s in sources),
         sorted((d.rank, meta_fingerprint(d.params)) for d in dests)], sort_keys=True, default=str,
    ).encode()).hexdigest()[:16]
    return SyncPlan(
        plan_id=plan_id, transfers=[t for b in buckets for t in b], buckets=buckets, needed_bytes=needed,
        dest_shapes=shapes,
        source_fingerprints={s.rank: meta_fingerprint(s.params) for s in sources},
        dest_fingerprints={d.rank: meta_fingerprint(d.params) for d in dests},
    )


def _merge_adjacent(transfers: list[Transfer]) -> list[Transfer]:
    """Joins consecutive transfers that continue each other on both sides (fewer messages)."""
    merged: list[Transfer] = []
    for t in transfers:
        last = merged[-1] if merged else None
        if (last is not None and (last.src, last.src_param, last.dst, last.dst_param, last.dim, last.dtype)
                == (t.src, t.src_param, t.dst, t.dst_param, t.dim, t.dtype)
                and last.src_offset + last.length == t.src_offset and last.dst_offset + last.length == t.dst_offset):
            merged[-1] = Transfer(last.src, last.src_param, last.dst, last.dst_param, last.dim, last.src_offset,
                                  last.dst_offset, last.length + t.length, last.row_elements, last.dtype)
        else:
            merged.append(t)
    return merged


def _bucketize(transfers: list[Transfer], bucket_bytes: int) -> list[list[Transfer]]:
    buckets: list[list[Transfer]] = [[]]
    size = 0
    for t in transfers:
        # A transfer larger than a bucket is cut along its dimension.
        unit = t.row_elements * _ELEMENT_SIZE[t.dtype]
        max_len = max(1, bucket_bytes // unit)
        for start in range(0, t.length, max_len):
            length = min(max_len, t.length - start)
            part = Transfer(t.src, t.src_param, t.dst, t.dst_param, t.dim, t.src_offset + start,
                            t.dst_offset + start, length, t.row_elements, t.dtype)
            if buckets[-1] and size + part.nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(part)
            size += part.nbytes
    return [b for b in buckets if b]


def _contiguous(shape: tuple[int, ...], dim: int, offset: int, length: int) -> bool:
    """Is a [offset, offset+length) slice along ``dim`` one run of memory in a contiguous tensor?"""
    if dim == 0 or len(shape) == 1:
        return True
    outer = 1
    for size in shape[:dim]:
        outer *= size
    return outer == 1 or (offset == 0 and length == shape[dim])


def _fragment(plan: SyncPlan, rank: int) -> dict:
    # Shapes each side needs to cut regions: sources read their own tensors; destinations may
    # hold emptied (prepacked) weights, so the plan carries their logical shapes.
    dest_shapes = plan.dest_shapes
    buckets = []
    peer_shapes: dict[int, dict[str, list[int]]] = {}  # a source's view of what it fills
    last_bucket: dict[str, int] = {}
    for b, bucket in enumerate(plan.buckets):
        send, recv = [], []
        tag = 0
        by_pair: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        for t in bucket:
            shape = dest_shapes[t.dst][t.dst_param]
            direct = _contiguous(shape, t.dim, t.dst_offset, t.length)
            if direct:
                message = {"tag": tag, "dtype": t.dtype, "direct": True, "nbytes": t.nbytes}
                if t.src == rank:
                    send.append({**message, "peer": t.dst, "items": [[t.src_param, t.dim, t.src_offset, t.length]],
                                 "destinations": [[t.dst_param, t.dst_offset]]})
                    peer_shapes.setdefault(t.dst, {})[t.dst_param] = list(shape)
                if t.dst == rank:
                    recv.append({**message, "peer": t.src, "items": [[t.dst_param, t.dim, t.dst_offset, t.length]]})
                tag += 1
            else:
                by_pair[(t.src, t.dst)].append(t)
            if t.dst == rank:
                last_bucket[t.dst_param] = b
        for (src, dst), group in sorted(by_pair.items()):
            nbytes = sum(t.nbytes for t in group)
            dtype = group[0].dtype
            message = {"tag": tag, "dtype": dtype, "direct": False, "nbytes": nbytes}
            if src == rank:
                send.append({**message, "peer": dst, "items": [[t.src_param, t.dim, t.src_offset, t.length]
                                                                for t in group],
                             "destinations": [[t.dst_param, t.dst_offset] for t in group]})
                for t in group:
                    peer_shapes.setdefault(dst, {})[t.dst_param] = list(dest_shapes[dst][t.dst_param])
            if dst == rank:
                recv.append({**message, "peer": src, "items": [[t.dst_param, t.dim, t.dst_offset, t.length]
                                                               for t in group]})
            tag += 1
        buckets.append({"send": send, "recv": recv})
    complete: dict[int, list[str]] = defaultdict(list)
    for param, b in last_bucket.items():
        complete[b].append(param)
    for b, bucket in enumerate(buckets):
        bucket["complete"] = sorted(complete.get(b, []))
    is_dest = rank in plan.dest_shapes
    return {
        "plan_id": plan.plan_id,
        "rank": rank,
        "fingerprint": (plan.dest_fingerprints if is_dest else plan.source_fingerprints).get(rank),
        "shapes": {name: list(shape) for name, shape in dest_shapes.get(rank, {}).items()},
        "peer_shapes": {str(peer): shapes for peer, shapes in peer_shapes.items()},
        "buckets": [b for b in buckets if b["send"] or b["recv"] or b["complete"]],
    }


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)
