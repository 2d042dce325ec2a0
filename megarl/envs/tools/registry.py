"""Tools by name: adding one is one module and one line here."""

from __future__ import annotations

import inspect
from typing import Any

from megarl.envs.tools.base import Tool


def _calculator() -> type:
    from megarl.envs.tools.calculator import Calculator

    return Calculator


def _python() -> type:
    from megarl.envs.tools.python_sandbox import PythonSandbox

    return PythonSandbox


TOOLS = {"calculator": _calculator, "python": _python}
TOOL_NAMES = tuple(TOOLS)


def build_tool(name: str, options: dict[str, Any]) -> Tool:
    """The tool ``name`` with ``options`` as its settings; an unknown name or option is refused."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)}")
    cls = TOOLS[name]()
    known = [p for p in inspect.signature(cls).parameters if p != "self"]
    if unknown := sorted(set(options) - set(known)):
        raise ValueError(f"tool {name!r} has no option {unknown[0]!r}; options: {', '.join(known) or 'none'}")
    return cls(**options)
