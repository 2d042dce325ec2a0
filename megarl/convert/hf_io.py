"""Reading and writing Hugging Face safetensors checkpoints.

The reader parses the safetensors header itself and reads only the rows (or row
segments) a shard needs, with plain file reads straight into the destination
tensor: a rank converting its shard reads only its own bytes, and no second copy
of the weights (not even memory-mapped pages) is held while loading. Only
safetensors are read: pickled ``.bin`` checkpoints are refused rather than
unpickled.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from megarl.convert.mapping import IGNORED_HF_TENSORS, Recipe
from megarl.models.hf_arch import ArchError
from megarl.utils.atomic import make_user_readable

# Files copied next to the weights on export (tokenizer, chat template, generation defaults).
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _SafetensorsFile:
    """One .safetensors file: its header, and positioned reads of tensor regions."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ArchError(f"{path} is not a readable safetensors file: too short")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise ArchError(f"{path} is not a readable safetensors file: header runs past the end")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ArchError(f"{path} is not a readable safetensors file: bad header ({e})") from e
        if not isinstance(header, dict):
            raise ArchError(f"{path} is not a readable safetensors file: the header is not a JSON object")
        header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for name, entry in header.items():
            dtype, shape, begin, stop = _header_entry(path, name, entry)
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            if stop - begin != nbytes or self.data_start + stop > size:
                raise ArchError(f"{path} is not a readable safetensors file: tensor {name} does not fit "
                                f"the file (truncated or corrupt)")
            self.tensors[name] = (dtype, shape, self.data_start + begin)
        self._fd = os.open(path, os.O_RDONLY)

    def read_into(self, name: str, dim: int, start: int, stop: int, out: torch.Tensor) -> int:
        """Reads ``tensor[name]`` sliced to ``[start, stop)`` along ``dim`` into ``out``; returns bytes."""
        dtype, shape, offset = self.tensors[name]
        if out.dtype != dtype or out.device.type != "cpu" or not _rows_contiguous(out, dim):
            staging = torch.empty(out.shape, dtype=dtype)
            moved = self.read_into(name, dim, start, stop, staging)
            out.copy_(staging)
            return moved
        item = out.element_size()
        if dim == 0:  # one run of bytes
            row = math.prod(shape[1:]) * item
            _pread_into(self._fd, offset + start * row, out, (stop - start) * row)
            return (stop - start) * row
        # dim 1 of a 2-D tensor: one run per row
        segment = (stop - start) * item
        for r in range(shape[0]):
            _pread_into(self._fd, offset + (r * shape[1] + start) * item, out[r], segment)
        return shape[0] * segment

    def close(self) -> None:
        os.close(self._fd)


