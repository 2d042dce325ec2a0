"""Starting, or joining, the Ray instance that places megarl's roles.

On a cluster a launcher brings Ray up on every node and exports RAY_ADDRESS; the
driver joins it. On a laptop or in tests there is no cluster: the driver starts a
local Ray, sized so that a small machine can still host a whole RL job.

Ray's CPU count is a scheduling quantity, not a thread count: a rank actor asks for
one logical CPU, and a 2-core machine must still place the ~16 actors of a colocated
job (actor, reference, critic, rollout ranks), which mostly wait on each other. So
the local instance declares max(16, cores) logical CPUs; each rank sizes its own
torch thread pool from the real cores (see megarl.workers.group).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

DEFAULT_LOCAL_CPUS = 16
DEFAULT_OBJECT_STORE_MIB = 512


def ensure_ray(num_cpus: int | None = None, namespace: str = "megarl", *,
               object_store_mib: int = DEFAULT_OBJECT_STORE_MIB, log_to_driver: bool = False) -> None:
    """Initialises Ray once per process: joins RAY_ADDRESS if set, else starts a local instance.

    Does nothing if Ray is already initialised (tests share one instance: starting one
    costs 5-15 s on a small machine). ``num_cpus`` and ``object_store_mib`` size only a
    local instance; a joined cluster keeps what its launcher gave it. The object store is
    bounded because megarl moves only batches through it (weights travel over
    torch.distributed), and Ray's default (30% of RAM in /dev/shm) would pin memory the
    models need. ``log_to_driver`` is off by default: rank failures come back as
    WorkerGroupError with the rank's traceback, and forwarding every rank's output would
    bury the driver's own log; turn it on to see ranks' prints while debugging.

    Joining a cluster: Ray 2.60's ``ray start --head`` turns token authentication on by
    default, but a driver joining through RAY_ADDRESS sends its token only when
    RAY_AUTH_MODE=token is set (token from ~/.ray/auth_token or RAY_AUTH_TOKEN); without it
    ray.init retries "InvalidAuthToken" for about 20 s and fails. Launchers export it.
    """
    import ray

    if ray.is_initialized():
        return
    with _keeping_sigterm_handler():
        _init(ray, num_cpus, namespace, object_store_mib, log_to_driver)


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """ray.init installs a C++ handler for SIGTERM in the driver that prints a stack and aborts:
    no ``finally`` runs, and the run's processes (Ray's agents, ranks, vLLM) outlive it. The
    driver's own Python handler (megarl.cli.main: unwind like Ctrl-C) is put back."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _quiet_token_auth_notice(record: logging.LogRecord) -> bool:
    """Drops Ray's notice that token authentication is on (megarl keeps it on: nothing to act on);
    its warning that authentication is off still shows."""
    return "Token authentication is enabled" not in record.getMessage()


def _init(ray, num_cpus: int | None, namespace: str, object_store_mib: int, log_to_driver: bool) -> None:
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if _quiet_token_auth_notice not in auth_log.filters:
        auth_log.addFilter(_quiet_token_auth_notice)
    common = dict(namespace=namespace, log_to_driver=log_to_driver, logging_level=logging.WARNING)
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **common)
        return
    ray.init(
        # "local": always a fresh instance; a bare ray.init() would join any cluster that
        # `ray start` left running on this machine (another user's, or a launcher's).
        address="local",
        num_cpus=num_cpus if num_cpus is not None else max(DEFAULT_LOCAL_CPUS, os.cpu_count() or 1),
        object_store_memory=object_store_mib * 1024**2,
        include_dashboard=False,
        # Ranks and vLLM take turns on few cores; OpenMP threads that spin after their work
        # (the default) steal those cores from the process whose turn it is.
        runtime_env={"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}},
        **common,
    )


def shutdown_ray() -> None:
    """Stops the local Ray instance (or leaves a joined cluster); a no-op if none is running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
