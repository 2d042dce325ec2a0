"""R3's capture bookkeeping without an engine: forward steps as vLLM's runner lays them out (requests
in any order, prefill then decode), assembled per request; a sample's routes found by its tokens.
(`tests/test_weight_sync_moe.py` checks the whole path against transformers' router top-k.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.rollout.vllm_routes import RouteCapture, routes_of_samples, unpack


def _step(capture: RouteCapture, runner, req_ids: list[str], lens: list[int], positions: list[int],
          tokens: list[int]) -> None:
    """One forward step of ``req_ids`` (``lens`` rows each): both MoE layers route row r of the
    step to experts (10 * layer + token, 10 * layer + token + 1)."""
    runner.input_batch = SimpleNamespace(req_ids=req_ids, num_reqs=len(req_ids))
    runner.query_start_loc = SimpleNamespace(np=np.cumsum([0, *lens]))
    runner.positions = torch.tensor(positions)
    runner.input_ids = SimpleNamespace(cpu=torch.tensor(tokens))
    for layer in (0, 1):
        ids = torch.tensor(tokens) + 10 * layer
        capture.capture(layer, torch.stack([ids, ids + 1], dim=1))


def _expected(tokens: list[int]) -> np.ndarray:
    ids = np.array(tokens)
    return np.stack([np.stack([ids + 10 * layer, ids + 10 * layer + 1], axis=1) for layer in (0, 1)], axis=1)


def test_steps_assemble_per_request_and_samples_find_their_routes():
    runner = SimpleNamespace()
    capture = RouteCapture(runner, num_layers=2)
    capture.first_layer = 0  # what bind() finds in a model
    _step(capture, runner, ["a", "b"], [3, 2], [0, 1, 2, 0, 1], [1, 2, 3, 4, 5])  # both prompts
    _step(capture, runner, ["b", "a"], [1, 1], [2, 3], [6, 7])  # a decoding step, the order swapped
    _step(capture, runner, ["a"], [1], [4], [8])
    captured = unpack(capture.take())
    assert sorted(captured) == [(1, 2, 3, 7, 8), (4, 5, 6)]
    np.testing.assert_array_equal(captured[(1, 2, 3, 7, 8)], _expected([1, 2, 3, 7, 8]))
    np.testing.assert_array_equal(captured[(4, 5, 6)], _expected([4, 5, 6]))
    assert capture.take()["lengths"] == []  # taken once

    # the last response token never ran: it takes the experts of the token before
    routes = routes_of_samples(captured, [1, 2, 3], [7, 8, 9])
    assert routes.shape == (6, 2, 2) and routes.dtype == torch.int16
    np.testing.assert_array_equal(routes[:5].numpy(), _expected([1, 2, 3, 7, 8]))
    np.testing.assert_array_equal(routes[5].numpy(), routes[4].numpy())
    # an episode: after its last policy token (mask 1) an environment appended tokens; none ran
    episode = routes_of_samples(captured, [4, 5], [6, 50, 51, 52], response_mask=[1, 1, 0, 0])
    assert episode.shape == (6, 2, 2)
    np.testing.assert_array_equal(episode[:3].numpy(), _expected([4, 5, 6]))
    with pytest.raises(RuntimeError, match="no routes"):
        routes_of_samples(captured, [4, 5], [9, 9])
