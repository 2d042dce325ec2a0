"""Rollout routing replay (R3), the capture side: the experts vLLM routed every token to.

vLLM 0.32 binds its own routed-experts capturer only in the GPU Model Runner V2; this capture
works in any runner built on ``GPUModelRunner`` (the CPU one included). Each MoE layer's router
calls back with the step's top-k expert ids, ``[tokens, k]`` in the runner's flattened token
order; the runner's ``input_batch.req_ids``, ``query_start_loc``, ``positions`` and ``input_ids``
of the same step say which request, position and token each row is. ``take`` puts the steps
together per request: the token ids a request ran through the model, and each one's experts per
layer. Prefix caching must be off (a cached prefix never reaches the router).

A request's last sampled token never runs through the model (nothing is generated after it),
so a sample's routes cover its prompt and all but its last response token
(``routes_of_samples`` matches them by those tokens, which survives vLLM's internal request ids).
A multi-turn episode's last turn is a request whose prompt is the whole episode before it, so it
ran every token up to its last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch


@dataclass
class _Step:
    req_ids: list[str]
    starts: np.ndarray  # [reqs + 1] row offsets of each request's tokens
    positions: np.ndarray  # [rows]
    token_ids: np.ndarray  # [rows]
    experts: dict[int, np.ndarray | torch.Tensor] = field(default_factory=dict)  # layer -> [rows, k]


class RouteCapture:
    """Records each forward step's routing in one vLLM worker (its rank 0 of tensor parallelism:
    vLLM's router is replicated, every rank routes every token alike)."""

    def __init__(self, runner, num_layers: int):
        self.runner = runner
        self.num_layers = num_layers
        self.steps: list[_Step] = []
        self.first_layer: int | None = None
        self.topk = 0
        self.pieces: dict[str, list[tuple]] = {}  # request id -> its recorded rows, not yet taken

    def bind(self, model: torch.nn.Module) -> int:
        """Hooks the capture into every MoE router of ``model``; returns how many."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        layers = []
        for module in model.modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                module.router.set_capture_fn(partial(self.capture, module.layer_id))
                layers.append(module.layer_id)
        if not layers:
            raise ValueError("routing replay: this vLLM model has no MoE router to capture from")
        self.first_layer = min(layers)
        return len(layers)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        rows = topk_ids.shape[0]
        if layer_id == self.first_layer or not self.steps:  # a new forward step starts at the first MoE layer
            if self.steps:
                self._to_host(self.steps[-1])
            batch = self.runner.input_batch
            reqs = batch.num_reqs
            self.steps.append(_Step(
                req_ids=list(batch.req_ids[:reqs]),
                starts=self.runner.query_start_loc.np[:reqs + 1].copy(),
                positions=self.runner.positions[:rows].cpu().numpy().copy(),
                token_ids=self.runner.input_ids.cpu[:rows].numpy().copy()))
        self.topk = topk_ids.shape[1]
        # kept on the device until the step is over: one copy to the host per step, not per layer
        self.steps[-1].experts[layer_id] = topk_ids.to(torch.int16, copy=True)

    @staticmethod
    def _to_host(step: _Step) -> None:
        if step.experts and isinstance(next(iter(step.experts.values())), torch.Tensor):
            layers = list(step.experts)
            stacked = torch.stack([step.experts[layer] for layer in layers]).cpu().numpy()
            step.experts = dict(zip(layers, stacked, strict=True))

    def _fold(self) -> None:
        """The recorded steps, per request: (positions, token ids, routes [rows, layers, k]) pieces."""
        for step in self.steps:
            self._to_host(step)
            for j, rid in enumerate(step.req_ids):
                lo, hi = int(step.starts[j]), int(step.starts[j + 1])
                if hi <= lo:
                    continue
                routes = np.full((hi - lo, self.num_layers, self.topk), -1, dtype=np.int16)
                for layer, experts in step.experts.items():
                    routes[:, layer] = experts[lo:hi]
                self.pieces.setdefault(rid, []).append((step.positions[lo:hi], step.token_ids[lo:hi], routes))
        self.steps = []

    def take(self, requests: list[str] | None = None) -> dict:
        """The requests seen since they were last taken (``requests``: those of these ids, as given
        to vLLM's ``add_request``; None: all), each with its forwarded token ids and their routes
        ``[tokens, layers, k]`` (int16; -1 where a layer is dense), flattened for the RPC reply.
        What is not taken is kept: a request still running is taken whole once it is done."""
        self._fold()
        if requests is None:
            chosen = list(self.pieces)
        else:  # vLLM makes each request id its own by appending "-" and 8 random characters
            wanted = set(requests)
            chosen = [rid for rid in self.pieces if rid.rsplit("-", 1)[0] in wanted or rid in wanted]
        lengths, flat_t, flat_r = [], [], []
        for rid in chosen:
            pieces = self.pieces.pop(rid)
            n = max(int(pos.max()) for pos, _, _ in pieces) + 1  # its furthest position + 1
            tokens = np.full(n, -1, dtype=np.int64)
            routes = np.full((n, self.num_layers, self.topk), -1, dtype=np.int16)
            for pos, ids, experts in pieces:
                tokens[pos], routes[pos] = ids, experts
            filled = int(np.flatnonzero(tokens >= 0).max()) + 1 if (tokens >= 0).any() else 0
            lengths.append(filled)
            flat_t.append(tokens[:filled])
            flat_r.append(routes[:filled])
        topk = self.topk
        return {"lengths": lengths, "layers": self.num_layers, "topk": topk,
                "tokens": (np.concatenate(flat_t) if flat_t else np.zeros(0, np.int64)).tobytes(),
                "routes": (np.concatenate(flat_r) if flat_r else np.zeros((0, self.num_layers, topk), np.int16)
                           ).tobytes()}


def unpack(taken: dict) -> dict[tuple[int, ...], np.ndarray]:
    """``RouteCapture.take``'s reply as {forwarded token ids: routes [tokens, layers, k]}."""
    tokens = np.frombuffer(taken["tokens"], dtype=np.int64)
    routes = np.frombuffer(taken["routes"], dtype=np.int16).reshape(-1, taken["layers"], max(taken["topk"], 1))
    out, at = {}, 0
    for n in taken["lengths"]:
        out[tuple(tokens[at:at + n].tolist())] = routes[at:at + n]
        at += n
    return out


def routes_of_samples(captured: dict[tuple[int, ...], np.ndarray], prompt: list[int], response: list[int],
                      response_mask: list[int] | None = None) -> torch.Tensor:
    """The routes ``[prompt + response, layers, k]`` of one sample. Its last policy token (the last
    response token, or of a multi-turn episode the last with ``response_mask`` 1) never ran
    through the model, nor did anything an environment appended after it: they take the experts of
    the token before (their outputs predict past the last trained token, and no trained token
    attends to them, so any valid experts do)."""
    last = len(response) - 1
    if response_mask is not None:
        last = next((i for i in range(len(response_mask) - 1, -1, -1) if response_mask[i]), last)
    forwarded = tuple(prompt + response[:last])
    found = captured.get(forwarded)
    if found is None:
        raise RuntimeError(f"routing replay: vLLM recorded no routes for a sample of {len(forwarded) + 1} tokens "
                           "(was prefix caching left on, or the request preempted and not recomputed?)")
    if (found[:, :, 0] < 0).all(axis=1).any():
        raise RuntimeError("routing replay: a sample's routes have a position no MoE layer recorded")
    tail = np.repeat(found[-1:], len(prompt) + len(response) - len(found), axis=0)
    return torch.from_numpy(np.concatenate([found, tail]))
