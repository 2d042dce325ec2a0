"""The remote environment (``megarl.envs.remote``) against a local HTTP service: the protocol of
a whole episode, bounded concurrency, retries, timeouts and answers outside the protocol. The
same service drives real episodes on the engine in ``test_episodes.py``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.envs.base import EpisodeItem, Message
from megarl.envs.remote import RemoteEnvironmentError, RemoteEnvironmentService


class QuizService:
    """An environment service: the user asks the item's question, the first answer is met with
    "Are you sure?", the second is scored against ``metadata.answer`` (1 if it contains it).
    ``fault(path, body, calls)`` may return a (status, body) to send instead."""

    def __init__(self, fault: Callable[[str, dict, int], tuple[int, bytes] | None] | None = None,
                 delay_s: float = 0.0) -> None:
        self.fault, self.delay_s = fault, delay_s
        self.episodes: dict[str, dict] = {}
        self.calls: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.release = threading.Event()  # wakes hanging handlers at teardown
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.calls.append((self.path, body))
                    service.in_flight += 1
                    service.max_in_flight = max(service.max_in_flight, service.in_flight)
                    count = len(service.calls)
                try:
                    if service.delay_s:
                        time.sleep(service.delay_s)
                    status, data = (service.fault and service.fault(self.path, body, count)) or service.answer(
                        self.path, body)
                finally:
                    with service.lock:
                        service.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/quiz"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def answer(self, path: str, body: dict) -> tuple[int, bytes]:
        episode_id = body["episode_id"]
        if path == "/quiz/reset":
            with self.lock:
                self.episodes[episode_id] = {"answer": str(body["metadata"]["answer"]), "turns": 0, "closed": False}
            messages = [{"role": "system", "content": "Answer with a number only."}, *body["context"],
                        {"role": "user", "content": body["prompt"]}]
            return 200, json.dumps({"messages": messages}).encode()
        episode = self.episodes.get(episode_id)
        if episode is None:
            return 404, b'{"error": "unknown episode"}'
        if path == "/quiz/close":
            episode["closed"] = True
            return 200, b"{}"
        episode["turns"] += 1
        if episode["turns"] == 1:
            return 200, json.dumps({"messages": [{"role": "user", "content": "Are you sure?"}], "reward": 0.0,
                                    "done": False, "info": {"tool_calls": 0}}).encode()
        reward = float(episode["answer"] in body["action"])
        return 200, json.dumps({"messages": [], "reward": reward, "done": True}).encode()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def serve() -> Iterator[Callable[..., QuizService]]:
    services: list[QuizService] = []

    def start(**kwargs) -> QuizService:
        services.append(QuizService(**kwargs))
        return services[-1]

    yield start
    for service in services:
        service.close()


def _item(answer: int = 7) -> EpisodeItem:
    return EpisodeItem("What is 3 + 4?", {"answer": answer}, context=(Message("user", "Hi"),))


async def _episode(env, actions: list[str]) -> tuple[list[Message], list]:
    opening = await env.reset(_item())
    results = [await env.step(action) for action in actions]
    await env.close()
    return opening, results


def test_a_whole_episode_follows_the_protocol(serve):
    service = serve()
    env = RemoteEnvironmentService(service.url, timeout_s=5).episode()
    opening, (first, second) = asyncio.run(_episode(env, ["8", "It is 7."]))
    assert [m.role for m in opening] == ["system", "user", "user"] and opening[-1].content == "What is 3 + 4?"
    assert first.observation == [Message("user", "Are you sure?")] and not first.done and first.reward == 0.0
    assert first.info["tool_calls"] == 0.0 and first.info["env_seconds"] >= 0.0
    assert second.done and second.reward == 1.0 and second.observation == []
    paths = [path for path, _ in service.calls]
    assert paths == ["/quiz/reset", "/quiz/step", "/quiz/step", "/quiz/close"]
    assert {body["episode_id"] for _, body in service.calls} == {env.episode_id}
    assert service.calls[0][1]["context"] == [{"role": "user", "content": "Hi"}]
    assert service.calls[2][1]["action"] == "It is 7." and service.episodes[env.episode_id]["closed"]


def test_requests_in_flight_are_bounded_across_episodes(serve):
    service = serve(delay_s=0.05)
    shared = RemoteEnvironmentService(service.url, timeout_s=5, max_concurrency=3)

    async def many() -> list:
        return await asyncio.gather(*(_episode(shared.episode(), ["1", "7"]) for _ in range(12)))

    results = asyncio.run(many())
    assert all(steps[-1].reward == 1.0 for _, steps in results)
    assert len(service.episodes) == 12  # every episode its own id
    assert 2 <= service.max_in_flight <= 3


def test_a_503_is_retried_and_a_400_is_not(serve):
    service = serve(fault=lambda path, body, n: (503, b"busy") if path.endswith("/step") and n == 2 else None)
    env = RemoteEnvironmentService(service.url, timeout_s=5, max_retries=2, backoff_s=0.01).episode()
    _, (first, _) = asyncio.run(_episode(env, ["8", "7"]))
    assert first.observation and [p for p, _ in service.calls].count("/quiz/step") == 3  # 503, then 2 answers

    service = serve(fault=lambda path, body, n: (400, b'{"error": "bad action"}') if path.endswith("/step") else None)
    env = RemoteEnvironmentService(service.url, timeout_s=5, max_retries=3, backoff_s=0.01).episode()
    with pytest.raises(RemoteEnvironmentError, match=r"quiz/step: HTTP 400 .*not retried.*bad action"):
        asyncio.run(_episode(env, ["8"]))
    assert [p for p, _ in service.calls].count("/quiz/step") == 1


def test_a_hanging_service_times_out(serve):
    service = serve(fault=lambda path, body, n: service.release.wait(3) and None if path.endswith("/step") else None)
    env = RemoteEnvironmentService(service.url, timeout_s=0.2, max_retries=1, backoff_s=0.01).episode()
    begin = time.monotonic()
    with pytest.raises(RemoteEnvironmentError, match="step of episode .* failed after 2 attempts; last failure: "
                                                     "timed out after 0.2 s"):
        asyncio.run(_episode(env, ["8"]))
    assert time.monotonic() - begin < 2.0


@pytest.mark.parametrize("answer,field", [
    ({"messages": [], "reward": "high", "done": True}, "'reward' must be a finite number"),
    ({"messages": [], "reward": 1.0}, "'done' must be true or false"),
    ({"messages": [{"role": "robot", "content": "x"}], "reward": 0, "done": False}, r"messages\[0\] must have a role"),
    ({"messages": [], "reward": 0, "done": False, "info": {"calls": "many"}}, "'info' must map names"),
    ([1, 2], "must be an object with a 'messages' list"),
])
def test_answers_outside_the_protocol_name_the_field(serve, answer, field):
    service = serve(fault=lambda path, body, n: (200, json.dumps(answer).encode()) if path.endswith("/step") else None)
    env = RemoteEnvironmentService(service.url, timeout_s=5, max_retries=3).episode()
    with pytest.raises(RemoteEnvironmentError, match=field):
        asyncio.run(_episode(env, ["8"]))
    assert [p for p, _ in service.calls].count("/quiz/step") == 1  # the server is wrong: no retry


def test_bad_settings_are_refused_before_any_request():
    with pytest.raises(ValueError, match="url must be"):
        RemoteEnvironmentService("ftp://host/env")
    with pytest.raises(ValueError, match="max_concurrency must be an integer >= 1"):
        RemoteEnvironmentService("http://127.0.0.1:1/env", max_concurrency=0)
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        RemoteEnvironmentService("http://127.0.0.1:1/env", timeout_s=0)
