"""Emulated FP8 rollout weights (``rollout.weights: fp8_emulated``): each linear weight a vLLM rank
holds, rounded to FP8 E4M3 the way online FP8 quantization does it, then stored back in the
rollout dtype.

The scale is amax / 448 (E4M3's largest finite value), over the whole tensor as this rank holds it
(a fused ``qkv_proj`` / ``gate_up_proj`` shares one scale; vLLM's own online FP8 also reduces the
amax of a TP-sharded layer over its TP ranks, which this does not), or over each ``block`` x
``block`` tile (the DeepSeek-V3 style block scales). Values keep their dequantized form
(``q * scale``): the weights' share of FP8's numerics in any dtype, on any CPU, for MoE experts'
neighbours too; the activations stay unquantized. ``rollout.weights: fp8`` runs vLLM's real FP8
instead (``megarl.rollout.worker_extension``).

nvidia-modelopt computes the scales and the E4M3 values (``FP8QTensor.quantize``: per tensor, or
per block with ``block_sizes``) and dequantizes them. Where it is not installed, the same
arithmetic written out here does (amax / 448 in float32, a true division, E4M3's round to
nearest even): the two agree bit for bit (tests/test_fp8_modelopt.py). vLLM's own FP8 multiplies
by the scale's reciprocal instead, so at an exact E4M3 rounding tie its value can be the
neighbouring one (2.5e-3 of SmolLM2's bf16 layer weights per tensor, 5e-4 per 128 x 128 block).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = 1e-12  # the scale's floor: an all-zero tensor or tile keeps its zeros (no 0 / 0)


@functools.cache
def modelopt_installed() -> bool:
    """Whether nvidia-modelopt computes the FP8 scales (``containers/install-cpu.sh`` installs it)."""
    return importlib.util.find_spec("modelopt") is not None


def quantize_fp8(weight: torch.Tensor, block: int | None = None,
                 use_modelopt: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D) as E4M3 values (its shape) and their float32 scales, amax / 448: a 0-d
    tensor per tensor, ``[ceil(rows / block), ceil(cols / block)]`` per ``block`` tile (a partial
    edge tile's amax is over the values it has). nvidia-modelopt computes them where it is
    installed (``use_modelopt`` None), the hand-written rounding where not."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 weights are 2-D matrices, got shape {tuple(weight.shape)}")
    w = weight.float()  # float32 scales and quotients in any dtype (modelopt keeps the input's dtype)
    if modelopt_installed() if use_modelopt is None else use_modelopt:
        return _modelopt_quantize(w, block)
    return _hand_quantize(w, block)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: int | None = None,
                   use_modelopt: bool | None = None) -> torch.Tensor:
    """``q * scale`` in float32, ``scale`` as ``quantize_fp8`` returns it."""
    if modelopt_installed() if use_modelopt is None else use_modelopt:
        from modelopt.torch.quantization.qtensor import FP8QTensor

        return FP8QTensor(q.shape, torch.float32, q).dequantize(torch.float32, scale=scale,
                                                               block_sizes=_block_sizes(block))
    if block is None:
        return q.float() * scale
    rows, cols = q.shape
    tiles = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.float() * tiles


def fake_quant_fp8(weight: torch.Tensor, block: int | None = None,
                   use_modelopt: bool | None = None) -> torch.Tensor:
    """``weight`` (2-D) rounded to E4M3 with amax / 448 scales, per tensor or per ``block`` tile,
    returned dequantized in ``weight``'s dtype (a new tensor)."""
    q, scale = quantize_fp8(weight, block, use_modelopt)
    return dequantize_fp8(q, scale, block, use_modelopt).to(weight.dtype)


def _block_sizes(block: int | None) -> dict[int, int] | None:
    return None if block is None else {-2: block, -1: block}


def _modelopt_quantize(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    from modelopt.torch.quantization.qtensor import FP8QTensor

    qtensor, scale = FP8QTensor.quantize(w, block_sizes=_block_sizes(block))
    if bool((scale < _TINY).any()):  # an all-zero tensor or tile: modelopt's scale 0 makes 0 / 0 NaN
        qtensor, scale = FP8QTensor.quantize(w, scales=scale.clamp(min=_TINY), block_sizes=_block_sizes(block))
    return qtensor._quantized_data, scale


def _hand_quantize(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if block is None:
        scale = (w.abs().amax() / E4M3_MAX).clamp(min=_TINY)
        return (w / scale).to(torch.float8_e4m3fn), scale
    rows, cols = w.shape
    pad_r, pad_c = -rows % block, -cols % block  # partial edge tiles: zero padding never raises an amax
    tiles = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    tiles = tiles.reshape((rows + pad_r) // block, block, (cols + pad_c) // block, block)
    scale = (tiles.abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX).clamp(min=_TINY)
    q = (tiles / scale).to(torch.float8_e4m3fn).reshape(rows + pad_r, cols + pad_c)
    return q[:rows, :cols].contiguous(), scale[:, 0, :, 0]
