"""vLLM's engine as the endpoint's ``RequestBackend``: each request with its own sampling
settings, added and stepped like the episode runner's turns (``VLLMTurns``), so the turns of
every session batch together.

The engine has no tokenizer (megarl passes token ids), so stop strings are checked here after each
step, on the text of the request's tokens: the request ends at the token that completes one (that
token is kept: it was sampled; the reply's text is cut before the stop string)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.endpoint.sessions import SampledTurn, TurnSpec


@dataclass
class _Open:
    stops: tuple[str, ...]
    top: bool
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)


class VLLMRequests:
    def __init__(self, llm: Any, tokenizer: Any, stop_token_ids: list[int],
                 on_sampled: Callable[[int], None] | None = None):
        self.engine = llm.llm_engine
        self.tokenizer, self.stop_token_ids, self.on_sampled = tokenizer, list(stop_token_ids), on_sampled
        self._open: dict[str, _Open] = {}

    def add(self, request_id: str, prompt_ids: list[int], spec: TurnSpec) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                max_tokens=spec.max_tokens, stop_token_ids=self.stop_token_ids, seed=spec.seed,
                                logprobs=spec.top_logprobs, detokenize=False, output_kind=RequestOutputKind.DELTA)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params)
        self._open[request_id] = _Open(spec.stop, spec.top_logprobs > 0)

    def step(self) -> list[tuple[str, SampledTurn]]:
        finished = []
        for output in self.engine.step():
            request = self._open.get(output.request_id)
            if request is None:  # aborted meanwhile
                continue
            completion = output.outputs[0]
            new = list(completion.token_ids)
            before = len(request.ids)
            request.ids += new
            for step, token in zip(completion.logprobs, new, strict=True):
                request.logprobs.append(step[token].logprob)
                if request.top:
                    request.tops.append({t: lp.logprob for t, lp in step.items()})
            if self.on_sampled is not None:
                self.on_sampled(len(new))
            cut = self._stop_string_end(request, before) if request.stops and new else None
            if cut is not None and not output.finished:
                self.engine.abort_request([output.request_id])
            if cut is None and not output.finished:
                continue
            del self._open[output.request_id]
            if cut is not None:
                del request.ids[cut:], request.logprobs[cut:], request.tops[cut:]
            stopped = cut is None and completion.finish_reason == "stop"
            reason = "stop" if stopped or cut is not None else "length"
            finished.append((output.request_id, SampledTurn(request.ids, request.logprobs, stopped, reason, 0,
                                                            request.tops if request.top else None)))
        return finished

    def _stop_string_end(self, request: _Open, before: int) -> int | None:
        """Where the request's tokens end at the first that completes a stop string (None: none does)."""
        decode = self.tokenizer.decode
        if not any(s in decode(request.ids, skip_special_tokens=True) for s in request.stops):
            return None
        for end in range(before + 1, len(request.ids) + 1):
            if any(s in decode(request.ids[:end], skip_special_tokens=True) for s in request.stops):
                return end
        return len(request.ids)

    def abort(self, request_ids: list[str] | None = None) -> list[str]:
        ids = [r for r in (list(self._open) if request_ids is None else request_ids) if r in self._open]
        if ids:
            self.engine.abort_request(ids)
            for r in ids:
                del self._open[r]
        return ids

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()
