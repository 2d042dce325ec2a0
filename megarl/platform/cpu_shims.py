"""Compatibility shims that let megatron-core 0.16.1 run on a CPU-only torch build.

megatron-core assumes CUDA in a handful of places. Each shim below names the
failure it fixes (the call site in megatron-core and the error raised there) and
is reversible, so tests can show the failure with the shim off. They are applied
when CUDA is absent; the few whose failure comes from Transformer Engine's absence
(``without_te``) also on a GPU without it (see ``megarl.platform.init_megatron_runtime``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class Shim:
    name: str
    fixes: str  # the failure without it: call site and error
    apply: Callable[[], Callable[[], None]]  # returns the function that undoes it
    # The failure is Transformer Engine's (or Apex's) absence, not CUDA's: a GPU without TE needs it too.
    without_te: bool = False


_ACTIVE: dict[str, Callable[[], None]] = {}
_SUPPRESSED: set[str] = set()  # turned off by ``disabled`` until it exits


class _DropMessage(logging.Filter):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


# --- rng_tracker -------------------------------------------------------------------------


def _apply_rng_tracker() -> Callable[[], None]:
    """Keep the model-parallel RNG tracker's states in CPU generators."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    saved = (
        mrandom._get_cuda_rng_state,
        mrandom._set_cuda_rng_state,
        mrandom.CudaRNGStatesTracker.add,
        mrandom.model_parallel_cuda_manual_seed,
        tensor_parallel.model_parallel_cuda_manual_seed,
    )

    def get_state(device: str = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    original_seed = saved[3]

    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs):
        # megatron seeds the *CUDA* default generator here (a silent no-op on a CPU build).
        # Seed the CPU one instead so every TP rank draws the same full master weights
        # under use_cpu_initialization.
        torch.manual_seed(seed)
        return original_seed(seed, *args, **kwargs)

    # megatron's tracker warns when the CPU generator changes inside a fork of the CUDA one;
    # here the CPU generator *is* the tracked one, so the warning would fire on every init.
    quiet = _DropMessage("CPU RNG state changed within GPU RNG context")
    logging.getLogger(mrandom.__name__).addFilter(quiet)
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    mrandom.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed

    def undo() -> None:
        logging.getLogger(mrandom.__name__).removeFilter(quiet)
        (
            mrandom._get_cuda_rng_state,
            mrandom._set_cuda_rng_state,
            mrandom.CudaRNGStatesTracker.add,
            mrandom.model_parallel_cuda_manual_seed,
            tensor_parallel.model_parallel_cuda_manual_seed,
        ) = saved

    return undo


# --- cuda_device_redirect / cuda_tensor_type ---------------------------------------------


def _to_cpu(device: object) -> object:
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaOnCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU on every torch call made under it."""

    redirect_devices = False
    fake_cuda_type = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.redirect_devices:
            if "device" in kwargs:
                kwargs["device"] = _to_cpu(kwargs["device"])
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False  # a CPU-only build has no pinned allocator
            if func is torch.Tensor.pin_memory or func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1:
                args = (args[0], _to_cpu(args[1]), *args[2:])
        if self.fake_cuda_type and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


_MODE: _CudaOnCpuMode | None = None


def _mode() -> _CudaOnCpuMode:
    global _MODE
    if _MODE is None:
        _MODE = _CudaOnCpuMode()
        # Entered once for the life of the process (the mode stack is per thread; megatron's
        # CUDA assumptions are hit on the thread that builds and runs the model).
        _MODE.__enter__()
    return _MODE


def _apply_cuda_device_redirect() -> Callable[[], None]:
    mode = _mode()
    saved = (torch.cuda.current_device, torch.cuda.synchronize)
    mode.redirect_devices = True
    # A CPU torch.device rather than the int 0: megatron also calls
    # torch.empty(..., device=torch.cuda.current_device()) inside autograd backward
    # functions, where the function mode is not active, so the value itself must be valid.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None

    def undo() -> None:
        mode.redirect_devices = False
        torch.cuda.current_device, torch.cuda.synchronize = saved

    return undo


def _apply_cuda_tensor_type() -> Callable[[], None]:
    mode = _mode()
    mode.fake_cuda_type = True

    def undo() -> None:
        mode.fake_cuda_type = False

    return undo


# --- torch_norm_sequence_parallel ---------------------------------------------------------


def _apply_torch_norm_sequence_parallel() -> Callable[[], None]:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
        finally:
            config.sequence_parallel = sequence_parallel
        if sequence_parallel:
            # What TE/Apex norms do: tag the weights so finalize_model_grads all-reduces
            # their gradients over the tensor-parallel group.
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__

    def undo() -> None:
        torch_norm.WrappedTorchNorm.__new__ = original_new

    return undo


# --- adam_step_state ----------------------------------------------------------------------


def _apply_adam_step_state() -> Callable[[], None]:
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        # torch.optim.Adam keeps a per-parameter 'step' tensor that megatron stores in the
        # param groups instead; copy the keys the checkpoint has and leave 'step' alone.
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in destination.items():
            if key in tensors:
                value.copy_(tensors[key])

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    def undo() -> None:
        cls._set_main_param_and_optimizer_states = original

    return undo


# --- cuda_streams (MoE all-to-all dispatcher) -------------------------------------------


class _CpuEvent:
    """CPU work is synchronous: an event is complete as soon as it is recorded."""

    def __init__(self, *args, **kwargs) -> None:
        self._time: float | None = None

    def record(self, *args, **kwargs) -> None:
        import time

        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _CpuEvent) -> float:
        return 1000.0 * ((end._time or 0.0) - (self._time or 0.0))


class _CpuStream:
    """The one CPU 'stream': everything on it already runs in program order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        event = event or _CpuEvent()
        event.record()
        return event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0

    def __enter__(self) -> _CpuStream:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def _apply_cuda_streams() -> Callable[[], None]:
    names = ("Stream", "Event", "current_stream", "default_stream", "stream")
    saved = {name: getattr(torch.cuda, name) for name in names}
    the_stream = _CpuStream()
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = lambda *a, **k: the_stream
    torch.cuda.default_stream = lambda *a, **k: the_stream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    def undo() -> None:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)

    return undo


