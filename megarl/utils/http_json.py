"""JSON over HTTP POST with retries, a whole-attempt deadline and a capped answer: the transport
of every remote service megarl calls (``megarl.rewards.remote``, ``megarl.envs.remote``).

Retry policy (why: such services are shared and flaky, but a request they reject will be
rejected again):

- retried: connection failures (refused, reset, closed early), timeouts, HTTP 5xx,
  and HTTP 429 (the server asks us to come back later);
- not retried: other 4xx (the request is wrong) and a 200 whose body is not JSON or is too
  large (the server is wrong) - both raise at once;
- attempt ``k`` (from 1) that fails waits ``min(backoff_s * 2**(k-1), max_backoff_s)``
  before the next one; after ``1 + max_retries`` attempts the error names the URL and the
  last failure.

``timeout_s`` bounds each attempt as a whole (connect, send, headers and body): a watchdog
shuts the socket at the deadline, so a server that trickles its answer a byte at a time cannot
hold a call past it, and a server that never answers costs at most
``(1 + max_retries) * timeout_s`` plus the backoff sleeps. Standard library only; environment
proxies are not used (these services are internal endpoints, and a stray ``http_proxy`` must
not reroute them).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSE_BYTES = 8 * 2**20  # far above any protocol answer: this is a server gone wrong


def url_problem(url: object) -> str | None:
    """What makes ``url`` unusable as a service endpoint, or None (checked at config time too)."""
    if not isinstance(url, str):
        return f"must be a string, got {type(url).__name__}"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "must not contain spaces or control characters"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be http(s)://host[:port]/path"
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        return "has a port outside 0-65535"
    if parts.username is not None or parts.password is not None:
        return "must not carry credentials (user:password@); pass them as headers"
    return None


class HttpJsonError(RuntimeError):
    """The call failed for good (retries exhausted, 4xx, an answer too large or not JSON)."""


class _Retryable(Exception):
    """A failure worth another attempt; the message describes it for the final error."""


@dataclass
class HttpStats:
    requests: int = 0  # HTTP attempts made, retries included
    retries: int = 0  # attempts after the first, summed over calls
    failures: int = 0  # calls that gave up


@dataclass(frozen=True)
class RetryPolicy:
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def problems(self) -> list[str]:
        out = []
        if not isinstance(self.timeout_s, int | float) or not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            out.append(f"timeout_s must be a positive number, got {self.timeout_s!r}")
        for name in ("backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (value >= 0 and math.isfinite(value)):
                out.append(f"{name} must be a non-negative number, got {value!r}")
        for name, minimum in (("max_retries", 0), ("max_response_bytes", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                out.append(f"{name} must be an integer >= {minimum}, got {value!r}")
        return out


class JsonPoster:
    """POSTs JSON bodies to ``url`` (or ``url`` + a path suffix) and returns the decoded answer.

    ``label`` starts every error message ("remote reward", "remote environment"); ``error`` is
    the exception class raised for good (a subclass of HttpJsonError). Thread-safe."""

    def __init__(self, url: str, policy: RetryPolicy, label: str, error: type[HttpJsonError] = HttpJsonError,
                 headers: dict[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        self.url, self.policy, self.label, self.error = url, policy, label, error
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._base_path = parts.path or "/"
        self._query = f"?{parts.query}" if parts.query else ""
        self.stats = HttpStats()
        self._stats_lock = threading.Lock()

    def endpoint(self, suffix: str = "") -> str:
        """The URL a call with ``suffix`` goes to (``suffix`` "/step" on base ".../env" -> ".../env/step")."""
        return self.url if not suffix else self._with_suffix(self.url, suffix)

    @staticmethod
    def _with_suffix(url: str, suffix: str) -> str:
        parts = urllib.parse.urlsplit(url)
        return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + suffix))

    def post(self, payload: Any, what: str, suffix: str = "") -> Any:
        """The JSON answer to ``payload``; ``what`` names the request in errors ("samples 0..3")."""
        body = json.dumps(payload, allow_nan=False).encode()
        path = (self._base_path.rstrip("/") + suffix if suffix else self._base_path) + self._query
        url = self.endpoint(suffix)
        attempts = 1 + self.policy.max_retries
        last = "no attempt made"
        for attempt in range(1, attempts + 1):
            with self._stats_lock:
                self.stats.requests += 1
                self.stats.retries += attempt > 1
            try:
                return self._post_once(path, url, body, what)
            except _Retryable as exc:
                last = str(exc)
            if attempt < attempts:
                time.sleep(min(self.policy.backoff_s * 2 ** (attempt - 1), self.policy.max_backoff_s))
        with self._stats_lock:
            self.stats.failures += 1
        raise self.error(f"{self.label} {url}: {what} failed after {attempts} attempts; last failure: {last}")

    def _post_once(self, path: str, url: str, body: bytes, what: str) -> Any:
        timeout_s = self.policy.timeout_s
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        # The socket timeout bounds each read, not the attempt: a peer that sends a byte just
        # inside it keeps the call alive for ever. The watchdog shuts the socket at the deadline.
        conn = cls(self._host, self._port, timeout=timeout_s)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read with EOF or an error
                except OSError:
                    pass

        watchdog = threading.Timer(timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        timed_out = _Retryable(f"timed out after {timeout_s:g} s")
        try:
            try:
                conn.connect()
                if expired.is_set():  # the deadline passed while connecting, before there was a socket to shut
                    raise timed_out
                conn.request("POST", path, body=body, headers=self.headers)
                response = conn.getresponse()
                data = self._read_capped(response, url, what)
            except TimeoutError as exc:
                raise _Retryable(f"timed out after {timeout_s:g} s ({exc})") from exc
            except (OSError, http.client.HTTPException) as exc:
                if expired.is_set():
                    raise timed_out from exc
                # OSError covers refused/reset connections; HTTPException a peer that hung up mid-answer.
                raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
            if expired.is_set():  # a body cut short by the watchdog can look complete (no Content-Length)
                raise timed_out
        finally:
            watchdog.cancel()
            conn.close()
        status = response.status
        if status >= 500 or status == 429:
            raise _Retryable(f"HTTP {status} {response.reason}: {snippet(data)}")
        if status != 200:
            raise self.error(f"{self.label} {url}: HTTP {status} {response.reason} for {what} (not retried): "
                             f"{snippet(data)}")
        where = f"{self.label} {url} ({what})"
        try:
            return json.loads(data)
        except RecursionError:
            raise self.error(f"{where}: response nests too deeply") from None
        except ValueError as exc:
            raise self.error(f"{where}: response is not JSON ({exc}): {snippet(data)}") from exc

    def _read_capped(self, response: http.client.HTTPResponse, url: str, what: str) -> bytes:
        """The body, refusing one longer than max_response_bytes before reading past the limit."""
        cap = self.policy.max_response_bytes
        too_large = self.error(f"{self.label} {url}: the answer for {what} is larger than {cap} bytes "
                               f"(max_response_bytes); not retried")
        if response.length is not None and response.length > cap:  # the declared Content-Length
            raise too_large
        chunks, size = [], 0
        while chunk := response.read(min(65536, cap + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                raise too_large
        return b"".join(chunks)


def snippet(data: bytes, limit: int = 200) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
