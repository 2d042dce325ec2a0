"""Qwen2 / Qwen2.5: a Llama-style decoder with biases on q, k and v (none on o_proj).

Its config always carries ``attention_bias``-free q/k/v biases, and a ``sliding_window``
that applies only with ``use_sliding_window`` (per-layer windows, not supported).
"""

from __future__ import annotations

from typing import Any

from megarl.models.arch import ArchError
from megarl.models.families.base import DecoderFamily


def qwen_sliding_window(cfg: dict[str, Any], source: str, name: str) -> None:
    """Qwen configs carry a ``sliding_window`` that only ``use_sliding_window`` turns on, and
    then for some layers only (``max_window_layers``): refused; otherwise there is no window."""
    if cfg.get("use_sliding_window"):
        raise ArchError(f"{source}: use_sliding_window=true ({name} per-layer windows) is not supported")


class Qwen2Family(DecoderFamily):
    def read_hf_config(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        # attention_bias is not a Qwen2 field: its q/k/v biases are always there
        qwen_sliding_window(cfg, source, "Qwen2")
        return {"qkv_bias": True, "sliding_window": None}


FAMILY = Qwen2Family("qwen2")
