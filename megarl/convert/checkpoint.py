"""megarl's megatron-core checkpoints: a ``dist_checkpointing`` directory plus metadata.

Layout of a checkpoint directory::

    megarl.json          architecture, padded vocab, dtype, the layout it was written at
    hf/                  config.json, tokenizer and generation files of the source model
    *.distcp, ...        megatron-core dist_checkpointing (torch_dist) files

Any (tp, pp) layout can load it: megatron-core reshards on load.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megarl.config.loader import ConfigError
from megarl.config.schema import ParallelConfig
from megarl.models.hf_arch import ArchError, ModelArch, arch_from_hf_dir
from megarl.utils.atomic import write_text_atomic

META_FILE = "megarl.json"
HF_DIR = "hf"  # config, tokenizer and generation files of the source model
FORMAT = "megarl-mcore-v1"


def is_megarl_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(ckpt_dir: str | Path, arch_only: bool = False) -> dict[str, Any]:
    """``megarl.json`` of a checkpoint, checked field by field (ConfigError naming the field);
    with ``arch_only``, only its format and architecture (all a config check needs)."""
    from megarl.config.schema import DTYPES
    from megarl.convert.fields import check_arch_dict, positive_int

    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise ConfigError(f"{ckpt_dir} is not a megarl checkpoint ({META_FILE} not found)")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise ConfigError(f"{path}: must hold a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    check_arch_dict(meta.get("arch"), str(path))
    if arch_only:
        return meta
    positive_int(meta, "padded_vocab", str(path))
    if meta["padded_vocab"] < meta["arch"]["vocab_size"]:
        raise ConfigError(f"{path}: padded_vocab={meta['padded_vocab']} is smaller than the vocabulary "
                          f"({meta['arch']['vocab_size']})")
    if meta.get("dtype") not in DTYPES:
        raise ConfigError(f"{path}: field 'dtype' is {meta.get('dtype')!r}; expected one of {', '.join(DTYPES)}")
    if not isinstance(meta.get("value_head"), bool):
        raise ConfigError(f"{path}: field 'value_head' must be true or false, got {meta.get('value_head')!r}")
    return meta


def hf_side_dir(source: str | Path) -> Path:
    """Where the config, tokenizer and generation files of a role's model source live.

    ``source`` is a model path as configs give it: an HF folder, ``bundled:NAME`` (resolved
    to its materialised folder), or a megarl checkpoint (whose ``hf/`` carries them on).
    """
    from megarl.models.bundled import resolve_model_path

    path = resolve_model_path(source)
    return path / HF_DIR if is_megarl_checkpoint(path) else path


def read_model_arch(path: str | Path) -> ModelArch:
    """The architecture of an HF directory or of a megarl checkpoint (or ``bundled:NAME``)."""
    from megarl.models.bundled import resolve_model_path

    path = resolve_model_path(path)
    if is_megarl_checkpoint(path):
        return ModelArch.from_dict(read_meta(path, arch_only=True)["arch"])
    if not Path(path).exists():
        raise ArchError(f"{path} does not exist")
    return arch_from_hf_dir(path)


def write_meta(ckpt_dir: str | Path, arch: ModelArch, padded_vocab: int, dtype: str,
               parallel: ParallelConfig, value_head: bool, source: str, extra: dict | None = None) -> None:
    meta = {
        "format": FORMAT,
        "arch": arch.to_dict(),
        "padded_vocab": padded_vocab,
        "dtype": dtype,
        "value_head": value_head,
        "written_at_layout": asdict(parallel),
        "source": source,
        **(extra or {}),
    }
    write_text_atomic(Path(ckpt_dir) / META_FILE, json.dumps(meta, indent=2))


def model_sharded_state_dict(chunks: list) -> dict:
    from megarl.models.lora import shard_adapter_entries

    bare = [getattr(chunk, "module", chunk) for chunk in chunks]  # megatron DDP wraps the model
    if len(bare) == 1:
        return {"model": shard_adapter_entries(bare[0].sharded_state_dict())}
    return {f"model{i}": shard_adapter_entries(chunk.sharded_state_dict()) for i, chunk in enumerate(bare)}


@contextlib.contextmanager
def forked_write_results_queue() -> Iterator[None]:
    """Gives megatron-core's checkpoint writer a results queue from a *forked* Manager, for one save.

    megatron-core creates this queue on the first save with a spawned Manager, which
    starts a fresh interpreter that re-imports the parent's ``__main__`` (torch and all):
    about 5 s per rank here, ~20 s for four ranks on two cores. A forked Manager serves the
    same queue at once; its server process only relays queue items and never touches torch.

    The forked server inherits every file descriptor of its parent. In a Ray worker those
    include the worker's connection to Ray, so a server that outlived a killed worker kept
    Ray from noticing the death (the run hung instead of failing). Hence the server lives
    only for the save, and dies with its parent.
    """
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None
        manager.shutdown()


def _die_with_parent(parent: int) -> None:
    """In a forked helper: be killed when the process that forked it dies (Linux)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def save_model(chunks: list, ckpt_dir: str | Path) -> None:
    """Collective: every rank writes its shards of ``chunks`` into ``ckpt_dir``."""
    from megatron.core import dist_checkpointing

    with forked_write_results_queue():
        dist_checkpointing.save(model_sharded_state_dict(chunks), str(ckpt_dir))


def load_dist_checkpoint(sharded_state_dict: dict, ckpt_dir: str | Path) -> dict:
    """Collective: ``dist_checkpointing.load`` that runs no code from the checkpoint.

    Every load of a megarl checkpoint (convert, a role whose model path is a checkpoint,
    resume) goes through here: torch_dist pinned, metadata and objects unpickled restrictedly,
    ``common.pt`` read with ``weights_only=True`` (see megarl.platform.safe_checkpoint).
    """
    from megatron.core import dist_checkpointing

    from megarl.platform.safe_checkpoint import load_strategies

    sharded, common = load_strategies()
    return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir), sharded_strategy=sharded,
                                   common_strategy=common)


def load_model(chunks: list, ckpt_dir: str | Path, keep_output_layer: bool = False) -> None:
    """Collective: fills ``chunks`` from ``ckpt_dir`` at whatever layout they were built.
    ``keep_output_layer``: the chunks' output layer (a new value head on a language model's
    checkpoint) is not read and keeps its initialisation; everything else must be there."""
    sharded = model_sharded_state_dict(chunks)
    if keep_output_layer:
        sharded = {key: {k: v for k, v in sd.items() if not k.startswith("output_layer.")}
                   for key, sd in sharded.items()}
    loaded = load_dist_checkpoint(sharded, ckpt_dir)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys, strict=True):
        module = getattr(chunk, "module", chunk)
        missing, unexpected = module.load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not (keep_output_layer and k.startswith("output_layer."))]
        if missing or unexpected:
            raise RuntimeError(f"{ckpt_dir}: the checkpoint does not fit the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
