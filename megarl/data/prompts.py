"""Prompt items and the loaders that make them (JSONL, Parquet, reasoning-gym).

A :class:`PromptItem` is either chat ``messages`` or plain ``prompt`` text, plus the
``metadata`` that rewards score against (``"answer"``: the reference answer;
``"entry"``: a reasoning-gym entry; any other fields of a JSONL row). Loaders check
every row and name the file and line of the first bad one, before training starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config.schema import DataConfig
from megarl.data.dataset import PromptDataset
from megarl.data.jsonl import jsonl_rows

ROLES = ("system", "user", "assistant", "tool")

DEFAULT_INSTRUCTION = "{question}\n\nGive the final answer inside <answer></answer>."


def instruction_problem(field: str, source: str, instruction: str) -> str | None:
    """Why a reasoning-gym ``instruction`` template cannot be used (it must hold ``{question}``),
    or None; ``field`` names it in the message."""
    if source.startswith("reasoning_gym:") and instruction and "{question}" not in instruction:
        return f"{field}={instruction!r} must contain {{question}}"
    return None


@dataclass
class PromptItem:
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = _item_problem(self.messages, self.prompt)
        if problem:
            raise ValueError(f"PromptItem: {problem}")


def _item_problem(messages: Any, prompt: Any) -> str | None:
    """What is wrong with a (messages, prompt) pair, or None; shared by the loaders."""
    if (messages is None) == (prompt is None):
        return "give exactly one of messages (chat) or prompt (plain text)"
    if prompt is not None:
        return None if isinstance(prompt, str) else f"prompt must be a string, got {type(prompt).__name__}"
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"messages[{i}] must be an object with a string 'content', got {message!r}"
        if message.get("role") not in ROLES:
            return f"messages[{i}] has role {message.get('role')!r}; roles are {', '.join(ROLES)}"
    return None


def _row_to_item(row: Any, where: str, prompt_key: str | None, messages_key: str | None,
                 metadata_keys: Sequence[str] | None) -> PromptItem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    key = messages_key if messages_key is not None else prompt_key
    if key not in row:
        raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(row)})")
    messages, prompt = (row[key], None) if messages_key is not None else (None, row[key])
    problem = _item_problem(messages, prompt)
    if problem:
        raise ValueError(f"{where}: {key!r}: {problem}")
    if metadata_keys is None:
        metadata = {k: v for k, v in row.items() if k != key}
    else:
        missing = [k for k in metadata_keys if k not in row]
        if missing:
            raise ValueError(f"{where}: missing metadata key {missing[0]!r} (keys: {sorted(row)})")
        metadata = {k: row[k] for k in metadata_keys}
    return PromptItem(messages=messages, prompt=prompt, metadata=metadata)


def _check_keys(prompt_key: str | None, messages_key: str | None) -> None:
    if (prompt_key is None) == (messages_key is None):
        raise ValueError("give exactly one of prompt_key (plain text) or messages_key (chat messages)")


def load_jsonl(path: str | Path, prompt_key: str | None = "prompt", messages_key: str | None = None,
               metadata_keys: Sequence[str] | None = None) -> list[PromptItem]:
    """One item per non-blank line. ``messages_key`` (set ``prompt_key=None``) reads chat
    messages instead of text; ``metadata_keys=None`` keeps every other field as metadata."""
    _check_keys(prompt_key, messages_key)
    items = [_row_to_item(row, where, prompt_key, messages_key, metadata_keys)
             for where, row in jsonl_rows(path, "prompt file")]
    if not items:
        raise ValueError(f"prompt file {path} has no rows")
    return items


def load_parquet(path: str | Path, prompt_key: str | None = "prompt", messages_key: str | None = None,
                 metadata_keys: Sequence[str] | None = None) -> list[PromptItem]:
    """Like :func:`load_jsonl` for a Parquet file (needs the optional ``pyarrow``)."""
    _check_keys(prompt_key, messages_key)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed (pip install pyarrow); "
                          "or convert the file to JSONL") from None
    rows = pq.read_table(path).to_pylist()
    items = [_row_to_item(row, f"{path}: row {index}", prompt_key, messages_key, metadata_keys)
             for index, row in enumerate(rows)]
    if not items:
        raise ValueError(f"prompt file {path} has no rows")
    return items


def load_prompts(path: str | Path, **kwargs: Any) -> list[PromptItem]:
    """:func:`load_jsonl` or :func:`load_parquet` by the file's suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return load_jsonl(path, **kwargs)
    if suffix in (".parquet", ".pq"):
        return load_parquet(path, **kwargs)
    raise ValueError(f"prompt file {path}: unknown format {suffix!r} (use .jsonl or .parquet)")


def from_reasoning_gym(name: str, size: int, seed: int, instruction_template: str = DEFAULT_INSTRUCTION,
                       system_prompt: str | None = None, **dataset_config: Any) -> list[PromptItem]:
    """Chat prompts for a reasoning-gym task.

    The user message is ``instruction_template`` with ``{question}`` replaced by the
    entry's question (plain replacement, so other braces in the template or question
    are left alone). Metadata: ``answer`` (the reference), ``dataset`` (the task name)
    and ``entry`` (the whole entry, which ``ReasoningGymReward`` scores against).
    """
    if "{question}" not in instruction_template:
        raise ValueError(f"instruction_template must contain '{{question}}', got {instruction_template!r}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"reasoning-gym size must be a positive integer, got {size!r}")
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **dataset_config)
    except ValueError as exc:
        raise ValueError(f"reasoning-gym dataset {name!r}: {exc}") from exc
    items = []
    for entry in dataset:
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": instruction_template.replace("{question}", entry["question"])})
        items.append(PromptItem(messages=messages,
                                metadata={"answer": entry["answer"], "dataset": name, "entry": entry}))
    return items


def from_verifiers(source: str, options: dict[str, Any]) -> list[PromptItem]:
    """``verifiers:<environment>[@eval]``: the environment's own dataset as plain-text items (it
    formats each question its own way when it plays the episode); ValueError, one line."""
    from megarl.data.verifiers_source import verifiers_questions

    questions = verifiers_questions(source, options)
    return [PromptItem(prompt=question, metadata=metadata) for question, metadata in questions]


def prompt_dataset(data: DataConfig) -> PromptDataset[PromptItem]:
    """The run's prompt stream as ``data`` describes it: a reasoning-gym task, a verifiers
    environment's own dataset or a prompt file."""
    from megarl.data.verifiers_source import is_verifiers_source

    if is_verifiers_source(data.source):
        items = from_verifiers(data.source, data.task_config)
    elif data.source.startswith("reasoning_gym:"):
        items = from_reasoning_gym(data.source.split(":", 1)[1], size=data.size, seed=data.seed,
                                   instruction_template=data.instruction or DEFAULT_INSTRUCTION,
                                   system_prompt=data.system_prompt, **data.task_config)
    else:
        items = load_prompts(data.source, prompt_key=data.prompt_key)
    return PromptDataset(items, batch_size=data.prompts_per_step, seed=data.seed)