# --- moe_te_names ---------------------------------------------------------------------------

_MOE_TE_NAMES = (
    "te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
    "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
)


def _apply_moe_te_names() -> Callable[[], None]:
    from megatron.core.transformer.moe import moe_utils

    # These names are bound only when Transformer Engine imports; the router then tests
    # `te_general_gemm is not None`, so without TE they must exist and be None.
    missing = [name for name in _MOE_TE_NAMES if not hasattr(moe_utils, name)]
    for name in missing:
        setattr(moe_utils, name, None)

    def undo() -> None:
        for name in missing:
            delattr(moe_utils, name)

    return undo


# --- moe_split_sizes ------------------------------------------------------------------------


def _apply_moe_split_sizes() -> Callable[[], None]:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # megatron only converts CUDA tensors; on CPU the all-to-all split sizes must
        # still become numpy arrays (all_to_all_single takes lists, not tensors).
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().clone().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # imported by name

    def undo() -> None:
        moe_utils.maybe_move_tensor_to_cpu = original
        token_dispatcher.maybe_move_tensor_to_cpu = original

    return undo


SHIMS: dict[str, Shim] = {
    shim.name: shim
    for shim in [
        Shim(
            "rng_tracker",
            "megatron/core/tensor_parallel/random.py CudaRNGStatesTracker.add calls "
            "torch.cuda.get_rng_state(): 'AssertionError: Torch not compiled with CUDA enabled' "
            "from model_parallel_cuda_manual_seed",
            _apply_rng_tracker,
        ),
        Shim(
            "cuda_device_redirect",
            "hard-coded device='cuda' / torch.cuda.current_device(): parameter allocation in "
            "tensor_parallel/layers.py (per-shard init), pipeline_parallel/schedules.py "
            "torch.zeros([], device='cuda'), optimizer buffers: 'Torch not compiled with CUDA enabled'",
            _apply_cuda_device_redirect,
        ),
        Shim(
            "cuda_tensor_type",
            "optimizer/clip_grads.py asserts grad.type() == 'torch.cuda.FloatTensor' "
            "(AssertionError in get_grad_norm_fp32 / clip_grad_by_total_norm_fp32)",
            _apply_cuda_tensor_type,
        ),
        Shim(
            "torch_norm_sequence_parallel",
            "transformer/torch_norm.py WrappedTorchNorm: 'AssertionError: sequence parallel "
            "not supported by torch LayerNorm' with the local spec and sequence_parallel=True",
            _apply_torch_norm_sequence_parallel,
            without_te=True,
        ),
        Shim(
            "adam_step_state",
            "optimizer/distrib_optimizer.py _set_main_param_and_optimizer_states: "
            "\"KeyError: 'step'\" loading a fully_reshardable distributed-optimizer "
            "checkpoint with torch Adam (no Apex/TE, i.e. every CPU run)",
            _apply_adam_step_state,
            without_te=True,
        ),
        Shim(
            "cuda_streams",
            "transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher.__init__ "
            "torch.cuda.Stream(): 'RuntimeError: torch.cuda.Stream requires CUDA support'",
            _apply_cuda_streams,
        ),
        Shim(
            "moe_te_names",
            "transformer/moe/moe_utils.py RouterGatingLinearFunction.forward: "
            "\"NameError: name 'te_general_gemm' is not defined\" without Transformer Engine",
            _apply_moe_te_names,
            without_te=True,
        ),
        Shim(
            "moe_split_sizes",
            "tensor_parallel/mappings.py _AllToAll.forward all_to_all_single(): 'TypeError: "
            "incompatible function arguments' (split sizes left as CPU tensors) at ep > 1",
            _apply_moe_split_sizes,
        ),
    ]
}


def apply_all(only_without_te: bool = False) -> list[str]:
    """Applies every shim not yet active (``only_without_te``: those a GPU without Transformer
    Engine needs); returns the names active afterwards."""
    for name, shim in SHIMS.items():
        if only_without_te and not shim.without_te:
            continue
        if name not in _ACTIVE and name not in _SUPPRESSED:
            _ACTIVE[name] = shim.apply()
    return sorted(_ACTIVE)


def active() -> list[str]:
    return sorted(_ACTIVE)


@contextlib.contextmanager
def disabled(name: str) -> Iterator[None]:
    """Turns one active shim off for the duration (used by tests to show its failure)."""
    undo = _ACTIVE.pop(name, None)
    if undo is not None:
        undo()
    _SUPPRESSED.add(name)
    try:
        yield
    finally:
        _SUPPRESSED.discard(name)
        if undo is not None:
            _ACTIVE[name] = SHIMS[name].apply()
