"""vLLM's engine as a ``TurnBackend``: turns added one request at a time and stepped, so
requests from many episodes batch together as they arrive (vLLM's continuous batching).

Each step's new tokens are kept per request (vLLM's DELTA outputs), so ``abort`` can hand back
what the unfinished requests have so far: interruptible generation (``rollout.partial``) drives
vLLM through this too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.rollout.episodes import FinishedTurn
from megarl.rollout.sampling import SamplingConfig


class VLLMTurns:
    def __init__(self, llm: Any, tokenizer: Any, sampling: SamplingConfig,
                 on_sampled: Callable[[int], None] | None = None):
        self.engine = llm.llm_engine
        self.tokenizer, self.sampling = tokenizer, sampling
        self.on_sampled = on_sampled  # told each step's count of new tokens
        self._so_far: dict[str, tuple[list[int], list[float]]] = {}  # unfinished requests' tokens, log-probs

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int, seed: int | None) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        params = SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=max_tokens,
                                stop_token_ids=list(s.stop_token_ids), seed=seed, logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params)
        self._so_far[request_id] = ([], [])

    def step(self) -> list[FinishedTurn]:
        finished = []
        for output in self.engine.step():
            completion = output.outputs[0]
            ids, logprobs = self._so_far[output.request_id]
            new = list(completion.token_ids)
            ids += new
            logprobs += [step[token].logprob for step, token in zip(completion.logprobs, new, strict=True)]
            if self.on_sampled is not None:
                self.on_sampled(len(new))
            if output.finished:
                del self._so_far[output.request_id]
                finished.append(FinishedTurn(output.request_id, ids, logprobs, completion.finish_reason == "stop"))
        return finished

    def abort(self) -> list[FinishedTurn]:
        """Removes every unfinished request from the engine; what each generated so far (not stopped)."""
        left, self._so_far = self._so_far, {}
        if left:
            self.engine.abort_request(list(left))
        return [FinishedTurn(request_id, ids, logprobs, False) for request_id, (ids, logprobs) in left.items()]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
