"""The HTTP side: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on aiohttp,
bound to loopback, running on the endpoint's event loop.

A request names its session (``X-Megarl-Session`` header, or the ``megarl_session`` body
field). The run's agents get sessions opened for them; with ``outside`` limits (the endpoint
bound for callers outside the run, ``megarl.rollout.endpoint.bound``) a caller opens its own:
``POST /v1/sessions`` answers its id, ``GET /v1/sessions/{id}`` its recorded turns (token ids,
log-probs, weight version, finish reason), ``DELETE /v1/sessions/{id}`` ends it and answers them;
a request naming no session there is a session of its own, ended with its answer.
A request's its prompt ids are built (``prompts``), checked against the session (``Session.admit``),
generated (``EngineLink.generate``), recorded (``Session.record``) and answered. Any refusal is
an OpenAI error body with its status: 400 malformed or over a limit, 404 an unknown session,
410 a session that has ended, 413 a body over ``max_body_bytes``, 429 too many open sessions,
503 no engine call running (retryable);
with a ``token`` (``rollout.endpoint.token``), 401 a request without ``Authorization: Bearer
<token>``.
A client that disconnects cancels its handler: its turn is aborted and not recorded, and its
session fails (its episode is ``env_error``; later requests are answered 410). A session past its
wall time (``SessionLimits.wall_s``) is answered 400, the turn it was generating aborted, and fails too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
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
from megarl.rollout.endpoint.sessions import (
    SampledTurn,
    Session,
    SessionBook,
    SessionLimits,
    SessionSampling,
    TurnSpec,
)

log = logging.getLogger(__name__)

# (prompt ids, the turn, the session's id: a router keeps a session on one engine)
Generate = Callable[[list[int], TurnSpec, str], Awaitable[SampledTurn]]
MAX_OUTSIDE_SESSIONS = 256  # open at once: a caller that never ends its sessions cannot grow the book forever


class Endpoint:
    def __init__(self, tokenizer: Any, generate: Generate, model_name: str = "megarl-policy",
                 tool_parser: str = "hermes", max_body_bytes: int = 32 * 2**20, token: str = "",
                 outside: tuple[SessionLimits, SessionSampling] | None = None):
        self.book = SessionBook()
        self.token, self.outside = token, outside
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
        if self.outside is not None:
            app.router.add_post("/v1/sessions", self._open_session)
            app.router.add_get("/v1/sessions/{sid}", self._session_record)
            app.router.add_delete("/v1/sessions/{sid}", self._session_record)
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
        deadline = None
        try:
            # the session's wall time left bounds the turn: past it the turn is aborted at the engine
            async with asyncio.timeout(session.wall_left()) as deadline:
                turn = await self.generate(prompt_ids, spec, session.id)
        except TimeoutError:
            session.abandon()
            if deadline is not None and deadline.expired():
                raise session.out_of_time() from None
            raise
        except asyncio.CancelledError:  # the client disconnected (aiohttp cancels its handler): the turn is aborted
            session.abandon()
            session.fail("disconnected", "the client disconnected while its turn generated (the turn was aborted, "
                         "not recorded); the episode is over")
            raise
        except BaseException:
            session.abandon()
            raise
        if session.closed:  # the episode ended while this turn generated: not part of it
            session.abandon()
            raise ApiError(410, f"session {session.id!r} ended while this request generated",
                           code="megarl_session_ended")
        return spec, turn, session.record(prompt_ids, turn)

    @contextlib.contextmanager
    def _session(self, sid: Any) -> Iterator[Session]:
        """The request's session. For an outside caller that names none (a stock client, an
        evaluation harness), a session of this one request, ended once it is answered: its record
        is the answer's ``megarl`` field."""
        if sid is not None or self.outside is None:
            yield self.book.get(sid)
            return
        limits, sampling = self.outside
        session = self.book.open(f"once-{uuid.uuid4().hex}", limits, sampling)
        try:
            yield session
        finally:
            self.book.close(session.id)

    def _extra(self, session: Session, turn: SampledTurn, split: bool, prompt_ids: list[int]) -> dict[str, Any]:
        return {"session": session.id, "turn": len(session.turns) - 1, "weight_version": turn.version,
                "split": split, "prompt_token_ids": prompt_ids, "token_ids": turn.token_ids}

    async def _chat(self, request):
        from aiohttp import web

        body, sid = await self._body(request)
        parsed = parse_chat(body)
        with self._session(sid) as session:
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
        with self._session(sid) as session:
            prompt_ids = self.prompts.completion_prompt(session, parsed)
            spec, turn, split = await self._turn(session, prompt_ids, parsed.params)
            prompt_text = parsed.prompt if isinstance(parsed.prompt, str) else None
            text, finish = self.prompts.completion_reply(session, prompt_text, turn, spec.stop)
        logprobs = self.prompts.logprobs_completion(turn, spec.top_logprobs) if parsed.params.logprobs else None
        return web.json_response(completion_response(self.model_name, text, finish, len(prompt_ids),
                                                     len(turn.token_ids), logprobs,
                                                     self._extra(session, turn, split, prompt_ids)))

    async def _open_session(self, request):
        from aiohttp import web

        if len(self.book.open_sessions) >= MAX_OUTSIDE_SESSIONS:
            raise ApiError(429, f"{MAX_OUTSIDE_SESSIONS} sessions are open: end one (DELETE /v1/sessions/<id>)",
                           code="megarl_too_many_sessions", kind="rate_limit_error")
        limits, sampling = self.outside
        session = self.book.open(f"outside-{uuid.uuid4().hex}", limits, sampling)
        return web.json_response(_session_body(session), status=201)

    async def _session_record(self, request):
        from aiohttp import web

        sid = request.match_info["sid"]
        session = self.book.get(sid)
        if request.method == "DELETE":
            self.book.close(sid)
        return web.json_response(_session_body(session))

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                               "owned_by": "megarl"}]})


def _session_body(session: Session) -> dict[str, Any]:
    """A session as its caller sees it: its limits and every turn served, token-exact."""
    lim = session.limits
    return {"id": session.id, "object": "megarl.session", "ended": session.ended, "splits": session.splits,
            "limits": {"max_turns": lim.max_turns, "max_episode_tokens": lim.max_episode_tokens,
                       "max_turn_tokens": lim.max_turn_tokens, "max_model_len": lim.max_model_len},
            "turns": [{"prompt_token_ids": t.prompt_ids, "token_ids": t.token_ids, "logprobs": t.logprobs,
                       "weight_version": t.version, "finish_reason": t.finish_reason} for t in session.turns]}


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
