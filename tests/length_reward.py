"""A remote reward for runs of random tiny models (the trainer tests, containers/gpu's GRPO runs):
varied, deterministic scores that favour responses with few distinct characters, served over
HTTP on the loopback, so the policy moves from its first step."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LengthReward(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rewards = [1.0 / (1 + len(set(s["response"]))) for s in body["samples"]]
        data = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def serve() -> tuple[str, ThreadingHTTPServer]:
    """Starts the server on a free port in a daemon thread: (its scoring URL, the server to shut down)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), LengthReward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/score", server


def few_distinct_characters(samples: list, scale: float = 1.0) -> list[float]:
    """The same score in process: a recipe's own reward term (``kind: length_reward:few_distinct_characters``)."""
    return [scale / (1 + len(set(s.response))) for s in samples]


class FewDistinctCharacters:
    """The class form of a recipe's own reward term: made once with the term's options."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, samples: list) -> list[float]:
        return few_distinct_characters(samples, self.scale)
