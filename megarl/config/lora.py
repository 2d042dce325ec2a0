"""The ``lora`` section of a trained role: low-rank adapters on its linear layers, the base frozen.

Target modules are named as PEFT names them on a Hugging Face Llama-style model; megarl maps each
onto the rows (or columns) of megatron-core's fused linears that hold it (``megarl.models.lora``),
so an adapter on ``q_proj`` alone touches only the query rows of ``linear_qkv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)


@dataclass
class LoraConfig:
    rank: int = 0  # 0: no adapters, the whole model trains
    alpha: float = 16.0  # the update is scaled by alpha / rank, as PEFT does
    dropout: float = 0.0  # on each adapter's input, in training only
    target_modules: list[LoraTarget] = field(default_factory=lambda: list(LORA_TARGETS))  # PEFT's names
    seed: int = 0  # the adapters' initialisation (A: PEFT's Kaiming-uniform; B: zeros)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def errors(self, where: str) -> list[str]:
        """One line per bad setting, naming the field."""
        out = []
        if self.rank < 0:
            out.append(f"{where}.rank must be >= 0 (0: no adapters), got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"{where}.dropout must be in [0, 1), got {self.dropout}")
        if self.enabled and not self.target_modules:
            out.append(f"{where}.target_modules is empty: name at least one of {', '.join(LORA_TARGETS)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            out.append(f"{where}.target_modules names a module twice: {self.target_modules}")
        return out
