"""What ``megarl convert`` checks before it starts a rank: each input it will read, and
that the output it writes can be loaded. Each check raises ConfigError naming the file
and the field; none writes anything."""

from __future__ import annotations

import json
from pathlib import Path

from megarl.config.loader import ConfigError
from megarl.convert.checkpoint import HF_DIR
from megarl.convert.fields import check_hf_config
from megarl.models.hf_arch import ArchError, ModelArch, arch_from_hf_config

# megatron-core's description of a dist checkpoint's format, and the format megarl writes.
DIST_CONFIG = "metadata.json"
DIST_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}

# Any one of these sets is a tokenizer transformers and vLLM can load.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


def hf_config_arch(model_dir: str | Path) -> ModelArch:
    """The architecture of an HF folder, its config.json checked field by field first."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path} not found: an HF model directory needs a config.json")
    cfg = _read_json(path)
    check_hf_config(cfg, str(path))
    return arch_from_hf_config(cfg, source=str(path))


def check_dist_checkpoint(ckpt_dir: str | Path) -> None:
    """Refuses a directory that is not a complete torch_dist checkpoint, or one whose files
    would run code when loaded (read here with the restricted loaders the ranks use)."""
    from megarl.platform.safe_checkpoint import (
        COMMON_FILE,
        METADATA_FILE,
        UnsafeCheckpointError,
        load_weights_only,
        read_metadata,
    )

    ckpt = Path(ckpt_dir)
    config_path = ckpt / DIST_CONFIG
    if not config_path.is_file():
        raise ConfigError(f"{ckpt} holds no distributed checkpoint ({DIST_CONFIG} not found)")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: must hold a JSON object")
    for key, expected in DIST_BACKENDS.items():
        if config.get(key) != expected:
            raise ConfigError(f"{config_path}: field {key!r} is {config.get(key)!r}; megarl reads {expected!r} only")
    for name in (METADATA_FILE, COMMON_FILE):
        if not (ckpt / name).is_file():
            raise ConfigError(f"{ckpt} holds no complete distributed checkpoint ({name} not found)")
    try:
        metadata = read_metadata(ckpt)
        load_weights_only(ckpt / COMMON_FILE, str(ckpt / COMMON_FILE))
    except UnsafeCheckpointError as e:
        raise ConfigError(str(e)) from e
    for file in sorted({info.relative_path for info in (metadata.storage_data or {}).values()}):
        if not (ckpt / file).is_file():
            raise ConfigError(f"{ckpt / file} is listed in {ckpt / METADATA_FILE} but does not exist")
    _check_objects(ckpt, metadata)


def _check_objects(ckpt: Path, metadata: object) -> None:
    """Reads every pickled object stored in the shard files (megatron's ShardedObjects, small)
    as the ranks will, with weights_only=True, so a hostile one is refused here by name."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megarl.platform.safe_checkpoint import UnsafeCheckpointError, load_weights_only

    objects = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in objects or info.transform_descriptors:  # transformed streams: left to the ranks
            continue
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise ConfigError(f"{ckpt / info.relative_path} is truncated: object {index.fqn!r} runs past its end")
        try:
            load_weights_only(io.BytesIO(data), f"{ckpt / info.relative_path}: object {index.fqn!r}")
        except UnsafeCheckpointError as e:
            raise ConfigError(str(e)) from e


def check_exportable(ckpt_dir: str | Path, arch: ModelArch, tokenizer: bool = True) -> None:
    """Refuses to export a checkpoint into an HF folder that transformers or vLLM could not load."""
    side = Path(ckpt_dir) / HF_DIR
    config = side / "config.json"
    if not config.is_file():
        raise ConfigError(f"{config} is missing: the export would have no config.json, which transformers and "
                          f"vLLM need to load it (copy the source model's config.json and tokenizer into {side}/)")
    try:
        side_arch = hf_config_arch(side)
    except ArchError as e:
        raise ConfigError(str(e)) from e
    diffs = arch.mismatches(side_arch)
    if diffs:
        raise ConfigError(f"{config} does not describe the checkpoint's model ({'; '.join(diffs[:3])})")
    if tokenizer and not any(all((side / f).is_file() for f in files) for files in TOKENIZER_FILES):
        raise ConfigError(f"{side / 'tokenizer.json'} is missing (nor tokenizer.model, nor vocab.json + merges.txt): "
                          f"vLLM could not load the export; copy the tokenizer into {side}/ or pass --no-tokenizer")
