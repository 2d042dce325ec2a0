"""Megatron roles starting side by side: each one's ranks import megatron-core, bring up their
process groups and load their weights while the others' do (at scale each load reads its own
checkpoint for minutes). Started earlier still, as soon as the engines were (beside the driver's
data and rollout service), they gained nothing measurable on 2 cores: 21.1 s to the first step
against 20.8 s, start-up being CPU-bound there.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megarl.utils.abort import RUN_ABORT


def start_side_by_side(names: list[str], start: Callable[[str], Any]) -> dict[str, Any]:
    """``start(name)`` for each of ``names``, one thread each: the roles by name. If one fails the
    others still finish starting and are stopped, and the first failure is raised. An interruption
    (Ctrl-C) trips the run abort, which ends the starts' own waits within a second, and the roles
    that came up are stopped too: no one else knows them."""
    up: dict[str, Any] = {}  # filled by the starts themselves: a Ctrl-C may land before a submit returns
    failed: list[BaseException] = []

    def start_one(name: str) -> None:
        try:
            up[name] = start(name)
        except BaseException as error:
            failed.append(error)

    pool = ThreadPoolExecutor(max_workers=max(1, len(names)), thread_name_prefix="megarl-role-start")
    interrupted = True
    try:
        futures.wait([pool.submit(start_one, name) for name in names])
        interrupted = False
    except BaseException:
        RUN_ABORT.trip("start-up interrupted")
        raise
    finally:
        pool.shutdown(wait=True)  # every start has ended (one thread each: none waits its turn)
        if failed or interrupted:
            for role in up.values():
                role.shutdown(graceful=False)
    if failed:
        raise failed[0]  # the first to fail; the others' failures follow from it or are alike
    return {name: up[name] for name in names}
