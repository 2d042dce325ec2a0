"""Answer extractors: the part of a model response that a verifier scores.

Each extractor maps a response to the answer text, or ``None`` when the response
states no answer in that form (a ``None`` answer scores 0). Rules:

- ``answer_tag``: the content of the LAST complete ``<answer>...</answer>`` pair,
  whitespace-stripped. Last, because models often restate the format ("I will put
  it in <answer></answer>") before answering. An unclosed tag (a response cut off
  by max_tokens) is no answer; an empty tag is no answer.
- ``boxed``: the content of the last ``\\boxed{...}``, braces matched (so
  ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); unbalanced braces: no answer.
- ``last_number``: the last number in the text: optional minus sign, digits with
  optional thousands commas (``1,234`` -> ``1234``) and an optional decimal part.
  A minus directly after a letter or digit is an operator, not a sign
  (``5-3`` -> ``3``); digits glued to letters (``x2``) are not numbers.
- ``full``: the whole response, stripped (``None`` if empty).

Names can be chained with ``|``: ``"answer_tag|boxed|last_number"`` tries each in
order and takes the first answer found.
"""

from __future__ import annotations

import re
from collections.abc import Callable

Extractor = Callable[[str], str | None]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", flags=re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d,]*\d)")
_BOXED = "\\boxed{"


def answer_tag(text: str) -> str | None:
    matches = _ANSWER_TAG.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip()
    return answer or None


def boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    begin = start + len(_BOXED)
    for pos in range(begin, len(text)):
        char = text[pos]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:pos].strip() or None
    return None  # unbalanced: the response was cut off inside the box


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "")


def full(text: str) -> str | None:
    return text.strip() or None


EXTRACTORS: dict[str, Extractor] = {
    "answer_tag": answer_tag,
    "boxed": boxed,
    "last_number": last_number,
    "full": full,
}


def first_of(*extractors: Extractor) -> Extractor:
    """The first answer any of ``extractors`` finds, in order."""
    if not extractors:
        raise ValueError("first_of needs at least one extractor")

    def extract(text: str) -> str | None:
        for extractor in extractors:
            answer = extractor(text)
            if answer is not None:
                return answer
        return None

    return extract


def resolve_extractor(spec: str | Extractor) -> Extractor:
    """An extractor from a config value: a callable, a name, or names joined by ``|``."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"extractor must be a name or a callable, got {spec!r}")
    names = [name.strip() for name in spec.split("|")]
    unknown = [name for name in names if name not in EXTRACTORS]
    if unknown:
        raise ValueError(f"unknown answer extractor {unknown[0]!r} in {spec!r}; "
                         f"known: {', '.join(sorted(EXTRACTORS))}")
    if len(names) == 1:
        return EXTRACTORS[names[0]]
    return first_of(*(EXTRACTORS[name] for name in names))
