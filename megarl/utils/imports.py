"""User code named in a recipe as ``package.module:Name`` (a custom environment or tool)."""

from __future__ import annotations

import importlib
from typing import Any


def is_import_path(name: str) -> bool:
    """``package.module:Name``: the form a recipe uses to name its own class."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())


def load_object(path: str) -> Any:
    """The object ``package.module:Name`` names; ValueError with one line saying what is missing.

    The module must be importable where the object is used: in the rollout engines' processes
    too, so install the package (or put it on PYTHONPATH) on every node."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no {attr!r} (from {path!r})") from None
