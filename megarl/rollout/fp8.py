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
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = 1e-12  # an all-zero tensor or tile keeps its zeros (scale floor, no 0/0)


def fake_quant_fp8(weight: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``weight`` (2-D) rounded to E4M3 with amax / 448 scales, per tensor or per ``block`` tile,
    returned dequantized in ``weight``'s dtype (a new tensor)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 weights are 2-D matrices, got shape {tuple(weight.shape)}")
    w = weight.float()
    if block is None:
        scale = w.abs().amax().clamp(min=_TINY) / E4M3_MAX
        return ((w / scale).to(torch.float8_e4m3fn).float() * scale).to(weight.dtype)
    rows, cols = w.shape
    pad_r, pad_c = -rows % block, -cols % block  # partial edge tiles: zero padding never raises an amax
    tiles = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    tiles = tiles.reshape((rows + pad_r) // block, block, (cols + pad_c) // block, block)
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=_TINY) / E4M3_MAX
    out = ((tiles / scale).to(torch.float8_e4m3fn).float() * scale).reshape(rows + pad_r, cols + pad_c)
    return out[:rows, :cols].to(weight.dtype)
