"""Who holds the device when the Megatron roles and vLLM share it: the hand-overs, in order.

Colocated (``rollout.colocate_with``), a step passes the device back and forth:

    to_rollout    the Megatron roles move params, grads and optimizer state off the device
    (generate)
    to_training   vLLM sleeps (weights and KV cache freed), the roles come back
    (score, train)
    to_sync       the roles give up all but the actor's weights; vLLM wakes its weights only
    (weight sync)
    after_sync    vLLM's KV cache comes back
    (verify: the check scores with the actor's weights)
    actor_off     the actor's weights leave too; the next step's to_rollout then has nothing to do

That order keeps the device's peak lowest: at no point do the optimizer state and vLLM's
KV cache, or two copies of the weights besides the actor's, share it. Disaggregated (the
rollout on devices of its own), every hand-over is a no-op. ``offloaded_bytes`` counts
what the roles moved off the device since it was last read, for the step's metrics.

A process that dies comes back where it fits that order (issue 42). A replacement engine starts
with every role off the device (``make_room``), as at start-up, since vLLM sizes its KV cache from
the device's free memory as it starts; then it sleeps like the others and the actor comes back
(``join``), so the weight sync that gives it the actor's weights runs from ``to_sync`` on. Roles
restarted in place load with the engines asleep (``engines_sleep``), as after ``to_training``.
Which of vLLM's parts the engines hold is tracked, so no hand-over sleeps or wakes an engine twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from megarl.trainer.roles import MegatronRole
from megarl.utils.abort import wait_all
from megarl.workers import offload_fns

Held = Literal["nothing", "weights", "all"]  # what of vLLM's memory the engines hold


class Colocation:
    def __init__(self, sharing: dict[str, MegatronRole], engines: list, timeout_s: float):
        self.sharing = sharing  # the roles on the rollout's devices; empty when disaggregated
        self.engines = engines
        self.timeout_s = timeout_s
        self.offloaded_bytes = 0
        self.engines_hold: Held = "all"  # engines start awake

    @property
    def active(self) -> bool:
        return bool(self.sharing)

    def to_rollout(self) -> None:
        for role in self.sharing.values():
            self.offloaded_bytes += role.offload()

    def to_training(self) -> None:
        if self.sharing:
            self.engines_sleep()
            for role in self.sharing.values():
                role.onload()

    def to_sync(self) -> None:
        for name, role in self.sharing.items():
            self.offloaded_bytes += role.offload(("grads", "optimizer") if name == "actor" else offload_fns.PARTS)
        self._wake_weights()

    def after_sync(self) -> None:
        if self.sharing and self.engines_hold == "weights":
            self._engines([e.wake_up_kv_cache.remote() for e in self.engines], "vLLM's wake-up")
            self.engines_hold = "all"

    def engines_sleep(self) -> None:
        """vLLM frees the device (if it holds anything), for the roles to load or come back."""
        if self.sharing and self.engines_hold != "nothing":
            self._engines([e.sleep.remote() for e in self.engines], "vLLM's sleep")
            self.engines_hold = "nothing"

    # -- a replacement engine (megarl.rollout_driver.engine_restarts) -----------------------------

    def make_room(self) -> None:
        """Every role off the device before a replacement engine starts on it (its KV cache is
        sized from the free memory then); the engines that live stay as they are."""
        self.to_rollout()

    def join(self, started: list) -> None:
        """The replacements ``started`` (awake, as vLLM starts) sleep like the others, and the
        actor comes back for the weight sync that ``to_sync`` then prepares: the device never holds
        more than in a step's own hand-overs."""
        if not self.sharing:
            return
        others = [e for e in self.engines if not any(e is s for s in started)]
        sleepers = started + (others if self.engines_hold != "nothing" else [])  # the others asleep already?
        self._engines([e.sleep.remote() for e in sleepers], "vLLM's sleep")
        self.engines_hold = "nothing"
        if "actor" in self.sharing:
            self.sharing["actor"].onload()

    def actor_off(self) -> None:
        if "actor" in self.sharing:
            self.offloaded_bytes += self.sharing["actor"].offload()

    @contextlib.contextmanager
    def roles_on_device(self) -> Iterator[None]:
        """For work outside the step's flow (checkpoints): vLLM sleeps and the roles that are off
        the device come back, then the roles leave again and vLLM wakes, so the run continues in
        the state it was in. Between steps vLLM holds its weights and KV cache: the roles'
        parameters, gradients and optimizer state must not come back on top of them."""
        held = self.engines_hold
        if self.engines:  # none once the run released them
            self.engines_sleep()
        back = {n: r for n, r in self.sharing.items() if r.onload() > 0}
        try:
            yield
        finally:
            for role in back.values():
                role.offload()
            if self.engines and held != "nothing":
                self._wake_weights()
                if held == "all":
                    self.after_sync()

    def take_offloaded_bytes(self) -> int:
        """Bytes moved off the device since the last call."""
        taken, self.offloaded_bytes = self.offloaded_bytes, 0
        return taken

    def _wake_weights(self) -> None:
        if self.sharing and self.engines_hold == "nothing":
            self._engines([e.wake_up_weights.remote() for e in self.engines], "vLLM's wake-up")
            self.engines_hold = "weights"

    def _engines(self, calls: list, what: str) -> None:
        wait_all(calls, self.timeout_s, what)
