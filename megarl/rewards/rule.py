"""Verifiable rewards: reasoning-gym's own scorers and math-verify equivalence.

Both extract an answer from the response first (see :mod:`megarl.rewards.extract`);
a response without an extractable answer scores 0. The reference comes from the
sample's metadata: ``metadata["entry"]`` (the reasoning-gym entry) or
``metadata["answer"]`` (a reference answer string), as built by
:mod:`megarl.data.prompts`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from megarl.rewards.base import RewardInput
from megarl.rewards.extract import Extractor, resolve_extractor

logger = logging.getLogger(__name__)


def _metadata_value(sample: RewardInput, index: int, key: str, owner: str) -> Any:
    if key not in sample.metadata:
        raise KeyError(f"{owner}: sample {index} has no metadata[{key!r}] "
                       f"(metadata keys: {sorted(sample.metadata)})")
    return sample.metadata[key]


class ReasoningGymReward:
    """Scores with the reasoning-gym dataset's own ``score_answer(answer, entry)``.

    ``dataset_name=None`` picks the scorer per sample from the entry's
    ``metadata.source_dataset`` (reasoning-gym fills it in), so mixed-task prompt sets
    need one reward. ``dataset_config`` builds the scorer from a non-default dataset
    config, for the few tasks whose scoring depends on it. Scores are reasoning-gym's,
    partial credit included (e.g. ``"-4.0"`` against ``"-4"`` scores 0.5 on
    basic_arithmetic).
    """

    def __init__(self, dataset_name: str | None = None, extractor: str | Extractor = "answer_tag",
                 entry_key: str = "entry", dataset_config: dict[str, Any] | None = None) -> None:
        self.extract = resolve_extractor(extractor)
        self.entry_key = entry_key
        self._dataset_config = dict(dataset_config or {})
        self._scorers: dict[str, Callable[[str | None, dict[str, Any]], float]] = {}
        self.dataset_name = dataset_name
        if dataset_name is not None:
            self._scorer(dataset_name)  # an unknown name fails here, before any rollout

    def _scorer(self, name: str) -> Callable[[str | None, dict[str, Any]], float]:
        scorer = self._scorers.get(name)
        if scorer is None:
            import reasoning_gym

            if self._dataset_config:
                # size/seed only matter for generation; scoring reads the config.
                dataset = reasoning_gym.create_dataset(name, size=1, seed=0, **self._dataset_config)
                scorer = dataset.score_answer
            else:
                try:
                    scorer = reasoning_gym.get_score_answer_fn(name)
                except ValueError as exc:
                    raise ValueError(f"ReasoningGymReward: unknown reasoning-gym dataset {name!r}") from exc
            self._scorers[name] = scorer
        return scorer

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        entries = [_metadata_value(s, i, self.entry_key, "ReasoningGymReward") for i, s in enumerate(samples)]
        rewards = []
        for index, (sample, entry) in enumerate(zip(samples, entries, strict=True)):
            name = self.dataset_name or entry.get("metadata", {}).get("source_dataset")
            if name is None:
                raise KeyError(f"ReasoningGymReward: sample {index}: no dataset_name given and the entry "
                               "has no metadata.source_dataset")
            scorer = self._scorer(name)  # outside the try: an unknown task is a data error
            answer = self.extract(sample.response)
            if answer is None:
                rewards.append(0.0)
                continue
            try:
                score = float(scorer(answer, entry))
            except Exception as exc:  # noqa: BLE001
                # Scorers parse model output; junk must cost the sample, not the run.
                logger.warning("reasoning-gym %s scorer raised on sample %d (%s); scoring 0", name, index, exc)
                score = 0.0
            rewards.append(score)
        return rewards


def _parse(text: str, timeout: int | None) -> list:
    from math_verify import parse

    parsed = parse(text, parsing_timeout=timeout)
    if not parsed and "\\" in text:
        # Bare LaTeX such as "\dfrac{1}{2}" is only recognised inside math delimiters. Only
        # text with a LaTeX command gets them: inside "$...$" plain words parse as products
        # of symbols ("banana" -> a*a*a*b*n*n).
        parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed


class MathVerifyReward:
    """1.0 if math-verify finds the extracted answer equivalent to the reference, else 0.0.

    Equivalent forms count: ``1/2``, ``0.5``, ``\\frac{1}{2}``. The reference is
    ``metadata[answer_key]`` (a string, parsed the same way). math-verify's timeouts
    use SIGALRM, which only works in the main thread; elsewhere (a Ray actor's
    thread, a thread pool) we run without its timeout rather than crash.
    """

    def __init__(self, extractor: str | Extractor = "answer_tag", answer_key: str = "answer",
                 timeout_s: int = 5, float_rounding: int = 6) -> None:
        self.extract = resolve_extractor(extractor)
        self.answer_key = answer_key
        self.timeout_s = timeout_s
        self.float_rounding = float_rounding

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        from math_verify import verify

        references = [_metadata_value(s, i, self.answer_key, "MathVerifyReward") for i, s in enumerate(samples)]
        timeout = self.timeout_s if threading.current_thread() is threading.main_thread() else None
        rewards = []
        for index, (sample, reference) in enumerate(zip(samples, references, strict=True)):
            answer = self.extract(sample.response)
            if answer is None:
                rewards.append(0.0)
                continue
            gold = _parse(str(reference), timeout)
            if not gold:
                # A bad reference is a data error, not a model error: fail loudly.
                raise ValueError(f"MathVerifyReward: sample {index}: math-verify cannot parse the "
                                 f"reference {reference!r}")
            try:
                predicted = _parse(answer, timeout)
                ok = bool(predicted) and verify(gold, predicted, float_rounding=self.float_rounding,
                                                timeout_seconds=timeout)
            except Exception as exc:  # noqa: BLE001
                logger.warning("math-verify failed on sample %d (%s); scoring 0", index, exc)
                ok = False
            rewards.append(1.0 if ok else 0.0)
        return rewards


class FormatReward:
    """1.0 when the response states an answer in the expected form, else 0.0.

    A small shaping term for models that rarely follow the answer format at first
    (give it a low weight beside a correctness term in the run's ``rewards``).
    """

    def __init__(self, extractor: str | Extractor = "answer_tag") -> None:
        self.extract = resolve_extractor(extractor)

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        return [0.0 if self.extract(s.response) is None else 1.0 for s in samples]
