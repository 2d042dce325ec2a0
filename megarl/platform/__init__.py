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

import torch

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


@functools.cache
def current_platform() -> Platform:
    # MEGARL_PLATFORM=cpu forces the CPU platform on a GPU machine (for parity runs).
    forced = os.environ.get("MEGARL_PLATFORM", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"MEGARL_PLATFORM must be 'cpu' or 'cuda', got {forced!r}")
    use_cuda = torch.cuda.is_available() if forced == "" else forced == "cuda"
    if use_cuda:
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return Platform(name="cuda", backend="nccl", has_transformer_engine=has_te)
    return Platform(name="cpu", backend="gloo", has_transformer_engine=False)


def init_megatron_runtime() -> list[str]:
    """Prepares this process to build megatron-core models; returns the shims applied."""
    if current_platform().is_gpu:
        return []
    from megarl.platform import cpu_shims

    return cpu_shims.apply_all()


def gpt_layer_spec(num_experts: int | None = None, qk_layernorm: bool = False):
    """megatron-core layer spec for this platform: Transformer Engine on GPU, local on CPU."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if current_platform().layer_spec_kind == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm
        )
    from megarl.platform.sdpa_attention import SDPAttention

    spec = specs.get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        normalization="RMSNorm",
    )
    # torch's fused attention kernel in place of the local one (see sdpa_attention)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
