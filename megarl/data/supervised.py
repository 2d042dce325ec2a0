"""Datasets of the supervised stages: SFT conversations and preference pairs, tokenized with the
model's chat template, with the completion (assistant) tokens marked for the loss.

Records (JSON Lines, one per line, or Parquet rows; ``reasoning_gym:<task>`` generates them instead):

- SFT: ``{"messages": [{"role", "content"}, ...]}`` with at least one assistant message (every
  assistant message is trained on, multi-turn included), or ``{"prompt": text, "response": text}``
  (``completion`` is accepted for ``response``), with an optional ``system`` text;
- pairs (reward model, DPO): ``{"prompt": text or "messages": [...], "chosen": text,
  "rejected": text}``, optional ``system`` and ``margin`` (a number: how much better the chosen
  answer is, for the reward model's margin loss).

Assistant spans come from rendering the conversation's prefixes: the tokens of a prefix ending
in an assistant message minus those of the same prefix ending at the assistant header. A chat
template that does not render prefixes as prefixes is refused, naming the line, as is any
record with a missing or mistyped field or longer than ``max_len`` tokens (never truncated
silently). Everything is checked before any process starts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from megarl.data.jsonl import jsonl_rows
from megarl.data.prompts import ROLES


@dataclass(frozen=True)
class TokenSeq:
    tokens: tuple[int, ...]
    completion: tuple[int, ...]  # 1 where the token is trained on (an assistant message's)


@dataclass(frozen=True)
class SftExample:
    seq: TokenSeq
    where: str  # path:line, or the generated record's index


@dataclass(frozen=True)
class PairExample:
    chosen: TokenSeq
    rejected: TokenSeq
    where: str
    margin: float | None = None


class DataError(ValueError):
    """A record the stage cannot use; the message names the file and line (or the record)."""


def _messages(value: Any, where: str, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{field}' must be a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {field}[{i}] must have a role ({', '.join(ROLES)}) and content text")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: '{key}' is missing or not a non-empty text")
    return value


def _system(record: dict, where: str) -> list[dict[str, str]]:
    if "system" not in record:
        return []
    return [{"role": "system", "content": _text(record, "system", where)}]


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def conversation(tokenizer: Any, messages: list[dict[str, str]], where: str, max_len: int) -> TokenSeq:
    """The conversation's tokens with every assistant message's tokens (its end marker included)
    marked as completion."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    tokens = _render(tokenizer, messages, generation_prompt=False)
    completion = [0] * len(tokens)
    for i in assistant:
        head = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[:i + 1], generation_prompt=False)
        if tokens[:len(upto)] != upto or upto[:len(head)] != head:
            raise DataError(f"{where}: the chat template does not render the conversation's prefixes as its "
                            f"prefixes (message {i}), so the assistant tokens cannot be told apart")
        completion[len(head):len(upto)] = [1] * (len(upto) - len(head))
    if len(tokens) > max_len:
        raise DataError(f"{where}: {len(tokens)} tokens, more than data.max_len={max_len}")
    return TokenSeq(tuple(tokens), tuple(completion))


def sft_example(record: Any, tokenizer: Any, where: str, max_len: int) -> SftExample:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object")
    if "messages" in record:
        messages = _messages(record["messages"], where, "messages")
    else:
        response_key = "response" if "response" in record or "completion" not in record else "completion"
        messages = [*_system(record, where), {"role": "user", "content": _text(record, "prompt", where)},
                    {"role": "assistant", "content": _text(record, response_key, where)}]
    return SftExample(conversation(tokenizer, messages, where, max_len), where)


def pair_example(record: Any, tokenizer: Any, where: str, max_len: int) -> PairExample:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object")
    if "messages" in record:
        context = _messages(record["messages"], where, "messages")
        if context[-1]["role"] != "user":
            raise DataError(f"{where}: 'messages' must end with the user's message the answers reply to")
    else:
        context = [*_system(record, where), {"role": "user", "content": _text(record, "prompt", where)}]
    chosen, rejected = _text(record, "chosen", where), _text(record, "rejected", where)
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)
                               or not math.isfinite(margin)):
        raise DataError(f"{where}: 'margin' must be a finite number")
    return PairExample(conversation(tokenizer, [*context, {"role": "assistant", "content": chosen}], where, max_len),
                       conversation(tokenizer, [*context, {"role": "assistant", "content": rejected}], where,
                                    max_len), where, None if margin is None else float(margin))


