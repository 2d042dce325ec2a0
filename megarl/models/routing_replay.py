"""Rollout routing replay (R3), the training side: the forward routes each token to the experts
the rollout engine routed it to, through megatron-core's ``RouterReplay``.

A role built with ``moe.routing_replay`` (megatron's ``moe_enable_routing_replay``) has one
replay object per router; ``install`` swaps each for ``CountingReplay``, which also counts the
tokens whose own top-k (at the same hidden states) would have picked other experts: the
routing mismatch R3 removes. ``replayed(chunk, routes, input_shape)`` sets every router of the
chunk to replay for one forward.

Token order: the model's input ``[b, s]`` runs as ``[s, b, hidden]`` and the router sees it
flattened, position-major; under sequence parallelism each tensor rank routes its own slice of
``s``. Routes arrive per input row and column, ``[b, s, layers, k]``, and leave in that order.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class CountingReplay(RouterReplay):
    """megatron-core's replay, plus the count of replayed tokens whose free top-k differs."""

    def __init__(self):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # held by its router, not globally
        self.valid: torch.Tensor | None = None  # [tokens] the rows that are real tokens
        self.compared = 0
        self.differing = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self.valid is not None:
            with torch.no_grad():
                _, free = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                target = self.target_topk_idx.to(free.device)
                differs = (free.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1)
                valid = self.valid.to(differs.device)
                self.compared += int(valid.sum())
                self.differing += int((differs & valid).sum())
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


# each chunk's replaying routers, found once (a chunk's modules do not change; DDP's wrapper is a
# chunk of its own): ``replayed`` runs on every micro-batch's forward
_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _routers(chunk: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    found = _ROUTERS.get(chunk)
    if found is None:
        found = [m for m in chunk.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]
        _ROUTERS[chunk] = found
    return found


def install(chunks: list[torch.nn.Module]) -> int:
    """Gives every replaying router of ``chunks`` a ``CountingReplay``; returns how many."""
    routers = [r for chunk in chunks for r in _routers(chunk)]
    for router in routers:
        if router.router_replay in RouterReplay.global_router_replay_instances:
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
        router.router_replay = CountingReplay()
    return len(routers)


def take_counts(chunks: list[torch.nn.Module]) -> tuple[int, int]:
    """(token-layer routings compared, of them differing) since the last call, on this rank."""
    compared = differing = 0
    for chunk in chunks:
        for router in _routers(chunk):
            replay = router.router_replay
            if isinstance(replay, CountingReplay):
                compared, differing = compared + replay.compared, differing + replay.differing
                replay.compared = replay.differing = 0
    return compared, differing


def _router_order(per_column: torch.Tensor, input_shape: tuple[int, int], sequence_parallel: bool) -> torch.Tensor:
    """``[rows, width, ...]`` -> ``[tokens, ...]`` in the order this rank's routers see them."""
    from megatron.core import parallel_state as ps

    b, s = input_shape
    x = per_column.reshape(b, s, *per_column.shape[2:]).transpose(0, 1)  # [s, b, ...]
    if sequence_parallel and (tp := ps.get_tensor_model_parallel_world_size()) > 1:
        x = x.chunk(tp)[ps.get_tensor_model_parallel_rank()]
    return x.reshape(-1, *per_column.shape[2:])


@contextmanager
def replayed(chunk: torch.nn.Module, routes: torch.Tensor | None, valid: torch.Tensor | None,
             input_shape: tuple[int, int]) -> Iterator[None]:
    """Every replaying router of ``chunk`` routes by ``routes`` ([rows, width, layers, k], layer
    index = decoder layer - 1) for the forward inside; ``valid`` [rows, width] marks real tokens
    (padding routes are placeholders, not counted). Nothing to replay: an ordinary forward."""
    routers = _routers(chunk) if routes is not None else []
    if not routers:
        yield
        return
    sp = chunk.config.sequence_parallel
    flat = _router_order(routes, input_shape, sp).long()
    mask = _router_order(valid, input_shape, sp) if valid is not None else None
    try:
        for router in routers:
            replay = router.router_replay
            replay.set_target_indices(flat[:, router.layer_number - 1])
            replay.valid = mask
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
            router.router_replay.valid = None
