"""Recipes: a parameter shard described as pieces of Hugging Face tensors.

A shard is a list of *pieces* (a range of one HF tensor along one dimension, or zero
padding), concatenated along that same dimension. Loading a shard is reading its
pieces; exporting is writing them back; a weight sync intersects two sides' pieces.
The model families (``megarl.models.families``) say which pieces make up each of
their tensors, for megatron-core's layout and for the rollout engine's.

These are plain data so that the families (``megarl.models``) and the converter
(``megarl.convert``, which re-exports them) share one vocabulary without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    hf: str | None  # HF tensor name; None for zero padding
    start: int  # range along the recipe's dim (of the HF tensor; for padding, only the length counts)
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Recipe:
    dim: int
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]  # shape of the assembled shard

    def hf_names(self) -> list[str]:
        return sorted({p.hf for p in self.pieces if p.hf is not None})


@dataclass(frozen=True)
class ShardLayout:
    """The coordinates of one rank's shards."""

    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1
    padded_vocab: int = 0
    # how each expert's matrices are split; None: as the dense layers' (tp_rank, tp)
    etp_rank: int | None = None
    etp: int | None = None

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(rank, size) of the split of each expert's matrices."""
        if self.etp is None:
            return self.tp_rank, self.tp
        return self.etp_rank or 0, self.etp


def block_name(name: str, index: int) -> str:
    """A destination tensor's block ``index`` as a tensor of its own: ``name[index]``.

    An engine that stacks many tensors into one (vLLM's fused MoE experts: one
    ``[E, ...]`` tensor per layer) reports each block under this name, so the sync
    plans, sends and checks them as it does any tensor, and the engine writes block
    ``index`` of ``name``."""
    return f"{name}[{index}]"


def split_block(name: str) -> tuple[str, int | None]:
    """``name[index]`` -> (name, index); any other name -> (name, None)."""
    if name.endswith("]") and "[" in name:
        base, index = name[:-1].rsplit("[", 1)
        if index.isdigit():
            return base, int(index)
    return name, None


def hf_layer(i: int) -> str:
    """The HF name prefix of transformer layer ``i``."""
    return f"model.layers.{i}."


def chunk(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` of ``total`` split evenly into ``parts``."""
    size = total // parts
    return index * size, (index + 1) * size


def whole(name: str, shape: tuple[int, ...]) -> Recipe:
    """A tensor held whole (replicated over tensor-parallel ranks): one piece, dim 0."""
    return Recipe(0, (Piece(name, 0, shape[0]),), shape)


def swiglu_fc1(gate: str, up: str, width: int, hidden: int, tp_rank: int, tp: int) -> Recipe:
    """A SwiGLU MLP's fused input projection on tensor-parallel rank ``tp_rank``: its chunk of
    ``gate``'s rows, then the same chunk of ``up``'s. Megatron-core's ``linear_fc1`` and vLLM's
    ``gate_up_proj`` / fused ``w13`` all lay a rank's shard out this way."""
    start, stop = chunk(width, tp, tp_rank)
    return Recipe(0, (Piece(gate, start, stop), Piece(up, start, stop)), (2 * (stop - start), hidden))


def swiglu_fc2(down: str, width: int, hidden: int, tp_rank: int, tp: int) -> Recipe:
    """A SwiGLU MLP's output projection on rank ``tp_rank``: its chunk of ``down``'s columns."""
    start, stop = chunk(width, tp, tp_rank)
    return Recipe(1, (Piece(down, start, stop),), (hidden, stop - start))