def _header_entry(path: Path, name: str, entry: object) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, stop) of one header entry, each checked for type and range."""
    bad = f"{path} is not a readable safetensors file: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ArchError(f"{bad} has no header entry (got {entry!r})")
    if entry.get("dtype") not in _DTYPES:
        raise ArchError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_natural(n) for n in shape):
        raise ArchError(f"{bad} has a bad 'shape' {shape!r} (a list of non-negative integers)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(n) for n in offsets) \
            or offsets[0] > offsets[1]:
        raise ArchError(f"{bad} has bad 'data_offsets' {offsets!r} ([begin, end], 0 <= begin <= end)")
    return _DTYPES[entry["dtype"]], tuple(shape), offsets[0], offsets[1]


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rows_contiguous(out: torch.Tensor, dim: int) -> bool:
    # dim 0: the whole slice is one run of bytes; dim 1 of a 2-D tensor: each row is.
    if dim == 0:
        return out.is_contiguous()
    if dim != 1 or out.dim() != 2:
        raise ValueError(f"slicing along dim {dim} of a {out.dim()}-D tensor is not supported")
    return out.stride(1) == 1


def _pread_into(fd: int, position: int, target: torch.Tensor, nbytes: int) -> None:
    # A raw buffer over the tensor's bytes, not ``.numpy()``: exporting to numpy marks the
    # storage non-resizable for good, and colocated offload frees storages by resizing them.
    if target.numel() and not target.is_contiguous():
        raise ValueError("_pread_into needs a contiguous target")
    raw = (ctypes.c_char * (target.numel() * target.element_size())).from_address(target.data_ptr())
    view = memoryview(raw).cast("B") if target.numel() else memoryview(b"")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], position + done)
        if n <= 0:
            raise ArchError(f"unexpected end of file reading {nbytes} bytes at offset {position}")
        done += n


def _read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: tensor name -> a file name in the same folder."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArchError(f"{index} is not valid JSON: {e}") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ArchError(f"{index}: no 'weight_map' object (tensor name -> file)")
    for name, file in weight_map.items():
        # A plain file name: a path would read weights from elsewhere on this machine.
        if not isinstance(file, str) or not file.endswith(".safetensors") or Path(file).name != file:
            raise ArchError(f"{index}: weight_map[{name!r}] = {file!r} is not a .safetensors file name "
                            "in the model folder")
    return weight_map


class HFReader:
    """Slice-wise access to the tensors of an HF safetensors checkpoint."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_weight_map(index)
        elif (self.dir / "model.safetensors").is_file():
            weight_map = None
        else:
            pickled = sorted(p.name for p in self.dir.glob("*.bin"))
            extra = (f" (found {', '.join(pickled)}: pickled checkpoints are not read; re-save them "
                     "with save_pretrained(safe_serialization=True))") if pickled else ""
            raise ArchError(f"{self.dir}: no model.safetensors or model.safetensors.index.json{extra}")
        self._files: dict[str, _SafetensorsFile] = {}
        try:
            if weight_map is None:
                self._where = {name: "model.safetensors" for name in self._open("model.safetensors").tensors}
            else:
                self._where = dict(weight_map)
                for file in sorted(set(weight_map.values())):
                    self._open(file)
        except BaseException:
            self.close()
            raise
        self.bytes_read = 0

    def _open(self, file: str) -> _SafetensorsFile:
        if file not in self._files:
            path = self.dir / file
            if not path.is_file():
                raise ArchError(f"{path} is listed in the checkpoint index but does not exist")
            self._files[file] = _SafetensorsFile(path)
        return self._files[file]

    def names(self) -> list[str]:
        return [n for n in self._where if not IGNORED_HF_TENSORS.match(n)]

    def _entry(self, name: str) -> tuple[_SafetensorsFile, torch.dtype, tuple[int, ...]]:
        if name not in self._where:
            raise ArchError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        file = self._open(self._where[name])
        if name not in file.tensors:
            raise ArchError(f"{file.path}: tensor {name!r} listed in the index is not in the file")
        dtype, shape, _ = file.tensors[name]
        return file, dtype, shape

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[1]

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        file, dtype, shape = self._entry(name)
        start = 0 if start is None else start
        stop = shape[dim] if stop is None else stop
        out_shape = list(shape)
        out_shape[dim] = stop - start
        out = torch.empty(out_shape, dtype=dtype)
        self.bytes_read += file.read_into(name, dim, start, stop, out)
        return out

    def read_shard_into(self, rec: Recipe, out: torch.Tensor) -> None:
        """Fills ``out`` (shaped like the shard) with the pieces of ``rec``, read in place."""
        offset = 0
        for piece in rec.pieces:
            target = out.narrow(rec.dim, offset, piece.length)
            offset += piece.length
            if piece.hf is None:
                target.zero_()
                continue
            file, _, _ = self._entry(piece.hf)
            self.bytes_read += file.read_into(piece.hf, rec.dim, piece.start, piece.stop, target)

    def read_shard(self, rec: Recipe, dtype: torch.dtype) -> torch.Tensor:
        """The shard described by ``rec`` as a new tensor."""
        out = torch.empty(rec.shape, dtype=dtype)
        self.read_shard_into(rec, out)
        return out

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files = {}


def check_hf_checkpoint(reader: HFReader, expected: dict[str, tuple[int, ...]]) -> None:
    """Refuses a checkpoint whose tensors differ from what its config.json describes."""
    problems = []
    present = set(reader.names())
    for name, shape in expected.items():
        if name not in present:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif reader.shape(name) != shape:
            problems.append(f"{name}: shape {list(reader.shape(name))} in the checkpoint, "
                            f"{list(shape)} from config.json")
    # A tied checkpoint may still carry lm_head (some exporters write it): it must have the
    # embedding's shape; nothing else may be extra.
    embed = expected.get("model.embed_tokens.weight")
    if "lm_head.weight" in present and "lm_head.weight" not in expected and embed is not None \
            and reader.shape("lm_head.weight") != embed:
        problems.append(f"lm_head.weight: shape {list(reader.shape('lm_head.weight'))} differs from "
                        f"the tied embedding {list(embed)}")
    extra = sorted(present - set(expected) - {"lm_head.weight"})
    problems += [f"unexpected tensor {name} (not part of the architecture in config.json)" for name in extra]
    if problems:
        head = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        raise ArchError(f"{reader.dir} does not match its config.json:\n  " + "\n  ".join(head))


class HFWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` (plus an index)."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 1024**3):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.bytes_written = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size

    def _flush(self) -> None:
        file = f"part-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(self.dir / file), metadata={"format": "pt"})
        make_user_readable(self.dir / file)  # safetensors writes through a 0600 temporary file
        self._shards.append((file, list(self._pending)))
        self.bytes_written += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        if len(self._shards) == 1:
            (self.dir / self._shards[0][0]).rename(self.dir / "model.safetensors")
            return
        weight_map, n = {}, len(self._shards)
        for i, (file, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.dir / file).rename(self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.bytes_written}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copies config, tokenizer and generation files that exist in ``src``.

    Contents only: each copy gets the mode of a new file under the user's umask, not the
    source's (a cache file may be 0600)."""
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
