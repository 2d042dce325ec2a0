"""Tool-call formats by name: adding one is one module and one line here."""

from __future__ import annotations

from megarl.envs.tool_parsers.base import ToolCallParser
from megarl.envs.tool_parsers.hermes import HermesParser

PARSERS: dict[str, type] = {"hermes": HermesParser}


def build_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"env.tool_parser {name!r} must be one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
