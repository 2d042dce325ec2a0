"""Rewards: reasoning-gym and math-verify scoring, the remote client against a loopback
server (retries, timeouts, no retry on 4xx, bounded concurrency), and combinations."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.rewards import (
    MathVerifyReward,
    ReasoningGymReward,
    RemoteReward,
    RemoteRewardError,
    RewardInput,
    resolve_extractor,
)
from megarl.rewards.extract import answer_tag, boxed, last_number


def sample(response: str, **metadata) -> RewardInput:
    return RewardInput(prompt="q", response=response, metadata=metadata)


# ---------------------------------------------------------------- extractors

def test_extractors():
    assert answer_tag("<answer>no</answer> then <answer> 42 \n</answer>") == "42"
    assert answer_tag("<answer>42") is None  # cut off by max_tokens: no answer
    assert answer_tag("<answer>  </answer>") is None
    assert boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert boxed(r"\boxed{\frac{1}{2}") is None
    assert last_number("5 - 3 = 2, so 1,234.5 legs.") == "1234.5"
    assert last_number("it is -4.") == "-4"
    assert last_number("5-3") == "3"
    assert last_number("no digits") is None
    chained = resolve_extractor("answer_tag|last_number")
    assert chained("<answer>7</answer> 8") == "7" and chained("then 8") == "8"
    with pytest.raises(ValueError, match="unknown answer extractor 'nope'"):
        resolve_extractor("answer_tag|nope")


# ---------------------------------------------------------------- reasoning-gym

@pytest.fixture(scope="module")
def arithmetic() -> list[dict]:
    import reasoning_gym

    return list(reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=0))


def _wrong(answer: str) -> str:
    return str(int(answer) + 1)


def test_reasoning_gym_correct_wrong_unparseable(arithmetic):
    reward = ReasoningGymReward("basic_arithmetic")
    correct = [sample(f"Thinking... <answer>{e['answer']}</answer>", entry=e) for e in arithmetic]
    wrong = [sample(f"<answer>{_wrong(e['answer'])}</answer>", entry=e) for e in arithmetic]
    junk = [sample(text, entry=arithmetic[0]) for text in
            ("I do not know", f"<answer>{arithmetic[0]['answer']}", "<answer></answer>")]
    assert reward(correct) == [1.0] * 5
    assert reward(wrong) == [0.0] * 5
    assert reward(junk) == [0.0] * 3


def test_reasoning_gym_routes_by_source_dataset_and_last_number():
    import reasoning_gym

    legs = list(reasoning_gym.create_dataset("leg_counting", size=5, seed=0))
    reward = ReasoningGymReward(None, extractor="last_number")  # scorer from entry.metadata.source_dataset
    scores = reward([sample(f"Adding up, there are {e['answer']} legs.", entry=e) for e in legs]
                    + [sample("There are 3 legs.", entry=legs[0])])
    assert scores == [1.0] * 5 + [0.0]


def test_reasoning_gym_errors_name_the_problem(arithmetic):
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'no_such_task'"):
        ReasoningGymReward("no_such_task")
    with pytest.raises(KeyError, match=r"sample 1 has no metadata\['entry'\]"):
        ReasoningGymReward("basic_arithmetic")([sample("x", entry=arithmetic[0]), sample("x", answer="3")])


# ---------------------------------------------------------------- math-verify

@pytest.mark.parametrize("answer", ["1/2", "0.5", r"\frac{1}{2}", r"\dfrac{1}{2}", "2/4", r"$\frac{1}{2}$"])
def test_math_verify_equivalent_forms(answer):
    reward = MathVerifyReward()
    assert reward([sample(f"<answer>{answer}</answer>", answer="1/2"),
                   sample(f"<answer>{answer}</answer>", answer=r"\frac{1}{2}")]) == [1.0, 1.0]


def test_math_verify_wrong_unparseable_and_extractors():
    reward = MathVerifyReward()
    responses = ["<answer>0.25</answer>", "<answer>banana</answer>", "0.5 (no tags)", ""]
    assert reward([sample(r, answer="0.5") for r in responses]) == [0.0] * 4
    assert MathVerifyReward(extractor="boxed")([sample(r"so \boxed{\frac{1}{2}}", answer="0.5")]) == [1.0]
    with pytest.raises(ValueError, match="cannot parse the reference"):
        reward([sample("<answer>1</answer>", answer="not math at all")])


def test_math_verify_off_the_main_thread():
    # math-verify's own timeout uses SIGALRM, which raises outside the main thread.
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        MathVerifyReward()([sample("<answer>0.5</answer>", answer="1/2")])))
    thread.start()
    thread.join(timeout=10)
    assert result == [[1.0]]


# ---------------------------------------------------------------- remote

class _Server:
    """A loopback reward server whose behaviour each test sets; it records what it saw."""

    def __init__(self, behave: Callable[[_Server, list[dict]], tuple[int, bytes]]) -> None:
        self.behave = behave
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.release = threading.Event()  # wakes slow handlers at teardown
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests += 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, body = server.behave(server, payload["samples"])
                finally:
                    with server.lock:
                        server.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def _lengths(_server: _Server, samples: list[dict]) -> tuple[int, bytes]:
    return 200, json.dumps({"rewards": [float(len(s["response"])) for s in samples]}).encode()


@pytest.fixture
def serve() -> Iterator[Callable[..., _Server]]:
    servers: list[_Server] = []

    def start(behave=_lengths) -> _Server:
        servers.append(_Server(behave))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _samples(n: int) -> list[RewardInput]:
    return [RewardInput(prompt=f"p{i}", response="x" * i, metadata={"answer": str(i), "t": (1, 2)}) for i in range(n)]


def test_remote_answers_in_order_across_batches(serve):
    server = serve()
    reward = RemoteReward(server.url, timeout_s=5, batch_size=3, max_concurrency=2)
    assert reward(_samples(10)) == [float(i) for i in range(10)]
    assert server.requests == 4 and reward.stats.retries == 0
    assert reward([]) == []


@pytest.mark.parametrize("status", [503, 500, 429])
def test_remote_retries_5xx_and_429_then_succeeds(serve, status):
    def flaky(server: _Server, samples: list[dict]) -> tuple[int, bytes]:
        if server.requests <= 2:
            return status, b'{"error": "warming up"}'
        return _lengths(server, samples)

    server = serve(flaky)
    reward = RemoteReward(server.url, timeout_s=5, max_retries=3, backoff_s=0.01)
    assert reward(_samples(4)) == [0.0, 1.0, 2.0, 3.0]
    assert server.requests == 3
    assert reward.stats.requests == 3 and reward.stats.retries == 2


def test_remote_gives_up_naming_url_and_last_failure(serve):
    server = serve(lambda s, samples: (503, b"overloaded"))
    reward = RemoteReward(server.url, timeout_s=5, max_retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"score: samples 0..3 failed after 3 attempts; "
                                                r"last failure: HTTP 503 .*overloaded") as info:
        reward(_samples(4))
    assert server.url in str(info.value)
    assert server.requests == 3 and reward.stats.failures == 1


def test_remote_timeout_is_bounded(serve):
    def slow(server: _Server, samples: list[dict]) -> tuple[int, bytes]:
        server.release.wait(timeout=3)
        return _lengths(server, samples)

    server = serve(slow)
    reward = RemoteReward(server.url, timeout_s=0.2, max_retries=1, backoff_s=0.01)
    begin = time.monotonic()
    with pytest.raises(RemoteRewardError, match="failed after 2 attempts; last failure: timed out after 0.2 s"):
        reward(_samples(2))
    assert time.monotonic() - begin < 1.5  # 2 x 0.2 s timeouts plus a short backoff
    assert server.requests == 2


def test_remote_400_is_not_retried(serve):
    server = serve(lambda s, samples: (400, b'{"error": "metadata.answer missing"}'))
    reward = RemoteReward(server.url, timeout_s=5, max_retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"HTTP 400 .*not retried.*metadata.answer missing"):
        reward(_samples(2))
    assert server.requests == 1


def test_remote_bounded_concurrency(serve):
    def busy(server: _Server, samples: list[dict]) -> tuple[int, bytes]:
        time.sleep(0.05)
        return _lengths(server, samples)

    server = serve(busy)
    reward = RemoteReward(server.url, timeout_s=5, batch_size=1, max_concurrency=3)
    assert reward(_samples(12)) == [float(i) for i in range(12)]
    assert server.requests == 12
    assert 2 <= server.max_in_flight <= 3


def test_remote_rejects_malformed_answers_without_retry(serve):
    answers = iter([b'{"rewards": [1.0]}', b'{"rewards": [1.0, "high"]}', b'{"rewards": [1.0, NaN]}', b"<html>"])
    server = serve(lambda s, samples: (200, next(answers)))
    reward = RemoteReward(server.url, timeout_s=5, max_retries=3, backoff_s=0.01)
    for pattern in ("returned 1 rewards for 2 samples", "reward 1 is 'high'", "reward 1 is nan", "not JSON"):
        with pytest.raises(RemoteRewardError, match=pattern):
            reward(_samples(2))
    assert server.requests == 4


def test_remote_connection_refused_is_retried():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    reward = RemoteReward(f"http://127.0.0.1:{port}/score", timeout_s=1, max_retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=f"127.0.0.1:{port}/score.*3 attempts.*ConnectionRefusedError"):
        reward(_samples(1))
    assert reward.stats.requests == 3


def test_remote_checks_before_sending():
    with pytest.raises(ValueError, match="url must be"):
        RemoteReward("ftp://example/score")
    with pytest.raises(ValueError, match="max_concurrency must be an integer >= 1"):
        RemoteReward("http://127.0.0.1:1/", max_concurrency=0)
    reward = RemoteReward("http://127.0.0.1:1/", max_retries=0)
    with pytest.raises(TypeError, match="sample 1 is not JSON-serialisable"):
        reward([sample("a"), sample("b", answer=object())])
    assert reward.stats.requests == 0


# ---------------------------------------------------------------- combinations

def test_run_reward_weighs_its_terms_and_names_a_bad_one():
    from megarl.config.schema import RewardTermConfig
    from megarl.rewards.combined import RunReward

    reward = RunReward([RewardTermConfig(kind="format", weight=0.2), RewardTermConfig(kind="math_verify")])
    batch = [sample("<answer>1/2</answer>", answer="0.5"), sample("<answer>3</answer>", answer="0.5"),
             sample("0.5", answer="0.5")]
    total, parts = reward.score(batch)
    assert total.tolist() == pytest.approx([1.2, 0.2, 0.0])
    assert parts["reward/format"].tolist() == [1.0, 1.0, 0.0] and parts["reward/math_verify"].tolist() == [1, 0, 0]
    reward.functions[1] = lambda samples: [0.0]
    with pytest.raises(ValueError, match=r"rewards\[1\] \(math_verify\): returned 1 rewards for 3 samples"):
        reward.score(batch)


def test_an_eval_only_term_is_logged_in_training_and_counted_only_in_evaluation():
    from megarl.config.schema import RewardTermConfig
    from megarl.rewards.combined import RunReward

    terms = [RewardTermConfig(kind="format", weight=0.5), RewardTermConfig(kind="math_verify", eval_only=True)]
    batch = [sample("<answer>1/2</answer>", answer="0.5"), sample("<answer>3</answer>", answer="0.5")]
    total, parts = RunReward(terms).score(batch)
    assert total.tolist() == [0.5, 0.5] and parts["reward/math_verify"].tolist() == [1.0, 0.0]
    total, _ = RunReward(terms, evaluation=True).score(batch)
    assert total.tolist() == [1.5, 0.5]


def test_an_environment_leaves_eval_only_terms_out_of_the_training_reward():
    """The environments' answers sum through the run's combiner: an eval_only term stays out of
    the training reward there too (it used to be added: environments had their own sum)."""
    import asyncio

    from megarl.config.schema import EnvConfig, RewardTermConfig
    from megarl.envs.base import EpisodeItem
    from megarl.envs.registry import environment_factory

    terms = [RewardTermConfig(kind="format", weight=0.5), RewardTermConfig(kind="math_verify", eval_only=True)]
    env = environment_factory(EnvConfig(kind="single_turn"), terms)()

    async def episode() -> float:
        await env.reset(EpisodeItem(prompt="q", metadata={"answer": "0.5"}))
        return (await env.step("<answer>1/2</answer>")).reward

    assert asyncio.run(episode()) == 0.5  # format only; math_verify (1.0 here) is eval_only


def test_a_recipes_own_reward_term_by_import_path():
    from megarl.config.schema import RewardTermConfig
    from megarl.rewards.combined import RunReward
    from megarl.rewards.terms import build_term

    batch = [sample("aab"), sample("abcd")]  # 2 and 4 distinct characters
    for kind in ("length_reward:few_distinct_characters", "length_reward:FewDistinctCharacters"):
        total, parts = RunReward([RewardTermConfig(kind=kind, weight=0.5, options={"scale": 3.0})]).score(batch)
        assert total.tolist() == pytest.approx([0.5, 0.3]) and list(parts) == [f"reward/{kind.split(':')[1]}"]
    for kind, options, problem in [("length_reward:nothing", {}, "has no 'nothing'"),
                                   ("no_such_module:f", {}, "cannot import 'no_such_module'"),
                                   ("length_reward:few_distinct_characters", {"sclae": 1}, "options do not fit"),
                                   ("length_reward:FewDistinctCharacters", {"sclae": 1}, "options do not fit")]:
        with pytest.raises(ValueError, match=problem):
            build_term(RewardTermConfig(kind=kind, options=options))
