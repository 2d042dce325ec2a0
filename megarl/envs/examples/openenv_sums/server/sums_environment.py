"""The environment: ``reset`` asks one reasoning-gym chain_sum question, ``step`` scores the answer
and ends the episode.

The question is entry 0 of ``reasoning_gym.create_dataset("chain_sum", size=1, seed=seed, ...)``,
so an episode is fixed by its reset seed and the sum's size (``min_terms``, ``max_terms``,
``min_digits``, ``max_digits``, reset keywords). The reward is 1.0 when the answer's LAST number
(``megarl.rewards.extract.last_number``: ``"3 + 4 = 7"`` -> 7, ``"1,234"`` -> 1234) equals the sum,
numerically (``"7.0"`` counts), else 0.0. The last number rather than any number in the reply, so
that listing candidates (``"7 or 8"``) or restating the question (``"7 = 3 + 4"``) earns nothing.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from megarl.envs.examples.openenv_sums.models import SumsAction, SumsObservation
from megarl.rewards.extract import last_number


def score(answer: str, correct: str) -> float:
    found = last_number(answer)
    return float(found is not None and float(found) == float(correct))


class SumsEnvironment(Environment[SumsAction, SumsObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no state outside the instance: one per session

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._answer: str | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, min_terms: int = 2,
              max_terms: int = 2, min_digits: int = 1, max_digits: int = 1, **unknown: Any) -> SumsObservation:
        import reasoning_gym

        if unknown:  # OpenEnv's server would drop them unseen if reset did not take **kwargs
            raise ValueError(f"reset takes seed, min_terms, max_terms, min_digits, max_digits, not {sorted(unknown)}")

        entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=seed, min_terms=min_terms,
                                             max_terms=max_terms, min_digits=min_digits, max_digits=max_digits)[0]
        self._answer = str(entry["answer"])
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SumsObservation(question=entry["question"])

    def step(self, action: SumsAction, timeout_s: float | None = None, **_: Any) -> SumsObservation:
        if self._answer is None:
            raise RuntimeError("step before reset: there is no question to answer")
        self._state.step_count += 1
        correct, self._answer = self._answer, None  # one answer per question
        return SumsObservation(correct_answer=correct, done=True, reward=score(action.answer, correct))

    @property
    def state(self) -> State:
        return self._state
