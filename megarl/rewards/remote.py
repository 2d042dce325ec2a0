"""A reward computed by an HTTP service, with retries and bounded concurrency.

Protocol: ``POST url`` with ``{"samples": [{"prompt", "response", "metadata"}, ...]}``
and ``Content-Type: application/json``; the answer is ``{"rewards": [float, ...]}``,
one finite number per sample, in order.

Retry policy (why: reward services are shared and flaky, but a request they
reject will be rejected again):

- retried: connection failures (refused, reset, closed early), timeouts, HTTP 5xx,
  and HTTP 429 (the server asks us to come back later);
- not retried: other 4xx (the request is wrong) and a 200 whose body breaks the
  protocol (the server is wrong) - both raise at once;
- attempt ``k`` (from 1) that fails waits ``min(backoff_s * 2**(k-1), max_backoff_s)``
  before the next one; after ``1 + max_retries`` attempts the error names the URL
  and the last failure.

``timeout_s`` bounds each attempt as a whole (connect, send, headers and body): a
watchdog shuts the socket at the deadline, so a server that trickles its answer a byte
at a time cannot hold a call past it, and a server that never answers costs at most
``(1 + max_retries) * timeout_s`` plus the backoff sleeps. An answer larger than
``max_response_bytes`` is refused (not retried) without reading the rest. Standard
library only; environment proxies are not used (reward services are internal
endpoints, and a stray ``http_proxy`` must not reroute them).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from megarl.rewards.base import RewardInput, check_rewards

DEFAULT_MAX_RESPONSE_BYTES = 8 * 2**20  # an answer is ~20 bytes per sample; this is a server gone wrong


def url_problem(url: object) -> str | None:
    """What makes ``url`` unusable as a reward endpoint, or None (checked at config time too)."""
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


class RemoteRewardError(RuntimeError):
    """The remote reward failed for good (retries exhausted, 4xx, or a malformed answer)."""


class _Retryable(Exception):
    """A failure worth another attempt; the message describes it for the final error."""


@dataclass
class RemoteRewardStats:
    requests: int = 0  # HTTP attempts made, retries included
    retries: int = 0  # attempts after the first, per batch, summed
    failures: int = 0  # batches that gave up


class RemoteReward:
    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_concurrency: int = 4, batch_size: int = 64, max_backoff_s: float = 30.0,
                 headers: dict[str, str] | None = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        problem = url_problem(url)
        if problem:
            raise ValueError(f"RemoteReward: url {problem}, got {url!r}")
        parts = urllib.parse.urlsplit(url)
        if not isinstance(timeout_s, int | float) or not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"RemoteReward: timeout_s must be a positive number, got {timeout_s!r}")
        for name, value in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s)):
            if not isinstance(value, int | float) or not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"RemoteReward: {name} must be a non-negative number, got {value!r}")
        for name, value, minimum in (("max_retries", max_retries, 0), ("max_concurrency", max_concurrency, 1),
                                     ("batch_size", batch_size, 1), ("max_response_bytes", max_response_bytes, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"RemoteReward: {name} must be an integer >= {minimum}, got {value!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self.max_response_bytes = max_response_bytes
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.stats = RemoteRewardStats()
        self._stats_lock = threading.Lock()

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        if not samples:
            return []
        # Serialise everything first: a sample that is not JSON fails before any request.
        bodies = [self._encode(samples, start) for start in range(0, len(samples), self.batch_size)]
        if len(bodies) == 1 or self.max_concurrency == 1:
            results = [self._post_with_retries(body, count, start) for body, count, start in bodies]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies)),
                                    thread_name_prefix="remote-reward") as pool:
                futures = [pool.submit(self._post_with_retries, *body) for body in bodies]
                try:
                    results = [future.result() for future in futures]
                except BaseException:
                    # One batch failed for good: the step cannot complete, so send no more.
                    for future in futures:
                        future.cancel()
                    raise
        return [reward for batch in results for reward in batch]

    def _encode(self, samples: list[RewardInput], start: int) -> tuple[bytes, int, int]:
        chunk = samples[start:start + self.batch_size]
        payload = []
        for offset, sample in enumerate(chunk):
            item = {"prompt": sample.prompt, "response": sample.response, "metadata": sample.metadata}
            try:
                json.dumps(item, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"RemoteReward {self.url}: sample {start + offset} is not JSON-serialisable: "
                                f"{exc}") from exc
            payload.append(item)
        body = json.dumps({"samples": payload}, allow_nan=False).encode()
        return body, len(chunk), start

    def _post_with_retries(self, body: bytes, count: int, start: int) -> list[float]:
        attempts = 1 + self.max_retries
        last = "no attempt made"
        for attempt in range(1, attempts + 1):
            with self._stats_lock:
                self.stats.requests += 1
                self.stats.retries += attempt > 1
            try:
                return self._post_once(body, count, start)
            except _Retryable as exc:
                last = str(exc)
            if attempt < attempts:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
        with self._stats_lock:
            self.stats.failures += 1
        raise RemoteRewardError(f"remote reward {self.url}: samples {start}..{start + count - 1} failed after "
                                f"{attempts} attempts; last failure: {last}")

    def _post_once(self, body: bytes, count: int, start: int) -> list[float]:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        # The socket timeout bounds each read, not the attempt: a peer that sends a byte just
        # inside it keeps the call alive for ever. The watchdog shuts the socket at the deadline.
        conn = cls(self._host, self._port, timeout=self.timeout_s)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read with EOF or an error
                except OSError:
                    pass

        watchdog = threading.Timer(self.timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        timed_out = _Retryable(f"timed out after {self.timeout_s:g} s")
        try:
            try:
                conn.connect()
                if expired.is_set():  # the deadline passed while connecting, before there was a socket to shut
                    raise timed_out
                conn.request("POST", self._path, body=body, headers=self.headers)
                response = conn.getresponse()
                data = self._read_capped(response, count, start)
            except TimeoutError as exc:
                raise _Retryable(f"timed out after {self.timeout_s:g} s ({exc})") from exc
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
            raise _Retryable(f"HTTP {status} {response.reason}: {_snippet(data)}")
        if status != 200:
            raise RemoteRewardError(f"remote reward {self.url}: HTTP {status} {response.reason} for samples "
                                    f"{start}..{start + count - 1} (not retried): {_snippet(data)}")
        return self._decode(data, count, start)

    def _read_capped(self, response: http.client.HTTPResponse, count: int, start: int) -> bytes:
        """The body, refusing one longer than max_response_bytes before reading past the limit."""
        cap = self.max_response_bytes
        too_large = RemoteRewardError(f"remote reward {self.url}: the answer for samples {start}..{start + count - 1} "
                                      f"is larger than {cap} bytes (max_response_bytes); not retried")
        if response.length is not None and response.length > cap:  # the declared Content-Length
            raise too_large
        chunks, size = [], 0
        while chunk := response.read(min(65536, cap + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                raise too_large
        return b"".join(chunks)

    def _decode(self, data: bytes, count: int, start: int) -> list[float]:
        where = f"remote reward {self.url} (samples {start}..{start + count - 1})"
        try:
            answer: Any = json.loads(data)
        except RecursionError:
            raise RemoteRewardError(f"{where}: response nests too deeply to be rewards") from None
        except ValueError as exc:
            raise RemoteRewardError(f"{where}: response is not JSON ({exc}): {_snippet(data)}") from exc
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RemoteRewardError(f"{where}: response must be an object with 'rewards', got {_snippet(data)}")
        try:
            return check_rewards(answer["rewards"], count, where)
        except (TypeError, ValueError) as exc:
            raise RemoteRewardError(str(exc)) from exc


def _snippet(data: bytes, limit: int = 200) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
