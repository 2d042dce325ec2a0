"""The endpoint's tool calls and stop strings without an engine: a reply's calls come back as
OpenAI ``tool_calls``, the echoed call and the tool's answer extend the trajectory token-exactly;
the vLLM backend ends a request at the token that completes a stop string."""

from __future__ import annotations

from types import SimpleNamespace

from test_endpoint import ScriptedBackend, host, run_agent, tokenizer  # noqa: F401 - the fixtures too

from megarl.envs.base import EpisodeItem

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
SEEN: dict[str, object] = {}


async def _calls_a_tool(client, item):
    messages = [{"role": "user", "content": item.prompt}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    SEEN["first"] = (first.choices[0].finish_reason, call.function.name, call.function.arguments,
                     first.choices[0].message.content)
    messages += [first.choices[0].message,  # the client's own message object, echoed as agents do
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, logprobs=True,
                                                  top_logprobs=2)
    SEEN["logprobs"] = second.choices[0].logprobs.content
    return 1.0


def test_tool_calls_go_out_as_tool_calls_and_come_back_as_one_trajectory(host, tokenizer):  # noqa: F811
    backend = ScriptedBackend(tokenizer(CALL)["input_ids"], tokenizer.eos_token_id)
    (t,), backend = run_agent(host, tokenizer, _calls_a_tool, [EpisodeItem("What is 6 * 7?")], backend=backend)
    assert SEEN["first"] == ("tool_calls", "calculator", '{"expression": "6 * 7"}', None)
    assert t.finish_reason == "done" and t.info["history_splits"] == 0.0 and len(t.turns) == 2
    # SmolLM2's template has no tools: the hermes instructions are in the system prompt
    assert "calculator" in tokenizer.decode(t.prompt_ids) and "<tool_call>" in tokenizer.decode(t.prompt_ids)
    assert tokenizer.decode(t.observations[0]) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert t.turns[0] == backend.sampled[min(backend.sampled, key=lambda r: int(r.rsplit("-", 1)[1]))]
    content = SEEN["logprobs"]
    assert len(content) == len(t.turns[1]) and all(c.logprob < 0 for c in content)
    assert "".join(c.token for c in content[:-1]) == tokenizer.decode(t.turns[1], skip_special_tokens=True)


class _FakeEngine:
    """vLLM's engine as VLLMRequests reads it: each step gives every open request its next token."""

    def __init__(self, script: dict[str, list[int]]):
        self.script, self.at, self.aborted = script, dict.fromkeys(script, 0), []

    def step(self):
        outputs = []
        for rid in list(self.at):
            token = self.script[rid][self.at[rid]]
            self.at[rid] += 1
            finished = self.at[rid] == len(self.script[rid])
            if finished:
                del self.at[rid]
            logprobs = [{token: SimpleNamespace(logprob=-0.25), 7: SimpleNamespace(logprob=-3.0)}]
            completion = SimpleNamespace(token_ids=[token], logprobs=logprobs,
                                         finish_reason="stop" if finished else None)
            outputs.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=finished))
        return outputs

    def abort_request(self, ids):
        self.aborted += ids
        for rid in ids:
            self.at.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.at)


def test_a_stop_string_ends_the_request_at_the_token_that_completes_it(tokenizer):  # noqa: F811
    from megarl.rollout.endpoint.prompts import cut_at_stop
    from megarl.rollout.endpoint.vllm_requests import VLLMRequests, _Open

    words = tokenizer("Answer: 42. END of it all", add_special_tokens=False)["input_ids"]
    engine = _FakeEngine({"a": words + [2], "b": words + [2]})
    requests = VLLMRequests(SimpleNamespace(llm_engine=engine), tokenizer, [2])
    requests._open = {"a": _Open(("END",), top=True), "b": _Open((), top=False)}
    done = {}
    while requests.has_unfinished():
        done |= dict(requests.step())
    cut, whole = done["a"], done["b"]
    assert engine.aborted == ["a"] and whole.token_ids == words + [2] and whole.stopped
    text = tokenizer.decode(cut.token_ids)
    assert "END" in text and "END" not in tokenizer.decode(cut.token_ids[:-1])  # ends at the completing token
    assert cut.finish_reason == "stop" and not cut.stopped  # no end-of-turn token: the next turn closes it
    assert len(cut.logprobs) == len(cut.top_logprobs) == len(cut.token_ids) and whole.top_logprobs is None
    assert cut_at_stop(text, ("END",)) == ("Answer: 42. ", True)
