"""The rollout backend seam: a core protocol every backend implements and capability protocols
a backend may add (megarl.rollout.engine), held to the code.

Callers reach engines through Ray actor handles (``engine.method.remote(...)``, or
``engine.method.options(num_returns="streaming").remote(...)``), which no type checker follows;
these tests check instead that every method any module outside the benchmarks calls on an
engine is declared in one protocol, that each backend implements the core and the protocols of
the capabilities it claims with the protocols' parameters, and that validation refuses a run
whose settings need a capability its backend lacks.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megarl.rollout.backends import BACKENDS, Backend, backend_errors
from megarl.rollout.engine import CAPABILITIES, CAPABILITY_PROTOCOLS, RolloutEngine, core_methods, protocol_methods

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"
# `.call.remote` / `.call_kept.remote`: the Megatron rank actors' entry points (megarl.workers.group;
# call_kept leaves the result in the rank's node store, for the memory snapshots), not an engine's
RANK_ACTOR_METHODS = {"call", "call_kept"}


def _outside_server_methods() -> set[str]:
    """The methods of the bound endpoint's own actor (megarl.rollout.endpoint.bound), not an engine's."""
    from megarl.rollout.endpoint.bound import OutsideServer

    return {name for name in vars(OutsideServer) if not name.startswith("_")}


def _declared() -> dict[str, str]:
    """Every declared method and the protocol that declares it."""
    owners: dict[str, str] = {name: "core" for name in core_methods()}
    for capability, protocol in CAPABILITY_PROTOCOLS.items():
        for name in protocol_methods(protocol):
            assert name not in owners, f"{name} is declared by both {owners[name]} and {capability}"
            owners[name] = capability
    return owners


def _remote_calls(path: Path) -> set[str]:
    """Names X of every ``<expr>.X.remote(...)`` and ``<expr>.X.options(...).remote(...)`` call."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"):
            continue
        target = node.func.value
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "options":
            target = target.func.value  # X.options(...).remote(...): X is the method (or a class: skipped)
        if isinstance(target, ast.Attribute):
            names.add(target.attr)
    return names


def test_the_call_forms_are_all_seen():
    tree = "e.generate.remote(1)\ne.serve.options(num_returns='streaming').remote(2)\n" \
           "ray.remote(C).options(num_cpus=0).remote()\n_actor_class(c).options().remote()\n"
    path = Path(__file__).with_name("_seam_probe.py")
    try:
        path.write_text(tree)
        assert _remote_calls(path) == {"generate", "serve"}
    finally:
        path.unlink()


def test_every_method_called_on_an_engine_is_declared():
    declared = _declared()
    callers = [p for p in PACKAGE.rglob("*.py") if "bench" not in p.parts]
    used = {name: p for p in callers for name in _remote_calls(p)}
    other_actors = RANK_ACTOR_METHODS | _outside_server_methods()
    assert not other_actors & set(declared), "an engine method shares its name with another actor's"
    missing = {name: str(p.relative_to(PACKAGE)) for name, p in used.items()
               if name not in declared and name not in other_actors}
    assert not missing, f"called on engine handles but declared in no rollout protocol: {missing}"
    # the seam is not vacuous: the run's own calls go through it, streaming calls included
    assert {"generate", "sleep", "wake_up_weights", "receive_weights", "health", "serve", "add_groups",
            "interrupt", "continue_episodes"} <= set(used)


def test_the_core_is_what_every_backend_implements():
    """What a second backend must implement (printed in the issue's note)."""
    assert core_methods() == sorted([
        "ready", "health", "kill_processes", "busy_seconds", "shutdown",  # liveness
        "generate", "prompt_logprobs", "set_weight_version",  # generation, scoring, versions
        "sleep", "wake_up_weights", "wake_up_kv_cache",  # memory
        "param_meta", "join_sync_group", "leave_sync_group", "install_plan", "check_plan", "receive_weights"])
    assert set(CAPABILITY_PROTOCOLS) == set(CAPABILITIES)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_implements_the_core_and_its_capabilities(name):
    backend = BACKENDS[name]
    engine_class = backend.load()
    wanted = protocol_methods(RolloutEngine)
    for capability in backend.capabilities:
        wanted |= protocol_methods(CAPABILITY_PROTOCOLS[capability])
    for method, declared in wanted.items():
        assert hasattr(engine_class, method), f"{engine_class.__name__} lacks {method}"
        got = inspect.signature(getattr(engine_class, method))
        # Ray adds _ray_trace_ctx to the class's methods once it has wrapped the class in this process
        params = [p for p in got.parameters if p != "_ray_trace_ctx"]
        assert params == list(inspect.signature(declared).parameters), (method, got)


@pytest.mark.parametrize("override,capability", [
    ("trainer.schedule=opportunistic", "interrupt"),
    ("env={kind: tools, tools: [{name: calculator}]}", "episodes"),
    ("rollout.granularity=group", "group_streams"),
    ("actor.moe.routing_replay=true", "route_capture"),
])
def test_a_backend_without_a_capability_is_refused(monkeypatch, override, capability):
    from megarl.config.loader import load_config
    from megarl.config.schema import RunConfig

    monkeypatch.setitem(BACKENDS, "minimal", Backend("minimal", "megarl.rollout.vllm_engine:VLLMEngine", frozenset()))
    cfg = load_config(RunConfig, None, ["rollout.backend=minimal", override, "trainer.max_staleness=1"])
    errors = backend_errors(cfg)
    assert errors and all("rollout.backend='minimal' cannot" in e for e in errors)
    assert any(f"can {capability.replace('_', ' ')}" in e for e in errors), errors
    cfg.rollout.backend = "vllm"
    assert backend_errors(cfg) == []
    cfg.rollout.backend = "sglang"
    assert backend_errors(cfg) == ["rollout.backend='sglang' must be one of minimal, vllm"]
