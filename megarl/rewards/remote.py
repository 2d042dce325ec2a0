"""A reward computed by an HTTP service, with retries and bounded concurrency.

Protocol: ``POST url`` with ``{"samples": [{"prompt", "response", "metadata"}, ...]}``
and ``Content-Type: application/json``; the answer is ``{"rewards": [float, ...]}``,
one finite number per sample, in order. Transport, retries (5xx, 429, connection failures and
timeouts; never other 4xx or a malformed answer) and the whole-attempt deadline are
``megarl.utils.http_json``'s; a 200 whose body breaks the protocol raises at once.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megarl.rewards.base import RewardInput, check_rewards
from megarl.utils.http_json import DEFAULT_MAX_RESPONSE_BYTES, HttpJsonError, JsonPoster, RetryPolicy, url_problem

__all__ = ["RemoteReward", "RemoteRewardError", "url_problem"]


class RemoteRewardError(HttpJsonError):
    """The remote reward failed for good (retries exhausted, 4xx, or a malformed answer)."""


class RemoteReward:
    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_concurrency: int = 4, batch_size: int = 64, max_backoff_s: float = 30.0,
                 headers: dict[str, str] | None = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        problem = url_problem(url)
        if problem:
            raise ValueError(f"RemoteReward: url {problem}, got {url!r}")
        policy = RetryPolicy(timeout_s, max_retries, backoff_s, max_backoff_s, max_response_bytes)
        problems = policy.problems()
        for name, value in (("max_concurrency", max_concurrency), ("batch_size", batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if problems:
            raise ValueError(f"RemoteReward: {problems[0]}")
        self.url = url
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self.poster = JsonPoster(url, policy, "remote reward", RemoteRewardError, headers)
        self.stats = self.poster.stats

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        if not samples:
            return []
        # Serialise everything first: a sample that is not JSON fails before any request.
        batches = [self._encode(samples, start) for start in range(0, len(samples), self.batch_size)]
        if len(batches) == 1 or self.max_concurrency == 1:
            results = [self._score(*batch) for batch in batches]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(batches)),
                                    thread_name_prefix="remote-reward") as pool:
                futures = [pool.submit(self._score, *batch) for batch in batches]
                try:
                    results = [future.result() for future in futures]
                except BaseException:
                    # One batch failed for good: the step cannot complete, so send no more.
                    for future in futures:
                        future.cancel()
                    raise
        return [reward for batch in results for reward in batch]

    def _encode(self, samples: list[RewardInput], start: int) -> tuple[list[dict], int]:
        payload = []
        for offset, sample in enumerate(samples[start:start + self.batch_size]):
            item = {"prompt": sample.prompt, "response": sample.response, "metadata": sample.metadata}
            try:
                json.dumps(item, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"RemoteReward {self.url}: sample {start + offset} is not JSON-serialisable: "
                                f"{exc}") from exc
            payload.append(item)
        return payload, start

    def _score(self, payload: list[dict], start: int) -> list[float]:
        what = f"samples {start}..{start + len(payload) - 1}"
        answer: Any = self.poster.post({"samples": payload}, what)
        where = f"remote reward {self.url} ({what})"
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RemoteRewardError(f"{where}: response must be an object with 'rewards', got "
                                    f"{json.dumps(answer)[:200]}")
        try:
            return check_rewards(answer["rewards"], len(payload), where)
        except (TypeError, ValueError) as exc:
            raise RemoteRewardError(str(exc)) from exc
