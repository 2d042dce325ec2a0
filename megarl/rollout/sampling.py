"""Sampling settings and generated samples, independent of any engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A sample continued after an interruption (``rollout.partial: continue``) samples its s-th
# piece with its seed + SEGMENT_SEED_STRIDE * s: a fresh stream, the same on any engine.
SEGMENT_SEED_STRIDE = 7919


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    max_tokens: int = 64
    n: int = 1  # samples per prompt
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True  # return the sampled tokens' log-probabilities
    # The policy weight version the caller records for these samples: an engine holding another
    # version refuses to generate (None: no check, for callers that do not track versions).
    weight_version: int | None = None


@dataclass
class RolloutSample:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # one per response token (log p under the rollout engine)
    finish_reason: str  # "stop" (a stop token), "length" (max_tokens), "interrupted" (a weight sync came)
    # Multi-turn episodes: 1 where the response token is the policy's (trained), 0 where an
    # environment inserted it (context only). None: every response token is the policy's.
    response_mask: list[int] | None = None
    # Rollout routing replay (a MoE actor's ``moe.routing_replay``): the experts the engine routed
    # each token of prompt + response to, ``[tokens, layers, k]`` int16 (-1 at a dense layer).
    routes: torch.Tensor | None = None


@dataclass(frozen=True)
class SegmentRequest:
    """One sample's generation from where it stands (``rollout.partial``): the prompt, followed by
    the tokens earlier weights generated for it when it continues; one sample, ``max_tokens`` at
    most, sampled with ``seed``. The engine stops it early, as "interrupted", when told to."""

    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None
