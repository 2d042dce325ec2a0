"""``rollout.endpoint``: the rollout endpoint (``megarl.rollout.endpoint``) bound where callers
outside the run can reach it, for debugging or held-out evaluation. Off by default: agents of
the run reach their engine's own endpoint on a free loopback port that nothing else is told of."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

LOOPBACK_NAMES = ("localhost",)


@dataclass
class EndpointConfig:
    # The port to serve outside callers on, for the whole run (one server in front of every
    # engine, megarl.rollout.endpoint.bound); None: not bound.
    port: int | None = None
    host: str = "127.0.0.1"  # loopback by default; anything else needs a token
    # Bearer token every request must carry (Authorization: Bearer <token>); a request without it
    # is answered 401. Required where host is not loopback: the endpoint samples from the policy.
    token: str = ""
    # The longest a session may last, in seconds from its opening: the run's agent sessions and
    # outside callers' alike. The request that passes it is answered 400 (its turn aborted at the
    # engine) and the session ends; a run's episode then fails (env_error, no reward, counted).
    # None: no limit (env.agent_timeout_s still bounds an agent of the run).
    session_wall_s: float | None = None


def is_loopback(host: str) -> bool:
    """True for a loopback address or name (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_errors(endpoint: EndpointConfig) -> list[str]:
    """What makes ``rollout.endpoint`` unusable, one line each."""
    errors = []
    if endpoint.port is not None and not 1 <= endpoint.port <= 65535:
        errors.append(f"rollout.endpoint.port={endpoint.port} must be in [1, 65535] (or unset: not bound)")
    if not endpoint.host:
        errors.append("rollout.endpoint.host must name an address (127.0.0.1: loopback)")
    elif endpoint.port is not None and not is_loopback(endpoint.host) and not endpoint.token:
        errors.append(f"rollout.endpoint.host={endpoint.host!r} is not loopback: set rollout.endpoint.token "
                      "(a bearer token callers must send)")
    if endpoint.session_wall_s is not None and not endpoint.session_wall_s > 0:
        errors.append(f"rollout.endpoint.session_wall_s={endpoint.session_wall_s} must be > 0 seconds (or unset: "
                      "no limit)")
    if endpoint.token and any(c.isspace() for c in endpoint.token):
        errors.append("rollout.endpoint.token must not contain whitespace (it goes in an Authorization header)")
    return errors
