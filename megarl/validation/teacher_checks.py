"""The teacher of on-policy distillation against the actor: one tokenizer for both.

The teacher scores the actor's sampled token ids; under another tokenizer those ids are other
strings, and its log-probs would be of text nobody wrote. A larger model of the same family (its
embedding padded to another size) is fine: only the ids the tokenizer writes are compared."""

from __future__ import annotations

from pathlib import Path

from megarl.config.schema import RunConfig
from megarl.models.hf_arch import ModelArch

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _hf_folder(path: str) -> Path:
    """Where a model path's tokenizer lives: an HF folder, a megarl checkpoint's ``hf/``, ``bundled:NAME``."""
    from megarl.convert.checkpoint import is_megarl_checkpoint
    from megarl.models.bundled import resolve_model_path

    folder = resolve_model_path(path)
    return folder / "hf" if is_megarl_checkpoint(folder) else folder


def _vocab(folder: Path) -> dict[str, int] | None:
    """The tokenizer's token -> id mapping (added tokens included); None where the folder has none."""
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).get_vocab()


def teacher_errors(cfg: RunConfig, archs: dict[str, ModelArch]) -> list[str]:
    """A teacher whose tokenizer is not the actor's, in one line; [] without a teacher. Where either
    folder holds no tokenizer (a path on a cluster file system, ``model.arch`` declared), their
    vocabulary sizes are compared instead."""
    if cfg.teacher is None or "teacher" not in archs or "actor" not in archs:
        return []
    actor, teacher = _hf_folder(cfg.actor.model.path), _hf_folder(cfg.teacher.model.path)
    if actor.resolve() == teacher.resolve():
        return []
    try:
        ours, theirs = _vocab(actor), _vocab(teacher)
    except (OSError, ValueError) as e:
        return [f"teacher.model.path: its tokenizer or the actor's cannot be read: {' '.join(str(e).split())}"]
    if ours is not None and theirs is not None:
        if ours == theirs:
            return []
        differ = sorted(set(ours.items()) ^ set(theirs.items()))
        return [f"teacher.model.path: its tokenizer ({len(theirs)} tokens) is not the actor's ({len(ours)} tokens; "
                f"{len(differ)} token ids differ, e.g. {differ[0][0]!r}): the teacher must score the actor's token "
                "ids as the same text"]
    if archs["teacher"].vocab_size != archs["actor"].vocab_size:
        return [f"teacher.model.path: its vocabulary ({archs['teacher'].vocab_size}) is not the actor's "
                f"({archs['actor'].vocab_size}), and no tokenizer is there to compare: the teacher must share the "
                "actor's tokenizer"]
    return []
