"""A request's prompt ids, and the engine's turn as an OpenAI reply: the only places the endpoint
turns text into tokens or back.

Where a chat request's messages are the session's conversation so far (its earlier messages and
the reply the endpoint gave, as the client echoes them) followed by new ones, the prompt is the
session's tokens followed by the new messages rendered as an observation (``ChatRenderer``): the
reply is never re-tokenised, so the turn extends the trajectory token-exactly. Other requests
(a first turn, a rewritten history) are rendered whole by the chat template; whether those ids
extend the session's tokens decides whether the session splits (``Session.record``). Completions
work alike on text: a prompt that starts with the session's last prompt and completion appends
the rest's tokens; a prompt of token ids is used as given.

Tools: a template that reads ``tools=`` gets them; for one that does not (SmolLM2's) the tool
list and call format of ``env.tool_parser`` go into the system prompt, as for ``env.kind: tools``.
The reply's calls are read by the same parser into OpenAI ``tool_calls``.
"""

from __future__ import annotations

import json
from typing import Any

from megarl.data.chat import ChatRenderer
from megarl.rollout.endpoint.protocol import ChatRequest, CompletionRequest, bad, canonical
from megarl.rollout.endpoint.sessions import SampledTurn, Session

_TOOL_TAG = "<tool_call>"  # the hermes parser's opening tag: a reply's text before it is its content


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (text content, never None)."""
    return [{**m, "content": m.get("content") or ""} for m in messages]


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first stop string (excluded), and whether one was there."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


class PromptBuilder:
    def __init__(self, tokenizer: Any, tool_parser: str = "hermes"):
        from megarl.envs.tool_parsers.registry import build_parser

        self.tokenizer = tokenizer
        self.parser = build_parser(tool_parser)
        self._renderers: dict[str, ChatRenderer] = {}

    def renderer(self, tools: list[dict[str, Any]]) -> ChatRenderer:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools, self.parser.instructions(tools) if tools else "")
        return self._renderers[key]

    def chat_prompt(self, session: Session, request: ChatRequest) -> list[int]:
        renderer = self.renderer(request.tools)
        history = session.history
        if session.current is not None and history and len(request.messages) > len(history) and \
                [canonical(m) for m in request.messages[:len(history)]] == history:
            new = template_messages(request.messages[len(history):])
            try:
                return session.context + renderer.observation(new, turn_ended=session.turn_ended)
            except ValueError:  # a template that renders earlier messages anew once more follow
                pass  # rendered whole below (the session splits there)
        try:
            return renderer.opening(template_messages(request.messages))
        except Exception as exc:  # the template's own refusal (roles out of order, a missing field)
            raise bad(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                      "messages") from None

    def completion_prompt(self, session: Session, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list):
            if max(prompt) >= len(self.tokenizer):
                raise bad(f"prompt has token id {max(prompt)}; the vocabulary has {len(self.tokenizer)}", "prompt")
            return list(prompt)
        if session.current is not None and session.text is not None and prompt.startswith(session.text):
            return session.context + self._encode(prompt[len(session.text):], special=False)
        return self._encode(prompt, special=True)

    def _encode(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"]) if text else []

    def reply_text(self, turn: SampledTurn, stops: tuple[str, ...]) -> tuple[str, str]:
        """The turn as text (cut at a stop string) and its OpenAI finish reason."""
        text, stopped = cut_at_stop(self.tokenizer.decode(turn.token_ids, skip_special_tokens=True), stops)
        return text, "stop" if stopped or turn.stopped else turn.finish_reason

    def chat_reply(self, session: Session, request: ChatRequest, turn: SampledTurn,
                   stops: tuple[str, ...]) -> tuple[dict[str, Any], str]:
        """The reply message and finish reason; the session remembers the conversation it ends."""
        text, finish = self.reply_text(turn, stops)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if request.tools:
            parsed = self.parser.parse(text)
            if parsed.calls and not parsed.errors:
                cut = text.find(_TOOL_TAG)
                message["content"] = (text[:cut] if cut >= 0 else text).strip() or None
                turn_no = len(session.turns)
                message["tool_calls"] = [
                    {"id": f"call_{turn_no}_{i}", "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                    for i, c in enumerate(parsed.calls)]
                finish = "tool_calls"
        echoed = {**message, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in message.get("tool_calls", [])]}
        session.history = [canonical(m) for m in request.messages] + [canonical(echoed)]
        session.text = None
        return message, finish

    def completion_reply(self, session: Session, prompt_text: str | None, turn: SampledTurn,
                         stops: tuple[str, ...]) -> tuple[str, str]:
        text, finish = self.reply_text(turn, stops)
        session.text = None if prompt_text is None else prompt_text + text
        session.history = []
        return text, finish

    def logprobs_content(self, turn: SampledTurn, top: int) -> list[dict[str, Any]]:
        """OpenAI chat ``logprobs.content``: each sampled token, its log-prob and the top ones."""
        out = []
        tops = turn.top_logprobs or [{}] * len(turn.token_ids)
        for token, logprob, alternatives in zip(turn.token_ids, turn.logprobs, tops, strict=True):
            best = sorted(alternatives.items(), key=lambda kv: -kv[1])[:top]
            out.append({**self._token(token), "logprob": logprob,
                        "top_logprobs": [{**self._token(t), "logprob": lp} for t, lp in best]})
        return out

    def logprobs_completion(self, turn: SampledTurn, top: int) -> dict[str, Any]:
        """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
        content = self.logprobs_content(turn, top)
        offsets, at = [], 0
        for c in content:
            offsets.append(at)
            at += len(c["token"])
        return {"tokens": [c["token"] for c in content], "token_logprobs": [c["logprob"] for c in content],
                "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content] if top
                else None, "text_offset": offsets}

    def _token(self, token: int) -> dict[str, Any]:
        text = self.tokenizer.decode([token])
        return {"token": text, "bytes": list(text.encode("utf-8"))}
