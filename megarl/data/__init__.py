"""Prompt data: loaders, the resumable per-step dataset, tokenization, micro-batching and packing."""

from megarl.data.batching import PackedRows, pack_sequences, pad_right, token_budget_microbatches
from megarl.data.dataset import PromptDataset
from megarl.data.prompts import (
    DEFAULT_INSTRUCTION,
    PromptItem,
    from_reasoning_gym,
    load_jsonl,
    load_parquet,
    load_prompts,
)
from megarl.data.tokenize import TokenizedPrompts, encode_prompt, tokenize_prompts

__all__ = [
    "DEFAULT_INSTRUCTION",
    "PackedRows",
    "PromptDataset",
    "PromptItem",
    "TokenizedPrompts",
    "encode_prompt",
    "from_reasoning_gym",
    "load_jsonl",
    "load_parquet",
    "load_prompts",
    "pack_sequences",
    "pad_right",
    "token_budget_microbatches",
    "tokenize_prompts",
]
