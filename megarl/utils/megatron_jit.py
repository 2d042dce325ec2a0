"""megatron-core's ``jit_fuser``, compiled when a fused function first runs instead of when it is defined.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and about fifteen megatron-core modules
decorate functions with it as they are imported. ``torch.compile`` does its tracing and compiling
at the first call anyway, but the decoration itself imports torch._dynamo and inductor's compile
machinery: 2.6 s of the 3.0 s that ``import megatron.core`` takes beyond torch on a 2-core CPU
(1.4 s with this; measured in one process each). Every rank process pays it at start (every role,
``megarl convert``'s ranks, the test pools), although on CPU none of the fused functions ever runs
(megarl.platform turns megatron's fusions off there) and a scoring rank never needs dynamo at all.

``install()`` (from ``megarl/__init__``) puts a finder on ``sys.meta_path`` that, when
``megatron.core.jit`` is imported, replaces its ``jit_fuser`` with ``deferred_compile``: the
same ``torch.compile`` with the same arguments, called at the decorated function's first call.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

MODULE = "megatron.core.jit"


def deferred_compile(model: Callable | None = None, **options: Any) -> Callable:
    """``torch.compile(model, **options)`` made at ``model``'s first call (also as ``@deferred_compile(...)``)."""
    if model is None:
        return functools.partial(deferred_compile, **options)
    compiled: Callable | None = None

    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(model, **options)
        return compiled(*args, **kwargs)

    return call


class _Loader(importlib.abc.Loader):
    """megatron.core.jit's own loader, then its ``jit_fuser`` deferred if it is ``torch.compile``."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = deferred_compile

    def __getattr__(self, name: str) -> Any:  # get_source, get_data, ...: the file's own loader
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Defers megatron-core's jit_fuser in this process (a no-op if megatron-core is already imported)."""
    if MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
