"""The rollout endpoint inside a vLLM engine actor: ``generate_episodes`` with an agent
``env.kind`` runs here (``VLLMEngine`` mixes this in).

Why in the engine actor: the engine already hosts multi-turn episodes there (their event loop,
its tokenizer, the version fence, interruption), so the endpoint is one more thing on that loop,
and a turn goes from the agent's request to the engine's batch without leaving the process or
crossing Ray: the same continuous batching across episodes as the in-process runner, and a
session's requests always reach the engine that holds its prefix cache. The server starts with
the first agent call (on a free loopback port) and lives as long as the engine; sessions live as
long as their episode.

``endpoint_turns`` serves the endpoint bound for callers outside the run (``megarl.rollout.endpoint.bound``):
a batch of its turns as one engine call, so they run between the run's own calls and never
during a weight sync (which is an engine call too).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from megarl.rollout.endpoint.agents import AgentEpisodes, EndpointHost
from megarl.rollout.endpoint.sessions import SampledTurn, SessionLimits, SessionSampling, TurnSpec
from megarl.rollout.endpoint.vllm_requests import VLLMRequests
from megarl.rollout.episodes import EpisodeLimits, EpisodeRequest, Trajectory
from megarl.rollout.sampling import SamplingConfig


class AgentRunner:
    """Agent episodes in the shape of ``EpisodeRunner`` (what ``VLLMEngine._run_episodes``,
    ``continue_episodes`` and ``drop_episodes`` call), each call on a fresh request backend."""

    def __init__(self, episodes: AgentEpisodes, backend: Callable[[], VLLMRequests], version: int):
        self.episodes, self.backend, self.version = episodes, backend, version

    @property
    def suspended(self) -> bool:
        return self.episodes.suspended

    def run(self, requests: list[EpisodeRequest], stop: Callable[[], bool] | None = None,
            suspend: bool = False) -> list[Trajectory | None]:
        return self.episodes.run(requests, self.backend(), self.version, stop, suspend)

    def resume(self, turns: Any, version: int, stop: Callable[[], bool] | None = None,
               suspend: bool = False) -> list[Trajectory | None]:
        """``turns``, the engine's step-by-step backend for episode runners, is not used: agents'
        turns carry their own sampling settings (``VLLMRequests``)."""
        self.version = version
        return self.episodes.resume(self.backend(), version, stop, suspend)

    def close(self) -> None:
        self.episodes.close()


class AgentHosting:
    _endpoint_host: EndpointHost | None = None

    def endpoint_url(self) -> str:
        """The endpoint's base URL ('' before the first agent call started it)."""
        return "" if self._endpoint_host is None else self._endpoint_host.endpoint.url

    def _agent_runner(self, agent: Callable, sampling: SamplingConfig, env: Any, limits: EpisodeLimits) -> AgentRunner:
        """The call's agent episodes, run as the engine runs an ``EpisodeRunner`` (``run``, then
        ``resume`` after an interruption that kept them, or ``close``)."""
        if self._endpoint_host is None:
            from transformers import AutoTokenizer

            # the loop's own tokenizer: the engine's thread decodes (stop strings) with the engine's
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self._endpoint_host = EndpointHost.start(self._env_loop(), tokenizer,
                                                     os.path.basename(self.model_path.rstrip("/")), env.tool_parser)

        def count(tokens: int) -> None:
            self._sampled_tokens += tokens

        episodes = AgentEpisodes(
            self._endpoint_host, agent, env.options,
            SessionLimits(limits.max_turns, limits.max_episode_tokens, limits.max_turn_tokens, limits.max_model_len,
                          limits.session_wall_s),
            SessionSampling(sampling.temperature, sampling.top_p, sampling.top_k, fixed=True),
            limits.max_concurrent, env.agent_timeout_s)
        return AgentRunner(episodes, lambda: VLLMRequests(self.llm, self._tokenizer(), sampling.stop_token_ids,
                                                          on_sampled=count), self.weight_version)

    def endpoint_turns(self, turns: list[tuple[list[int], TurnSpec]], stop_token_ids: list[int],
                       version: int) -> list[SampledTurn | str]:
        """Outside callers' turns (prompt ids, spec), generated together; each answered with its
        ``SampledTurn`` (of weight version ``version``) or why the engine refused it. Refused
        whole where the engine holds other weights than the caller expects (a sync it missed)."""
        if version != self.weight_version:
            raise ValueError(f"the endpoint expects weight version {version}, this engine holds "
                             f"{self.weight_version}")
        def count(tokens: int) -> None:  # the watchdog's sign of progress
            self._sampled_tokens += tokens

        backend = VLLMRequests(self.llm, self._tokenizer(), stop_token_ids, on_sampled=count)
        answers: list[SampledTurn | str] = [""] * len(turns)
        ids = {}
        for i, (prompt_ids, spec) in enumerate(turns):
            request_id = f"megarl-outside-{version}-{i}-{id(backend)}"
            try:
                backend.add(request_id, prompt_ids, spec)
                ids[request_id] = i
            except Exception as exc:  # this request only: the caller hears why
                answers[i] = f"the engine refused the request: {exc}"
        try:
            while backend.has_unfinished():
                for request_id, turn in backend.step():
                    turn.version = version
                    answers[ids[request_id]] = turn
        except BaseException:
            backend.abort(None)
            raise
        return answers
