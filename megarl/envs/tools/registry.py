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
    """The tool ``name`` with ``options`` as its settings; an unknown name or option is refused.

    ``name`` may also be a class of your own, ``package.module:Class`` (``megarl.envs.tools.base.Tool``:
    ``name``, ``spec()`` and an async call), constructed with ``options``."""
    from megarl.utils.imports import is_import_path, load_object

    if is_import_path(name):
        cls = load_object(name)
        if not callable(cls):
            raise ValueError(f"tool {name!r} is not a class")
    elif name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)} (or package.module:Class)")
    else:
        cls = TOOLS[name]()
    known = [p for p in inspect.signature(cls).parameters if p != "self"]
    if unknown := sorted(set(options) - set(known)):
        raise ValueError(f"tool {name!r} has no option {unknown[0]!r}; options: {', '.join(known) or 'none'}")
    tool = cls(**options)
    for needed in ("name", "spec"):
        if not hasattr(tool, needed):
            raise ValueError(f"tool {name!r} has no {needed!r} (see megarl.envs.tools.base.Tool)")
    return tool
