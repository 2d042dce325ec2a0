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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megarl.trainer.roles import MegatronRole
from megarl.utils.abort import wait_all
from megarl.workers import offload_fns


class Colocation:
    def __init__(self, sharing: dict[str, MegatronRole], engines: list, timeout_s: float):
        self.sharing = sharing  # the roles on the rollout's devices; empty when disaggregated
        self.engines = engines
        self.timeout_s = timeout_s
        self.offloaded_bytes = 0

    @property
    def active(self) -> bool:
        return bool(self.sharing)

    def to_rollout(self) -> None:
        for role in self.sharing.values():
            self.offloaded_bytes += role.offload()

    def to_training(self) -> None:
        if self.sharing:
            self._engines([e.sleep.remote() for e in self.engines], "vLLM's sleep")
            for role in self.sharing.values():
                role.onload()

    def to_sync(self) -> None:
        for name, role in self.sharing.items():
            self.offloaded_bytes += role.offload(("grads", "optimizer") if name == "actor" else offload_fns.PARTS)
        if self.sharing:
            self._engines([e.wake_up_weights.remote() for e in self.engines], "vLLM's wake-up")

    def after_sync(self) -> None:
        if self.sharing:
            self._engines([e.wake_up_kv_cache.remote() for e in self.engines], "vLLM's wake-up")

    def actor_off(self) -> None:
        if "actor" in self.sharing:
            self.offloaded_bytes += self.sharing["actor"].offload()

    @contextlib.contextmanager
    def roles_on_device(self) -> Iterator[None]:
        """For work outside the step's flow (checkpoints): vLLM sleeps and the roles that are off
        the device come back, then the roles leave again and vLLM wakes, so the run continues in
        the state it was in. Between steps vLLM holds its weights and KV cache: the roles'
        parameters, gradients and optimizer state must not come back on top of them."""
        engines = list(self.engines) if self.sharing else []  # none once the run released them
        if engines:
            self._engines([e.sleep.remote() for e in engines], "vLLM's sleep")
        back = {n: r for n, r in self.sharing.items() if r.onload() > 0}
        try:
            yield
        finally:
            for role in back.values():
                role.offload()
            if engines:
                self._engines([e.wake_up_weights.remote() for e in engines], "vLLM's wake-up")
                self._engines([e.wake_up_kv_cache.remote() for e in engines], "vLLM's wake-up")

    def take_offloaded_bytes(self) -> int:
        """Bytes moved off the device since the last call."""
        taken, self.offloaded_bytes = self.offloaded_bytes, 0
        return taken

    def _engines(self, calls: list, what: str) -> None:
        wait_all(calls, self.timeout_s, what)