def generated_records(source: str, stage: str, size: int, seed: int, instruction: str,
                      task_config: dict) -> list[tuple[str, dict]]:
    """Records of a reasoning-gym task: SFT answers the question with the reference answer; a pair
    prefers it to a wrong one (a nearby number for a numeric answer, else another question's)."""
    from megarl.data.prompts import DEFAULT_INSTRUCTION, from_reasoning_gym

    name = source.split(":", 1)[1]
    items = from_reasoning_gym(name, size=size, seed=seed, instruction_template=instruction or DEFAULT_INSTRUCTION,
                               **task_config)
    rng = random.Random(seed)
    records = []
    for index, item in enumerate(items):
        answer = str(item.metadata["answer"])
        record: dict[str, Any] = {"messages": item.messages}
        if stage == "sft":
            record["messages"] = [*item.messages, {"role": "assistant", "content": answer}]
        else:
            try:
                wrong = str(int(answer) + rng.choice([-1, 1]) * rng.randint(1, 10))
            except ValueError:
                others = [str(i.metadata["answer"]) for i in items if str(i.metadata["answer"]) != answer]
                wrong = rng.choice(others) if others else answer + "?"
            record |= {"chosen": answer, "rejected": wrong}
        records.append((f"{source} record {index}", record))
    return records


def load_examples(source: str, stage: str, tokenizer: Any, max_len: int, size: int = 0, seed: int = 0,
                  instruction: str = "", task_config: dict | None = None) -> list[SftExample] | list[PairExample]:
    """Every record of ``source`` (a JSONL file or ``reasoning_gym:<task>``) as the stage's examples."""
    if source.startswith("reasoning_gym:"):
        records = generated_records(source, stage, size, seed, instruction, task_config or {})
    elif source.lower().endswith((".parquet", ".pq")):
        records = parquet_rows(source)
    else:
        records = list(jsonl_rows(source))
    make = sft_example if stage == "sft" else pair_example
    examples = [make(record, tokenizer, where, max_len) for where, record in records]
    if not examples:
        raise DataError(f"{source} has no records")
    return examples


def parquet_rows(path: str) -> list[tuple[str, Any]]:
    """(``path: row i``, record) of a Parquet file's rows (needs the optional ``pyarrow``)."""
    from pathlib import Path

    if not Path(path).is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to JSONL") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]


def collate(seqs: list[TokenSeq], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``tokens`` [B, L], ``mask`` [B, L-1] over label positions whose token is a
    completion token, ``seq_lens`` [B]."""
    width = max(len(s.tokens) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1)
    for row, s in enumerate(seqs):
        tokens[row, :len(s.tokens)] = torch.tensor(s.tokens)
        mask[row, :len(s.tokens) - 1] = torch.tensor(s.completion[1:], dtype=torch.float)
    return {"tokens": tokens, "mask": mask, "seq_lens": torch.tensor([len(s.tokens) for s in seqs])}


def pair_batch(pairs: list[PairExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Pairs on consecutive rows, chosen first (``megarl.workers.preference_fns``), with each pair's
    ``margin`` on both its rows when any pair has one."""
    batch = collate([s for p in pairs for s in (p.chosen, p.rejected)], pad_id)
    if any(p.margin is not None for p in pairs):
        batch["margin"] = torch.tensor([p.margin or 0.0 for p in pairs for _ in (0, 1)])
    return batch


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples of optimizer step ``step`` (from 0): each epoch a fresh permutation of all
    ``n`` (seeded by ``seed`` and the epoch), cut into ``n // batch_size`` batches (the remainder
    of an epoch is left out). A pure function of the step, so a resumed run continues exactly."""
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[k * batch_size:(k + 1) * batch_size]
