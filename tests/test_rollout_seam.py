"""The rollout backend seam: ``RolloutEngine`` is the interface callers really use.

Callers reach engines through Ray actor handles (``engine.method.remote(...)``), which no type
checker follows; these tests hold the protocol to the code instead: every method any module
outside the benchmarks calls on an engine is declared, and ``VLLMEngine`` implements every
declared method with the protocol's parameters.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from megarl.rollout.engine import RolloutEngine

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"
# `.call.remote`: the Megatron rank actors' one entry point (megarl.workers.group), not an engine's
RANK_ACTOR_METHODS = {"call"}


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(RolloutEngine).items()
            if callable(fn) and not name.startswith("_")}


def _remote_calls(path: Path) -> set[str]:
    """Names X of every ``<expr>.X.remote(...)`` call in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"
                and isinstance(node.func.value, ast.Attribute)):
            names.add(node.func.value.attr)
    return names


def test_every_method_called_on_an_engine_is_in_the_protocol():
    declared = _protocol_methods()
    callers = [p for p in PACKAGE.rglob("*.py") if "bench" not in p.parts]
    used = {name: p for p in callers for name in _remote_calls(p)}
    missing = {name: str(p.relative_to(PACKAGE)) for name, p in used.items()
               if name not in declared and name not in RANK_ACTOR_METHODS}
    assert not missing, f"called on engine handles but not declared in RolloutEngine: {missing}"
    # the seam is not vacuous: the run's own calls go through it
    assert {"generate", "sleep", "wake_up_weights", "receive_weights", "health"} <= set(used)


def test_vllm_engine_implements_the_protocol():
    from megarl.rollout.vllm_engine import VLLMEngine

    for name, wanted in _protocol_methods().items():
        assert hasattr(VLLMEngine, name), f"VLLMEngine lacks {name}"
        got = inspect.signature(getattr(VLLMEngine, name))
        # Ray adds _ray_trace_ctx to the class's methods once it has wrapped the class in this process
        params = [p for p in got.parameters if p != "_ray_trace_ctx"]
        assert params == list(wanted.parameters), (name, got, wanted)
