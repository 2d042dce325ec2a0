"""The trainable tensors of a LoRA role, for the memory planner: with the base frozen, only the
adapters have gradients (DDP's buffer) and optimizer state; the base weights stay as they are.

Counted as ``megarl.models.lora`` builds them: a column-parallel target (q/k/v/gate/up) keeps A
[r, in] whole and B [its rows on the rank, r]; a row-parallel one (o/down) A [r, in / tp] and B
[out, r] whole.
"""

from __future__ import annotations

from megarl.models.hf_arch import ModelArch

ROW_PARALLEL = ("o_proj", "down_proj")


def _target_shape(arch: ModelArch, target: str, tp: int) -> tuple[int, int]:
    """(output rows, input columns) of ``target``'s HF tensor on one tensor-parallel rank."""
    hidden, q = arch.hidden_size, arch.num_heads * arch.head_dim
    # k/v: a rank holds its query groups' heads, one group's at least (replicated past tp > groups)
    kv = max(arch.num_kv_heads // tp, 1) * arch.head_dim
    return {"q_proj": (q // tp, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q // tp), "gate_proj": (arch.ffn_hidden_size // tp, hidden),
            "up_proj": (arch.ffn_hidden_size // tp, hidden), "down_proj": (hidden, arch.ffn_hidden_size // tp)}[target]


def layer_adapter_tensors(arch: ModelArch, tp: int, rank: int, targets: tuple[str, ...]) -> list[int]:
    """Element counts of one layer's A and B tensors on one tensor-parallel rank."""
    out: list[int] = []
    for target in targets:
        rows, cols = _target_shape(arch, target, tp)
        out += [rank * cols, rows * rank]
    return out
