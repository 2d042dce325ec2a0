"""megatron-core's jit_fuser compiles a fused function at its first call, not at its definition
(megarl.utils.megatron_jit): importing megatron-core no longer imports inductor's compile machinery."""

from __future__ import annotations

import sys

import torch
from conftest import dynamo_disabled

from megarl.utils.megatron_jit import deferred_compile


def test_a_deferred_function_compiles_once_at_its_first_call_with_its_options(monkeypatch):
    made = []
    real = torch.compile

    def recording_compile(model, **options):
        made.append((model.__name__, options))
        return real(model, **options)

    monkeypatch.setattr(torch, "compile", recording_compile)

    @deferred_compile(dynamic=True)
    def scaled(x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s

    assert made == [] and scaled.__name__ == "scaled"
    x = torch.arange(4.0)
    with dynamo_disabled(True):  # run as written: no compile time in the fast tier
        assert scaled(x, 2.0).tolist() == [0.0, 2.0, 4.0, 6.0]
        assert scaled(x, 3.0).tolist() == [0.0, 3.0, 6.0, 9.0]
    assert made == [("scaled", {"dynamic": True})]


def test_megatron_cores_fuser_is_deferred_in_a_process_that_imported_megarl_first():
    import megatron.core.jit

    assert "megarl" in sys.modules
    assert megatron.core.jit.jit_fuser is deferred_compile


def test_a_fresh_process_imports_megatron_core_without_inductor(subprocesses):
    code = ("import sys, megarl, megatron.core; from megatron.core.fusions import fused_bias_swiglu; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx') if m in sys.modules))")
    out = subprocesses.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
