"""Loading megatron-core checkpoints without running code that came with them.

A megarl checkpoint is megatron-core's ``torch_dist`` format, and three of its files are
pickles that torch and megatron-core, left alone, unpickle with no restriction:

- ``.metadata``: torch.distributed.checkpoint's ``FileSystemReader.read_metadata`` calls
  plain ``pickle.load``;
- the byte items inside ``*.distcp`` (megatron's ShardedObjects, e.g. every layer's
  ``_extra_state``): ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``;
- ``common.pt``: megatron-core calls ``torch.load`` without ``weights_only``, which
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into a plain unpickle.

A checkpoint downloaded from someone else could run any code through each of them.
``install()`` routes the first two through restricted loaders (the metadata through an
unpickler that admits only checkpoint-metadata types, byte items through
``weights_only=True``), and ``load_strategies()`` gives megatron-core a common-state loader
that passes ``weights_only=True`` explicitly, which no environment variable overrides.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from pathlib import Path
from typing import IO, Any

import torch

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"

# (module, name) pairs a torch_dist ``.metadata`` pickle may name: plain dataclasses and
# enums of torch.distributed.checkpoint, torch.Size, dtypes and layouts. Unpickling
# these only builds records; none of them runs anything given its arguments.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
    },
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would have to run code (or is not what it claims) to load."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{self.source}: refused to load: it names {module}.{name}, which is not "
                                    "a checkpoint-metadata type (a checkpoint that would run code)")


def read_metadata_stream(stream: IO[bytes], source: str) -> Any:
    """The torch.distributed.checkpoint ``Metadata`` pickled in ``stream``, unpickled restrictedly."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(stream, source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a truncated or corrupt pickle raises any of several types
        raise UnsafeCheckpointError(f"{source}: not a readable checkpoint metadata file ({e})") from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(metadata).__name__}, not checkpoint metadata")
    _check_storage_paths(metadata, source)
    return metadata


def _check_storage_paths(metadata: Any, source: str) -> None:
    # Every data file must lie in the checkpoint directory itself: a path with a separator
    # or '..' would make the loader read some other file on this machine into the model.
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not path or "/" in path or "\\" in path or path in (".", ".."):
            raise UnsafeCheckpointError(f"{source}: data file {path!r} is not a file name inside the checkpoint")


def read_metadata(ckpt_dir: str | Path) -> Any:
    """The ``.metadata`` of a torch_dist checkpoint directory, unpickled restrictedly."""
    path = Path(ckpt_dir) / METADATA_FILE
    with open(path, "rb") as stream:
        return read_metadata_stream(stream, str(path))


def load_weights_only(source: str | Path | IO[bytes], what: str) -> Any:
    """``torch.load`` of tensors and plain containers only; anything else is refused by name."""
    try:
        # weights_only passed explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only changes the default.
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page of advice (including "load it unsafely"); keep the cause.
        named = re.search(r"GLOBAL (\S+) was not an allowed global", str(e))
        detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))
        cause = (f"it names {named.group(1)}, which is not a tensor or plain data" if named
                 else detail.group(1) if detail else (str(e).strip().splitlines() or [type(e).__name__])[0])
        raise UnsafeCheckpointError(f"{what}: refused to load with weights_only=True ({cause})") from e
    except FileNotFoundError:
        raise
    except Exception as e:  # a truncated or foreign file: torch raises one of several types
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnsafeCheckpointError(f"{what}: not a readable torch file ({type(e).__name__}: {first})") from e


def _safe_read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``FileSystemReader.read_metadata`` with the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = read_metadata_stream(stream, str(path))
    # What the reader promises its callers: storage_meta present, tagged with this load's id.
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _safe_load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``."""
    from torch.distributed.checkpoint import default_planner

    obj = load_weights_only(value, f"checkpoint object {read_item.dest_index.fqn!r}")
    if self.flatten_state_dict:
        default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


@functools.cache
def install() -> None:
    """Routes this process's torch_dist checkpoint reads through the restricted loaders (idempotent)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    FileSystemReader.read_metadata = _safe_read_metadata  # megatron's cached reader calls it too
    DefaultLoadPlanner.load_bytes = _safe_load_bytes  # megatron's MCoreLoadPlanner inherits it


def load_strategies() -> tuple[Any, Any]:
    """(sharded, common) load strategies for ``dist_checkpointing.load``: torch_dist, whatever
    the checkpoint's ``metadata.json`` names, and ``common.pt`` read with ``weights_only=True``."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    install()
    return TorchDistLoadShardedStrategy(), _weights_only_common_strategy()()


@functools.cache
def _weights_only_common_strategy() -> type:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class WeightsOnlyCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: str | Path) -> Any:
            path = Path(checkpoint_dir) / COMMON_FILE
            if not path.is_file():
                raise CheckpointingException(f"Common file {path} does not exist")
            return load_weights_only(path, str(path))

        def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path) -> Any:
            # torch_dist keeps ShardedObjects in its own files (read by load_bytes above); this
            # per-object torch.load path is for other backends, which megarl never loads.
            raise CheckpointingException("megarl loads ShardedObjects through the torch_dist strategy only")

    return WeightsOnlyCommonLoad
