"""Reading and writing Hugging Face safetensors checkpoints.

The reader opens every shard lazily and reads only the slices asked for, so a
rank converting its own shard reads only its own bytes. Only safetensors are
read: pickled ``.bin`` checkpoints are refused rather than unpickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.convert.mapping import IGNORED_HF_TENSORS, Recipe
from megarl.models.hf_arch import ArchError

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


class HFReader:
    """Lazy, slice-wise access to the tensors of an HF safetensors checkpoint."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            weight_map = None
        else:
            pickled = sorted(p.name for p in self.dir.glob("*.bin"))
            extra = (f" (found {', '.join(pickled)}: pickled checkpoints are not read; re-save them "
                     "with save_pretrained(safe_serialization=True))") if pickled else ""
            raise ArchError(f"{self.dir}: no model.safetensors or model.safetensors.index.json{extra}")
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        if weight_map is None:
            self._open("model.safetensors")
            for name in self._files["model.safetensors"].keys():
                self._where[name] = "model.safetensors"
        else:
            self._where = dict(weight_map)
        self.bytes_read = 0

    def _open(self, file: str):
        if file not in self._files:
            path = self.dir / file
            if not path.is_file():
                raise ArchError(f"{path} is listed in the checkpoint index but does not exist")
            try:
                self._files[file] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type for corrupt files
                raise ArchError(f"{path} is not a readable safetensors file: {e}") from e
        return self._files[file]

    def names(self) -> list[str]:
        return [n for n in self._where if not IGNORED_HF_TENSORS.match(n)]

    def _slice(self, name: str):
        if name not in self._where:
            raise ArchError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self._open(self._where[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._slice(name).get_dtype()]

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        sl = self._slice(name)
        shape = sl.get_shape()
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, stop)
        tensor = sl[tuple(index)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_shard(self, rec: Recipe, dtype: torch.dtype) -> torch.Tensor:
        """Assembles the shard described by ``rec``, reading only its pieces."""
        parts = []
        for piece in rec.pieces:
            if piece.hf is None:
                shape = list(rec.shape)
                shape[rec.dim] = piece.length
                parts.append(torch.zeros(shape, dtype=dtype))
            else:
                parts.append(self.read(piece.hf, rec.dim, piece.start, piece.stop).to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=rec.dim)


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
    """Copies config, tokenizer and generation files that exist in ``src``."""
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
