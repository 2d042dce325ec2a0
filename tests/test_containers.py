"""containers/: the images install what setup.py pins, at the same versions (~1 s)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = ROOT / "containers"


def setup_requirements() -> dict[str, list[Requirement]]:
    """install_requires and each extra of setup.py, read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    names = {}
    for node in tree.body:  # module constants such as TORCH = "torch==..."
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}

    def value(node: ast.expr):
        return eval(compile(ast.Expression(node), "setup.py", "eval"), {}, dict(names))  # our own literal

    groups = {"install": [Requirement(r) for r in value(kw["install_requires"])]}
    for extra, reqs in value(kw["extras_require"]).items():
        groups[extra] = [Requirement(r) for r in reqs]
    return groups


def pins(path: Path) -> dict[str, Version]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not an exact pin"
            out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def _check_agree(groups: list[str], constraints: Path) -> None:
    reqs = [r for g in groups for r in setup_requirements()[g]]
    pinned = pins(constraints)
    for req in reqs:
        name = canonicalize_name(req.name)
        if name in pinned:
            assert req.specifier.contains(pinned[name], prereleases=True), \
                f"{constraints.name} pins {name}=={pinned[name]}, setup.py asks {req}"


def test_gpu_constraints_agree_with_setup_py():
    _check_agree(["install", "gpu"], CONTAINERS / "constraints-gpu.txt")
    pinned = pins(CONTAINERS / "constraints-gpu.txt")
    # every GPU extra and the packages the issue names are pinned exactly, in both places
    for req in setup_requirements()["gpu"]:
        (spec,) = req.specifier
        assert spec.operator == "==", f"setup.py's gpu extra leaves {req} unpinned"
        assert pinned[canonicalize_name(req.name)] == Version(spec.version)
    for name in ("torch", "megatron-core", "vllm", "transformer-engine", "nvidia-modelopt", "ray"):
        assert name in pinned, f"constraints-gpu.txt does not pin {name}"


def test_cpu_constraints_agree_with_setup_py():
    _check_agree(["install", "cpu"], CONTAINERS / "constraints-cpu.txt")


def test_one_cuda_major_in_the_gpu_image():
    """The base image's CUDA and Transformer Engine's core wheel must be the same major."""
    dockerfile = (CONTAINERS / "Dockerfile.gpu").read_text()
    cuda = re.search(r"ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.", dockerfile)
    assert cuda, "Dockerfile.gpu has no CUDA_IMAGE=nvidia/cuda:<version>"
    te = next(r for r in setup_requirements()["gpu"] if canonicalize_name(r.name) == "transformer-engine")
    assert {canonicalize_name(e) for e in te.extras} >= {"pytorch", f"core-cu{cuda.group(1)}"}, te


@pytest.mark.parametrize("path, needles", [
    ("Dockerfile.gpu", ["-c containers/constraints-gpu.txt", '".[gpu]"', "import torch, transformer_engine.pytorch"]),
    ("Dockerfile.cpu", ["bash containers/install-cpu.sh", "FROM python:3.11"]),
    ("megarl-gpu.def", ["Bootstrap: docker-daemon", "IMAGE=megarl-gpu:0.1.0", "%test"]),
])
def test_recipes_install_through_the_pinned_path(path, needles):
    text = (CONTAINERS / path).read_text()
    for needle in needles:
        assert needle in text, f"{path} lacks {needle!r}"


def test_the_apptainer_image_is_the_one_the_dockerfile_tags():
    tag = re.search(r"-t (megarl-gpu:\S+) \.", (CONTAINERS / "Dockerfile.gpu").read_text()).group(1)
    assert f"IMAGE={tag}" in (CONTAINERS / "megarl-gpu.def").read_text()
