"""The requirements of the staged packages that neither the stage nor the GPU machine's image holds.

stage.sh installs with --no-deps (the image's torch must stay), so a dependency missing from
requirements-stage.txt shows only on the machine, as an ImportError minutes into a run (vLLM's
FP8 path imports compressed-tensors, which imports loguru). This reads every staged package's
Requires-Dist, as it applies on the machine (Python 3.12, Linux x86_64, no extras), and prints
what is neither staged nor in the image; exit 1 when anything is.

    python3 containers/gpu/missing_requirements.py SITE
"""

from __future__ import annotations

import sys
from importlib.metadata import PathDistribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the bare GPU machine's image has (torch 2.11.0+cu130 with its CUDA libraries, and the
# Hugging Face stack: containers/gpu/smoke_steps.py probe reports transformers 5.17.0 there).
IMAGE = {
    "torch", "triton", "numpy", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath",
    "typing-extensions", "setuptools", "transformers", "huggingface-hub", "tokenizers", "safetensors", "regex",
    "pyyaml", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "tqdm", "packaging", "pillow",
    "psutil", "protobuf", "sentencepiece", "aiohttp", "aiosignal", "attrs", "frozenlist", "multidict", "yarl",
    "propcache", "aiohappyeyeballs", "anyio", "h11", "httpx", "httpcore", "click", "uvicorn", "msgpack",
    "cloudpickle", "einops", "scipy", "prometheus-client", "py-cpuinfo", "gguf", "tiktoken", "numba", "llvmlite",
    "hf-xet", "typer", "rich", "shellingham", "markdown-it-py", "mdurl", "pygments", "torchvision", "torchaudio",
}
# Left out on purpose (stage.sh): vLLM's optional kernels and JIT tools, its servers' and
# multimodal extras. The runs on the machine use none of them: the offline engine, Triton attention.
LEFT_OUT = {
    "flashinfer-python", "humming-kernels", "quack-kernels", "tilelang", "tokenspeed-mla", "fastsafetensors",
    "ninja", "nvtx", "pynvvideocodec", "torchcodec", "opencv-python-headless", "anthropic", "mcp",
    "opentelemetry-exporter-otlp", "outlines-core", "watchfiles", "annotated-doc", "jmespath", "supervisor",
    "truststore",
}
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def missing(site: Path) -> dict[str, list[str]]:
    """{requirement name: [the staged packages that need it]} for each one nothing provides."""
    dists = [PathDistribution(p) for p in sorted(site.glob("*.dist-info"))]
    staged = {canonicalize_name(d.metadata["Name"]) for d in dists}
    needed: dict[str, list[str]] = {}
    for dist in dists:
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(ENVIRONMENT):
                continue
            name = canonicalize_name(req.name)
            if name not in staged | IMAGE | LEFT_OUT and not name.startswith("nvidia-"):
                needed.setdefault(name, []).append(dist.metadata["Name"])
    return needed


def main() -> None:
    site = Path(sys.argv[1])
    needed = missing(site)
    for name, by in sorted(needed.items()):
        print(f"not staged and not in the image: {name} (required by {', '.join(sorted(set(by)))})")
    sys.exit(1 if needed else 0)


if __name__ == "__main__":
    main()
