"""The client side: OpenEnv's ``EnvClient`` (its WebSocket session) told how to write an action and
read an observation."""

from __future__ import annotations

from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State

from megarl.envs.examples.openenv_sums.models import SumsAction, SumsObservation


class SumsEnv(EnvClient[SumsAction, SumsObservation, State]):
    def _step_payload(self, action: SumsAction) -> dict[str, Any]:
        return {"answer": action.answer}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[SumsObservation]:
        # the server leaves reward/done out of the observation dict and sends them beside it
        done, reward = payload.get("done", False), payload.get("reward")
        observation = SumsObservation(**payload.get("observation", {}), done=done, reward=reward)
        return StepResult(observation=observation, reward=reward, done=done)

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))
