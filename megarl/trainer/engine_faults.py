"""The driver's part of an engine replaced at once (issue 42 item 1), when no engine is left to
finish the batch in flight: one engine (the usual colocated setup), or all of them failed.

The rollout service keeps the failed engine's calls (``megarl.rollout_driver.fleet``) and the
driver, waiting for that batch (``take``) or for generation to end (a drain before a checkpoint or
a snapshot), starts the replacement on its own thread meanwhile (``waiting_on_engines``). That is
only right under ``trainer.max_staleness: 0``: whenever the driver waits on generation then, the
actor's weights are the version the engines held, so the replacement takes those and the calls
asked again of it give the answers the failed engine would have given (same request, same seed).

The replacement goes through the device's hand-over order (``megarl.trainer.colocation``): it
starts with every role off the device, sleeps while the actor comes back, takes the weights from
``to_sync`` on, has its KV cache back, is checked against the actor, and the actor leaves again,
which is where the rollout had the device. Disaggregated, the hand-overs do nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from megarl.utils.abort import wait_all

# ``run`` below is a megarl.trainer.run.Run, untyped here: run.py imports this module
Run = Any
T = TypeVar("T")
_LOOK_S = 0.5


def waiting_on_engines(run: Run, call: Callable[[], T]) -> T:
    """``call()`` (a wait on generation) on a thread of its own, while this one replaces the
    engines at once when every one has failed (their calls wait in the service meanwhile)."""
    fleet = run.fleet
    if fleet is None or not fleet.replaces_now:
        return call()
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # re-raised on the driver's thread
            outcome["error"] = error

    waiter = threading.Thread(target=wait, name="megarl-wait-on-engines", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(_LOOK_S)
        if waiter.is_alive() and fleet.stranded():
            replace_now(run)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def replace_now(run: Run) -> None:
    """The failed engines replaced mid-step: started, given the weights the engines held, checked,
    then handed to the service, whose calls waiting on them are asked of the replacements."""
    version, device = run.engine_version, run.colocation
    device.make_room()  # mid-rollout the roles are off the device already
    run.sync = run.fleet.replace_failed(run.sync, joined=device.join)
    device.to_sync()
    # the outside endpoint (rollout.endpoint.port) routes to the replacement only from here on
    with run.outside.paused(version, run.engines):
        run.sync.sync()
        wait_all([e.set_weight_version.remote(version) for e in run.engines], run.cfg.trainer.collective_timeout_s,
                 "recording the engines' weight version")
    device.after_sync()
    checked = run.verify_sync(None, every=True)
    device.actor_off()
    # the engines generate the batch of the step after their version's (trainer.max_staleness: 0)
    run.fleet.serve(version, from_step=version + 1)
    run.replacement_checks.append(checked)


def checks_since(run: Run, verified: dict[str, float]) -> dict[str, float]:
    """A step's sync check with the replacements' checks made mid-step: the worst of them."""
    for checked in run.replacement_checks:
        for key, value in checked.items():
            verified[key] = max(value, verified.get(key, value))
    run.replacement_checks.clear()
    return verified
