"""``env.kind: openenv:<package>``: an OpenEnv environment (a package, dotted names allowed, such as
``megarl.envs.examples.openenv_sums`` or one of OpenEnv's own: an environment class served by
OpenEnv's ``create_app``, its ``EnvClient``, its ``Action`` and ``Observation``) played as an agent
on the rollout endpoint.

The run starts the environment's server on loopback (``openenv_server``, a child of the process
that plays the episodes, killed with it and at exit) and drives each episode through the
package's own async client: ``reset(**env.options["reset"], seed=...)``; then, until the
environment says done or ``env.max_turns``, the observation's ``prompt_field`` goes to the policy
as a user message, its reply comes back as the action's ``answer_field``, and the rewards the
environment gives add up to the episode's reward.

The run's data item only picks the episode's seed (a hash of its prompt, so a group's episodes
get the same question); the question is the environment's. ``env.options``:

- ``client``, ``action``, ``observation``, ``environment``: ``package.module:Name``; by default
  the one ``EnvClient`` / ``Action`` / ``Observation`` subclass the package exports, and the one
  ``Environment`` subclass in ``<package>.server``
- ``prompt_field`` (default ``question``), ``answer_field`` (default: the action's one field)
- ``reset``: keywords of ``reset`` (for openenv_sums: min_terms, max_terms, min_digits, max_digits)
- ``max_sessions``: the server's concurrent sessions (default 64)
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import importlib.util
import inspect
import pkgutil
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megarl.config.schema import EnvConfig

PREFIX = "openenv:"
OPTIONS = ("client", "action", "observation", "environment", "prompt_field", "answer_field", "reset",
           "max_sessions")


@dataclass
class OpenEnvSpec:
    package: str
    client: type
    action: type
    observation: type
    environment: str  # package.module:Name, imported again in the server process
    prompt_field: str
    answer_field: str
    reset: dict = field(default_factory=dict)
    max_sessions: int = 64


def _one(module: Any, base: type, what: str, kind: str) -> type:
    found = {id(v): v for v in vars(module).values() if inspect.isclass(v) and issubclass(v, base) and v is not base}
    if len(found) != 1:
        names = ", ".join(sorted(v.__name__ for v in found.values())) or "none"
        raise ValueError(f"env.kind {kind!r}: name env.options.{what} (the package exports {names})")
    return next(iter(found.values()))


def _named(path: str, base: type, what: str) -> type:
    from megarl.utils.imports import load_object

    obj = load_object(path)
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise ValueError(f"env.options.{what}={path!r} is not a subclass of {base.__name__}")
    return obj


def _environment(package: str, kind: str) -> str:
    from openenv.core.env_server.interfaces import Environment

    try:
        server = importlib.import_module(f"{package}.server")
    except ImportError:
        raise ValueError(f"env.kind {kind!r}: {package} has no server package; name env.options.environment") from None
    found = set()
    for info in pkgutil.iter_modules(server.__path__):
        if info.name == "app":  # builds its own app at import; the environment class lives elsewhere
            continue
        module = importlib.import_module(f"{server.__name__}.{info.name}")
        found |= {f"{module.__name__}:{v.__name__}" for v in vars(module).values()
                  if inspect.isclass(v) and issubclass(v, Environment) and v.__module__ == module.__name__}
    if len(found) != 1:
        names = ", ".join(sorted(found)) or "none"
        raise ValueError(f"env.kind {kind!r}: name env.options.environment (found {names})")
    return found.pop()


def check(env: EnvConfig) -> OpenEnvSpec:
    """The environment's classes and options, checked without starting its server; ValueError,
    one line, naming what is missing."""
    kind, package = env.kind, env.kind[len(PREFIX):]
    if not package:
        raise ValueError(f"env.kind {kind!r} names no environment (openenv:<package>)")
    if importlib.util.find_spec("openenv") is None:
        raise ValueError(f"env.kind {kind!r} needs openenv-core (see containers/install-cpu.sh)")
    unknown = sorted(set(env.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"env.options has {', '.join(unknown)}: an OpenEnv environment takes {', '.join(OPTIONS)}")
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise ValueError(f"env.kind {kind!r}: cannot import {package!r} ({exc})") from None
    from openenv.core import EnvClient
    from openenv.core.env_server.types import Action, Observation

    o = env.options
    client = _named(o["client"], EnvClient, "client") if "client" in o else _one(module, EnvClient, "client", kind)
    action = _named(o["action"], Action, "action") if "action" in o else _one(module, Action, "action", kind)
    observation = (_named(o["observation"], Observation, "observation") if "observation" in o
                   else _one(module, Observation, "observation", kind))
    environment = o.get("environment") or _environment(package, kind)
    own = [n for n in action.model_fields if n not in Action.model_fields]
    answer_field = o.get("answer_field") or (own[0] if len(own) == 1 else "")
    if answer_field not in action.model_fields:
        raise ValueError(f"env.options.answer_field must name the {action.__name__} field the reply fills "
                         f"(one of {', '.join(own)})")
    prompt_field = o.get("prompt_field", "question")
    if prompt_field not in observation.model_fields:
        raise ValueError(f"env.options.prompt_field={prompt_field!r} is not a field of {observation.__name__}")
    if not isinstance(o.get("reset", {}), dict):
        raise ValueError("env.options.reset must be a mapping (the keywords of the environment's reset)")
    return OpenEnvSpec(package, client, action, observation, environment, prompt_field, answer_field,
                       dict(o.get("reset", {})), int(o.get("max_sessions", 64)))


class OpenEnvServer:
    """The environment's server: a child process on a free loopback port, up before ``start``
    returns, killed by ``stop``, at exit, or (Linux) when its parent dies."""

    def __init__(self, spec: OpenEnvSpec, start_timeout_s: float = 120.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megarl.envs.adapters.openenv_server", spec.environment,
             f"{spec.action.__module__}:{spec.action.__name__}",
             f"{spec.observation.__module__}:{spec.observation.__name__}", str(self.port), str(spec.max_sessions)],
            preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenEnv server for {spec.package} exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the OpenEnv server for {spec.package} did not answer in {start_timeout_s} s")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_SERVERS: dict[str, OpenEnvServer] = {}


def openenv_agent(env: EnvConfig) -> Callable:
    """The agent that plays one episode on the environment's server (started at its first episode)."""
    spec = check(env)
    key = repr(sorted(env.options.items(), key=str)) + env.kind
    starting: list[asyncio.Lock] = []

    async def episode(client: Any, item: Any, **_options: Any) -> float:
        if key not in _SERVERS:
            starting.append(starting[0] if starting else asyncio.Lock())
            async with starting[0]:  # one server, however many episodes start at once
                if key not in _SERVERS:  # started off the loop: the endpoint answers meanwhile
                    _SERVERS[key] = await asyncio.to_thread(OpenEnvServer, spec)
        environment = spec.client(base_url=_SERVERS[key].url)
        try:
            result = await environment.reset(**spec.reset, seed=zlib.crc32(item.prompt.encode()))
            messages, reward, turns = [], 0.0, 0
            while not result.done and turns < env.max_turns:
                messages.append({"role": "user", "content": str(getattr(result.observation, spec.prompt_field))})
                reply = await client.chat.completions.create(model="policy", messages=messages)
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                result = await environment.step(spec.action(**{spec.answer_field: text}))
                reward += float(result.reward or 0.0)
                turns += 1
            return reward
        finally:
            await environment.close()

    return episode
