"""Waiting on a rollout engine's progress in tests that interrupt it: its own count of sampled
tokens (``VLLMEngine.sampled_tokens``), not a fixed sleep, which a cold or loaded engine outlasts."""

from __future__ import annotations

import time


def sampled_tokens(engine) -> int:
    import ray

    return ray.get(engine.sampled_tokens.remote(), timeout=60)


def wait_for_tokens(engine, since: int, count: int, timeout_s: float = 120) -> None:
    """Until ``engine`` (a Ray handle) has sampled ``count`` tokens after its count stood at ``since``."""
    deadline = time.monotonic() + timeout_s
    while sampled_tokens(engine) - since < count:
        assert time.monotonic() < deadline, f"the engine sampled no {count} tokens in {timeout_s:.0f} s"
        time.sleep(0.02)
