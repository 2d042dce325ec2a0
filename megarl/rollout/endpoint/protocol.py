"""The OpenAI wire format the endpoint speaks: requests read and checked, answers and errors written.

Pure functions over JSON-shaped dicts (no engine, no server). What is read: ``messages`` (text
content, or a list of text parts; assistant ``tool_calls``, tool ``tool_call_id``), ``tools``,
``n`` (1 only), ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``
(a string or up to 4), ``logprobs`` / ``top_logprobs`` (chat) or ``logprobs`` as a count
(completions), ``seed``; ``stream`` and ``echo`` are refused. Every refusal is an ``ApiError``
whose body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``, so the ``openai``
client raises its usual exception with the message.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

SESSION_HEADER = "X-Megarl-Session"
SESSION_FIELD = "megarl_session"  # the same, as a body field (``extra_body``)
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """A request the endpoint refuses; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class TurnParams:
    """One request's sampling settings (None: the session's)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False  # return the sampled tokens' log-probs (they are recorded either way)
    top_logprobs: int = 0


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # checked; content as text (None where an assistant only calls tools)
    tools: list[dict[str, Any]] = field(default_factory=list)
    params: TurnParams = TurnParams()
    session: str | None = None  # the body's megarl_session


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    params: TurnParams = TurnParams()
    session: str | None = None


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
            not low <= value <= high:
        raise bad(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad(f"{name} must be an integer >= {low}, got {value!r}", name)
    return value


def _common(body: Any, what: str) -> tuple[TurnParams, str | None]:
    if not isinstance(body, dict):
        raise bad(f"the body of {what} must be a JSON object")
    if body.get("stream"):
        raise bad("stream is not supported: ask without stream", "stream")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise bad(f"n must be 1 (one sample per request; ask again for more), got {n!r}", "n")
    if "model" in body and not isinstance(body["model"], str):
        raise bad("model must be a string (any name: the run's policy answers)", "model")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP}, got {stop!r}", "stop")
    session = body.get(SESSION_FIELD)
    if session is not None and not isinstance(session, str):
        raise bad(f"{SESSION_FIELD} must be a string", SESSION_FIELD)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    seed = _integer(body, "seed", -(2**63))
    params = TurnParams(max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 2.0),
                        top_p=_number(body, "top_p", 0.0, 1.0), seed=seed, stop=tuple(stops))
    return params, session


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise bad(f"{where}.content: only text parts are supported", where)
        return "".join(p["text"] for p in content)
    raise bad(f"{where}.content must be text or a list of text parts", where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}.tool_calls[{j}] must have function.name", where)
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise bad(f"{where}.tool_calls[{j}].function.arguments is not JSON", where) from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def read_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked messages, normalised: text content, tool-call arguments as objects (what chat
    templates read), only the fields a template uses."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES:
            raise bad(f"{where} must be an object with a role ({', '.join(MESSAGE_ROLES)})", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        message: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if m.get("tool_calls") and role == "assistant":
            message["tool_calls"] = _tool_calls(m["tool_calls"], where)
        elif message["content"] is None:
            raise bad(f"{where} has no content", "messages")
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def canonical(message: dict[str, Any]) -> tuple:
    """What two messages must share to be the same turn of a conversation (an echoed reply may
    carry extra null fields, ids, or arguments as text)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls", ()))
    return message["role"], message.get("content") or "", message.get("name"), calls


def parse_chat(body: Any) -> ChatRequest:
    params, session = _common(body, "/v1/chat/completions")
    messages = read_messages(body.get("messages"))
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise bad("tools must be a list of {type: function, function: {name, description, parameters}}", "tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("tool_choice must be auto or none (the policy chooses)", "tool_choice")
    if body.get("tool_choice") == "none":
        tools = []
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad("logprobs must be true or false", "logprobs")
    top = _integer(body, "top_logprobs", 0) or 0
    if top > MAX_TOP_LOGPROBS or (top and not logprobs):
        raise bad(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, and needs logprobs: true", "top_logprobs")
    params = replace(params, logprobs=logprobs, top_logprobs=top)
    return ChatRequest(messages, tools, params, session)


def parse_completion(body: Any) -> CompletionRequest:
    params, session = _common(body, "/v1/completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in prompt)):
        raise bad("prompt must be one non-empty string or one list of token ids", "prompt")
    if body.get("echo"):
        raise bad("echo is not supported", "echo")
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix")
    count = _integer(body, "logprobs", 0)
    if count is not None and count > MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be at most {MAX_TOP_LOGPROBS}", "logprobs")
    params = replace(params, logprobs=count is not None, top_logprobs=count or 0)
    return CompletionRequest(prompt, params, session)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(model: str, message: dict[str, Any], finish_reason: str, prompt_tokens: int,
                  completion_tokens: int, logprobs: list[dict] | None, extra: dict[str, Any]) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": finish_reason,
              "logprobs": None if logprobs is None else {"content": logprobs}}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens), "megarl": extra}


def completion_response(model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        logprobs: dict | None, extra: dict[str, Any]) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens), "megarl": extra}
