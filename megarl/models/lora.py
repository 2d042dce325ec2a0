"""LoRA adapters on a built megatron-core model, tensor- and pipeline-parallel, PEFT's numbers.

Each target is a Hugging Face module as PEFT names it (``q_proj``, ``gate_proj``, ...); its adapter
``y += scale * B @ A @ dropout(x)`` (A: [r, in], B: [out, r], scale = alpha / r) sits on the
megatron-core linear that holds it, at the rows (column-parallel: ``linear_qkv``, ``linear_fc1``)
or columns (row-parallel: ``linear_proj``, ``linear_fc2``) the family's shard recipe gives that
HF tensor on this rank. So a fused linear adapts only its targets' rows, and a tensor-parallel
model computes the unsharded LoRA exactly:
- column-parallel: A is whole on every rank, B holds the rank's rows; the gradient of A x is
  summed over the tensor-parallel group (megatron-core's ``copy_to`` region), as the base's input is;
- row-parallel: A holds the rank's input columns, B is whole; the partial products A x (r wide,
  not the output's width) are summed over the group before B, as the base's outputs are.

The adapters are child modules (``<linear>.lora.<target>.lora_A`` / ``lora_B``) so that DDP and
the optimizer see them; ``is_adapter`` tells their names apart, and the base's own parameter names
and shapes are unchanged (checkpoints, weight sync). The forward runs through a forward hook on
the base linear. Sequence parallelism and MoE experts are not adapted (config checks refuse them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megarl.config.lora import LoraConfig
from megarl.models.arch import family_of
from megarl.models.recipes import ShardLayout, hf_layer

# PEFT's target -> (the megatron-core linear holding it, the HF tensor under the layer's prefix)
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "self_attn.q_proj.weight"),
    "k_proj": ("self_attention.linear_qkv", "self_attn.k_proj.weight"),
    "v_proj": ("self_attention.linear_qkv", "self_attn.v_proj.weight"),
    "o_proj": ("self_attention.linear_proj", "self_attn.o_proj.weight"),
    "gate_proj": ("mlp.linear_fc1", "mlp.gate_proj.weight"),
    "up_proj": ("mlp.linear_fc1", "mlp.up_proj.weight"),
    "down_proj": ("mlp.linear_fc2", "mlp.down_proj.weight"),
}
_MARK = ".lora."


def is_adapter(name: str) -> bool:
    """Whether a parameter name (megatron-core's, local or canonical) is a LoRA adapter's."""
    return _MARK in name


@dataclass(frozen=True)
class Span:
    """Rows (or columns) [local, local + length) of this rank's shard hold [hf, hf + length) of the HF tensor."""

    local: int
    hf: int
    length: int


class Adapter(torch.nn.Module):
    """One target's A and B on this rank, and where they sit in the HF tensor and the shard."""

    def __init__(self, target: str, layer: int, rank: int, hf_shape: tuple[int, int], spans: list[Span],
                 column: bool, dtype: torch.dtype, generator: torch.Generator) -> None:
        super().__init__()
        out_full, in_full = hf_shape
        self.target, self.layer, self.column, self.spans = target, layer, column, spans
        self.full_width = out_full if column else in_full  # the HF tensor's width along the split
        local = sum(s.length for s in spans)
        full_a = torch.empty(rank, in_full)
        # PEFT's init: A Kaiming-uniform (a = sqrt 5, as nn.Linear), B zero, so training starts at the base
        torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
        a = full_a if column else torch.cat([full_a[:, s.hf:s.hf + s.length] for s in spans], dim=1)
        self.lora_A = torch.nn.Parameter(a.to(dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(local if column else out_full, rank, dtype=dtype))
        # where this target's rows land among the shard's output rows (column-parallel only)
        rows = [torch.arange(s.local, s.local + s.length) for s in spans] if column else []
        self.register_buffer("rows", torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
                             persistent=False)

    def sharded(self) -> str:
        """Which of A and B is split over the tensor-parallel group."""
        return "lora_B" if self.column else "lora_A"


class LoraState(torch.nn.Module):
    """The adapters of one base linear (``<linear>.lora``), and whether they are on."""

    def __init__(self, adapters: dict[str, Adapter], scale: float, dropout: float, tp: int) -> None:
        super().__init__()
        self.adapters = torch.nn.ModuleDict(adapters)
        self.scale, self.dropout, self.tp = scale, dropout, tp
        self.enabled = True

    def delta(self, x: torch.Tensor, out_width: int) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        total = None
        for adapter in self.adapters.values():
            xd = torch.nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x
            u = xd @ adapter.lora_A.t()
            if self.tp > 1:
                u = copy_to_tensor_model_parallel_region(u) if adapter.column \
                    else reduce_from_tensor_model_parallel_region(u)
            d = (u @ adapter.lora_B.t()) * self.scale
            if adapter.column:
                d = torch.zeros(*d.shape[:-1], out_width, dtype=d.dtype, device=d.device).index_add(
                    -1, adapter.rows.to(d.device), d)
            total = d if total is None else total + d
        return total


def _hook(module, args, output):
    state: LoraState = module.lora
    if not state.enabled:
        return output
    out, bias = output
    return out + state.delta(args[0], out.shape[-1]).to(out.dtype), bias


def _spans(recipe, hf_name: str) -> list[Span]:
    spans, offset = [], 0
    for piece in recipe.pieces:
        if piece.hf == hf_name:
            spans.append(Span(offset, piece.start, piece.length))
        offset += piece.length
    return spans


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def apply_lora(chunks: list, spec, tp_rank: int, tp: int, cfg: LoraConfig) -> int:
    """Adds ``cfg``'s adapters to every layer of this rank's ``chunks`` and freezes everything
    else; returns the adapter parameters' element count on this rank."""
    arch, family = spec.arch, family_of(spec.arch)
    layout = ShardLayout(tp_rank=tp_rank, tp=tp, padded_vocab=spec.padded_vocab)
    for chunk in chunks:
        for p in _unwrap(chunk).parameters():
            p.requires_grad_(False)
    count = 0
    for chunk in chunks:
        for layer in _unwrap(chunk).decoder.layers:
            index = layer.layer_number - 1
            prefix = hf_layer(index)
            shapes = family.hf_layer_shapes(arch, prefix)
            by_linear: dict[str, dict[str, Adapter]] = {}
            for target in cfg.target_modules:
                linear, hf = TARGETS[target]
                recipe = family.layer_recipe(arch, linear + ".weight", prefix, layout)
                # the same A on every tensor-parallel rank: a seed per (layer, target)
                seed = cfg.seed * 1_000_003 + index * 101 + list(TARGETS).index(target)
                generator = torch.Generator().manual_seed(seed)
                adapter = Adapter(target, index, cfg.rank, shapes[prefix + hf], _spans(recipe, prefix + hf),
                                  column=recipe.dim == 0, dtype=spec.params_dtype, generator=generator)
                by_linear.setdefault(linear, {})[target] = adapter
            for linear, adapters in by_linear.items():
                module = layer.get_submodule(linear)
                device = module.weight.device
                state = LoraState(adapters, cfg.scale, cfg.dropout, tp).to(device)
                for adapter in adapters.values():
                    _mark_parallel(adapter)
                    count += adapter.lora_A.numel() + adapter.lora_B.numel()
                module.add_module("lora", state)
                module.register_forward_hook(_hook)
    return count


def _mark_parallel(adapter: Adapter) -> None:
    """megatron-core's tensor-parallel attributes: a sharded tensor counts on every rank in the
    grad norm, a whole one only on tensor rank 0."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    sharded = adapter.sharded()
    for name in ("lora_A", "lora_B"):
        param = getattr(adapter, name)
        set_tensor_model_parallel_attributes(param, name == sharded, 0 if adapter.column else 1, 1)


def lora_states(chunks: list) -> Iterator[tuple[torch.nn.Module, LoraState]]:
    """(base linear, its adapters) of every adapted linear in ``chunks``."""
    for chunk in chunks:
        for module in _unwrap(chunk).modules():
            state = getattr(module, "lora", None)
            if isinstance(state, LoraState):
                yield module, state


def has_lora(chunks: list) -> bool:
    return next(lora_states(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """The base model alone inside the block (the reference policy: no second copy of the weights)."""
    states = [state for _, state in lora_states(chunks)]
    for state in states:
        state.enabled = False
    try:
        yield
    finally:
        for state in states:
            state.enabled = True


def merged_weights(chunks: list) -> dict[int, torch.Tensor]:
    """id(base weight) -> this rank's shard of W + scale * B @ A, for every adapted linear: what
    a rollout engine receives, so it serves the adapted policy with its ordinary weights."""
    out = {}
    with torch.no_grad():
        for module, state in lora_states(chunks):
            weight = module.weight.detach().clone()
            for adapter in state.adapters.values():
                delta = (adapter.lora_B.float() @ adapter.lora_A.float()) * state.scale
                if adapter.column:
                    weight.index_add_(0, adapter.rows.to(weight.device), delta.to(weight.dtype))
                else:
                    weight.add_(delta.to(weight.dtype))
            out[id(module.weight)] = weight
    return out


def peft_key(layer: int, target: str, which: str) -> str:
    """The tensor's name in a PEFT adapter folder (``adapter_model.safetensors``)."""
    block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.{which}.weight"


# A piece of a PEFT tensor this rank holds: (key, full shape, dim, hf offset, values)
Piece = tuple[str, tuple[int, int], int, int, torch.Tensor]


def adapter_pieces(chunks: list, grads: bool = False) -> list[Piece]:
    """This rank's pieces of every PEFT adapter tensor (``grads``: of their gradients), to be put
    together over the tensor-parallel group (``assemble``)."""
    out: list[Piece] = []
    for _, state in lora_states(chunks):
        for adapter in state.adapters.values():
            for which in ("lora_A", "lora_B"):
                param = getattr(adapter, which)
                value = getattr(param, "main_grad", None) if grads else param
                if grads and value is None:
                    value = param.grad
                value = value.detach().float().cpu()
                sharded = which == adapter.sharded()
                dim = (0 if adapter.column else 1) if sharded else 0
                full = list(value.shape)
                if sharded:
                    full[dim] = adapter.full_width
                    at = 0  # the parameter holds its spans end to end
                    for s in adapter.spans:
                        out.append((peft_key(adapter.layer, adapter.target, which), tuple(full), dim, s.hf,
                                    value.narrow(dim, at, s.length)))
                        at += s.length
                else:
                    out.append((peft_key(adapter.layer, adapter.target, which), tuple(full), 0, 0, value))
    return out


def load_adapters(chunks: list, tensors: dict[str, torch.Tensor]) -> None:
    """Fills every adapter from whole PEFT tensors (``adapter_model.safetensors``'s names)."""
    with torch.no_grad():
        for _, state in lora_states(chunks):
            for adapter in state.adapters.values():
                for which in ("lora_A", "lora_B"):
                    key = peft_key(adapter.layer, adapter.target, which)
                    if key not in tensors:
                        raise KeyError(f"the adapter has no {key} (its targets differ from this model's lora)")
                    value = tensors[key]
                    if which == adapter.sharded():
                        dim = 0 if adapter.column else 1
                        value = torch.cat([value.narrow(dim, s.hf, s.length) for s in adapter.spans], dim=dim)
                    param = getattr(adapter, which)
                    if tuple(value.shape) != tuple(param.shape):
                        raise ValueError(f"{key}: shape {list(value.shape)} != this rank's {list(param.shape)} "
                                         "(a different rank or model)")
                    param.copy_(value.to(param.dtype))


def assemble(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """The whole PEFT tensors from every rank's pieces (duplicates agree; the first one wins)."""
    out: dict[str, torch.Tensor] = {}
    for key, shape, dim, offset, value in pieces:
        if key not in out:
            out[key] = torch.zeros(shape)
        out[key].narrow(dim, offset, value.shape[dim]).copy_(value)
    return out


def shard_adapter_entries(state: dict) -> dict:
    """Rewrites the adapters' entries of a megatron-core sharded state dict in place: the base
    linear's ``sharded_state_dict`` takes every child tensor it does not know for a replica of
    tensor rank 0's, so the tensor-parallel-split A or B of ranks > 0 would be dropped on save
    and overwritten with rank 0's on load. Each split one becomes its rank's slice of the whole
    along its split axis, as the base weight is."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import make_tp_sharded_tensor_for_checkpoint

    for key, value in state.items():
        if isinstance(value, dict):
            shard_adapter_entries(value)
        elif isinstance(value, ShardedTensor) and is_adapter(value.key) \
                and getattr(value.data, "tensor_model_parallel", False):
            # the prepended axes (the layer's index under pipeline parallelism) are one wide: the
            # offset is the fragment's index
            offsets = tuple((axis, value.global_offset[axis], value.axis_fragmentations[axis])
                            for axis in range(value.prepend_axis_num))
            state[key] = make_tp_sharded_tensor_for_checkpoint(value.data, value.key, value.data.partition_dim,
                                                               prepend_offsets=offsets)
    return state

