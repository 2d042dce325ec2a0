"""The HTTP side: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on aiohttp,
bound to loopback, running on the endpoint's event loop.

A request names its session (``X-Megarl-Session`` header, or the ``megarl_session`` body
field); its prompt ids are built (``prompts``), checked against the session (``Session.admit``),
generated (``EngineLink.generate``), recorded (``Session.record``) and answered. Any refusal is
an OpenAI error body with its status: 400 malformed or over a limit, 404 an unknown session,
410 a session that has ended, 413 a body over ``max_body_bytes``, 503 no engine call running;
with a ``token`` (``rollout.endpoint.token``), 401 a request without ``Authorization: Bearer
<token>``.
A client that disconnects cancels its handler: its turn is aborted and not recorded.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from megarl.rollout.endpoint.prompts import PromptBuilder
from megarl.rollout.endpoint.protocol import (
    SESSION_HEADER,
    ApiError,
    bad,
    chat_response,
    completion_response,
    parse_chat,
    parse_completion,
)
from megarl.rollout.endpoint.sessions import SampledTurn, Session, SessionBook, TurnSpec

log = logging.getLogger(__name__)

Generate = Callable[[list[int], TurnSpec], Awaitable[SampledTurn]]


class Endpoint:
    def __init__(self, tokenizer: Any, generate: Generate, model_name: str = "megarl-policy",
                 tool_parser: str = "hermes", max_body_bytes: int = 32 * 2**20, token: str = ""):
        self.book = SessionBook()
        self.token = token
        self.prompts = PromptBuilder(tokenizer, tool_parser)
        self.generate, self.model_name, self.max_body_bytes = generate, model_name, max_body_bytes
        self.url = ""
        self._runner = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serves on ``host:port`` (0: a free port); returns the base URL (``.../v1`` is the API)."""
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[web.middleware(_errors_as_json), web.middleware(_bearer(self.token))])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _body(self, request) -> tuple[Any, Session]:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad(f"the body is not JSON: {exc}") from None
        sid = request.headers.get(SESSION_HEADER) or (body.get("megarl_session") if isinstance(body, dict) else None)
        return body, sid

    async def _turn(self, session: Session, prompt_ids: list[int], params) -> tuple[TurnSpec, SampledTurn, bool]:
        spec = session.admit(prompt_ids, params)
        try:
            turn = await self.generate(prompt_ids, spec)
        except BaseException:
            session.abandon()
            raise
        if session.closed:  # the episode ended while this turn generated: not part of it
            session.abandon()
            raise ApiError(410, f"session {session.id!r} ended while this request generated",
                           code="megarl_session_ended")
        return spec, turn, session.record(prompt_ids, turn)

    def _extra(self, session: Session, turn: SampledTurn, split: bool, prompt_ids: list[int]) -> dict[str, Any]:
        return {"session": session.id, "turn": len(session.turns) - 1, "weight_version": turn.version,
                "split": split, "prompt_token_ids": prompt_ids, "token_ids": turn.token_ids}

    async def _chat(self, request):
        from aiohttp import web

        body, sid = await self._body(request)
        parsed = parse_chat(body)
        session = self.book.get(sid)
        prompt_ids = self.prompts.chat_prompt(session, parsed)
        spec, turn, split = await self._turn(session, prompt_ids, parsed.params)
        message, finish = self.prompts.chat_reply(session, parsed, turn, spec.stop)
        logprobs = self.prompts.logprobs_content(turn, spec.top_logprobs) if parsed.params.logprobs else None
        return web.json_response(chat_response(self.model_name, message, finish, len(prompt_ids), len(turn.token_ids),
                                               logprobs, self._extra(session, turn, split, prompt_ids)))

    async def _completion(self, request):
        from aiohttp import web

        body, sid = await self._body(request)
        parsed = parse_completion(body)
        session = self.book.get(sid)
        prompt_ids = self.prompts.completion_prompt(session, parsed)
        spec, turn, split = await self._turn(session, prompt_ids, parsed.params)
        prompt_text = parsed.prompt if isinstance(parsed.prompt, str) else None
        text, finish = self.prompts.completion_reply(session, prompt_text, turn, spec.stop)
        logprobs = self.prompts.logprobs_completion(turn, spec.top_logprobs) if parsed.params.logprobs else None
        return web.json_response(completion_response(self.model_name, text, finish, len(prompt_ids),
                                                     len(turn.token_ids), logprobs,
                                                     self._extra(session, turn, split, prompt_ids)))

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                               "owned_by": "megarl"}]})


def _error(error: ApiError):
    from aiohttp import web

    return web.json_response(error.body(), status=error.status)


def _bearer(token: str):
    """The middleware that answers 401 to a request without ``Authorization: Bearer <token>``
    (none: every request passes)."""
    expected = f"Bearer {token}".encode()

    async def authorized(request, handler):
        # compared in constant time: a caller must not learn the token a character at a time
        if token and not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer <rollout.endpoint.token>)",
                           kind="authentication_error", code="invalid_api_key")
        return await handler(request)

    return authorized


async def _errors_as_json(request, handler):
    from aiohttp import web

    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(ApiError(413, f"the body is over the endpoint's limit: {exc.text}"))
    except web.HTTPException as exc:
        return _error(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}"))
    except Exception as exc:  # a bug here: the client hears what, the engine's log has the traceback
        log.exception("rollout endpoint: %s %s failed", request.method, request.path)
        return _error(ApiError(500, f"the endpoint failed: {type(exc).__name__}: {exc}", kind="server_error"))
