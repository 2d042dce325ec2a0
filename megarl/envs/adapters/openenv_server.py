"""An OpenEnv environment server on loopback, as the run's own child process:

    python -m megarl.envs.adapters.openenv_server ENV_CLASS ACTION_CLASS OBSERVATION_CLASS PORT MAX_SESSIONS

OpenEnv's own ``create_app`` (its HTTP and WebSocket routes) around the environment class,
served by uvicorn on 127.0.0.1. Built here rather than from the package's ``server.app`` module
because those fix their session count (some of OpenEnv's allow one), and a run plays a
step's episodes at once."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    from megarl.utils.imports import load_object

    env_cls, action_cls, observation_cls = (load_object(path) for path in argv[:3])
    app = create_app(env_cls, action_cls, observation_cls, env_name=env_cls.__name__,
                     max_concurrent_envs=int(argv[4]))
    # critical: a client that closes first is logged as an error, once per episode
    uvicorn.run(app, host="127.0.0.1", port=int(argv[3]), log_level="critical")


if __name__ == "__main__":
    main(sys.argv[1:])
