"""A reward term of the config as a reward function: one place that maps ``rewards[i].kind`` to
its scorer, for the driver's batched scoring and for environments that score final answers.

A recipe's own scorer is ``kind: package.module:name`` (as environments are named): a function
``fn(samples: list[RewardInput]) -> list[float]`` called with ``options`` as keyword arguments,
or a class made once with ``options`` whose instances are such functions."""

from __future__ import annotations

from megarl.config.schema import RewardTermConfig
from megarl.rewards.base import RewardFn
from megarl.utils.imports import is_import_path, load_object

REWARD_KINDS = ("reasoning_gym", "math_verify", "format", "remote", "model")


def build_term(term: RewardTermConfig) -> RewardFn:
    """The scorer of a text term (every kind but ``model``, which the reward model computes)."""
    from megarl.rewards.remote import RemoteReward
    from megarl.rewards.rule import FormatReward, MathVerifyReward, ReasoningGymReward

    if term.kind == "reasoning_gym":
        return ReasoningGymReward(dataset_name=None, extractor=term.extractor)
    if term.kind == "math_verify":
        return MathVerifyReward(extractor=term.extractor)
    if term.kind == "format":
        return FormatReward(extractor=term.extractor)
    if term.kind == "remote":
        return RemoteReward(term.url, timeout_s=term.timeout_s, max_retries=term.max_retries,
                            max_concurrency=term.max_concurrency)
    if is_import_path(term.kind):
        return custom_term(term)
    raise ValueError(f"reward kind {term.kind!r} must be one of {', '.join(REWARD_KINDS)} (or package.module:name)")


def custom_term(term: RewardTermConfig) -> RewardFn:
    """``term.kind``'s function or an instance of its class, with ``term.options``; a name that
    does not import, options that do not fit, or something not callable is one ValueError line."""
    import functools
    import inspect

    scorer = load_object(term.kind)
    if inspect.isclass(scorer):
        try:
            scorer = scorer(**term.options)
        except TypeError as exc:
            raise ValueError(f"options do not fit {term.kind}: {exc}") from None
    elif callable(scorer) and term.options:
        try:
            inspect.signature(scorer).bind_partial(None, **term.options)
        except TypeError as exc:
            raise ValueError(f"options do not fit {term.kind}: {exc}") from None
        scorer = functools.partial(scorer, **term.options)
    if not callable(scorer):
        raise ValueError(f"{term.kind} is not callable: a reward term maps a list of samples to their rewards")
    return scorer
