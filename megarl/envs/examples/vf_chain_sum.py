"""A ``verifiers`` environment, written against verifiers' own API (``vf.SingleTurnEnv``,
``vf.Parser``, ``vf.Rubric``): reasoning-gym's chain_sum served through verifiers, for
``env.kind: verifiers:megarl.envs.examples.vf_chain_sum`` (``model_configs/cpu_verifiers_sums.yaml``).

It is what a Hub environment package is: a module with ``load_environment(**args)``. The parser
reads the reply's last number and the rubric's one reward function compares it with the answer,
so the rubric's score is the episode's reward. Its dataset (``size`` questions, ``seed``) and
eval_dataset (``eval_size``, ``eval_seed``: questions it never trains on) are the task, generated
here; a run takes them with ``data.source: verifiers:megarl.envs.examples.vf_chain_sum`` (and
``...@eval`` for a held-out set), and ``vf_env.evaluate`` outside megarl does too.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str:
    found = _NUMBER.findall(text or "")
    return found[-1] if found else ""


def load_environment(min_terms: int = 2, max_terms: int = 2, min_digits: int = 1, max_digits: int = 1,
                     size: int = 200, seed: int = 0, eval_size: int = 64, eval_seed: int = 100000,
                     system_prompt: str | None = None) -> Any:
    import reasoning_gym
    import verifiers as vf
    from datasets import Dataset

    def questions(n: int, at: int) -> Any:
        entries = reasoning_gym.create_dataset("chain_sum", size=n, seed=at, min_terms=min_terms, max_terms=max_terms,
                                               min_digits=min_digits, max_digits=max_digits)
        return Dataset.from_list([{"question": e["question"], "answer": str(e["answer"])} for e in entries])

    parser = vf.Parser(extract_fn=last_number)

    def correct_answer(completion, answer: str, **kwargs) -> float:
        found = parser.parse_answer(completion)
        try:
            return float(bool(found) and float(found) == float(answer))
        except ValueError:
            return 0.0

    rubric = vf.Rubric(funcs=[correct_answer], weights=[1.0], parser=parser)
    return vf.SingleTurnEnv(dataset=questions(size, seed), eval_dataset=questions(eval_size, eval_seed),
                            system_prompt=system_prompt, parser=parser, rubric=rubric)
