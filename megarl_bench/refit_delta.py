"""``megarl bench refit --delta-lr``: how much of a bf16 shard each real optimizer step changes.

A changed-bytes-only sync sends, per shard, only the elements whose bf16 value differs from
what the engine holds. What it could save depends on how many bf16 values an update moves:
Adam's first steps move every weight by about ``lr``, and a bf16 weight ``w`` changes only
when its fp32 master weight crosses a rounding boundary (spacing about ``|w| * 2**-8``). This
module measures it on the actor's own shards (what the sync sends) around each of a few steps
of the actor's optimizer,
and prices two encodings against sending the shard whole (2 bytes an element):
- positions + values: an int32 index and a bf16 value per changed element (6 bytes);
- bitmask + values: one bit per element and a bf16 value per changed one.
"""

from __future__ import annotations

import torch

from megarl.reshard.source import source_tensors
from megarl.workers.megatron_model import held
from megarl.workers.state import state

_KEY = "refit_delta_snapshot"


def snapshot(key: str) -> None:
    """Actor rank function: keeps this rank's sent shards as bf16 (what a bf16 engine holds)."""
    model = held(key)
    state[_KEY] = {name: t.detach().to(torch.bfloat16).clone()
                   for name, t in source_tensors(model.chunks, model.spec, model.info).items()}


def changed(key: str) -> dict[str, int]:
    """Actor rank function: elements of this rank's sent shards, and how many differ in bf16 from
    the snapshot (the snapshot is dropped)."""
    model = held(key)
    return count_changed(state.pop(_KEY), source_tensors(model.chunks, model.spec, model.info))


def count_changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, int]:
    """Elements of ``after`` and how many differ from ``before`` once both are bf16, bit for bit
    (as a sync would compare them: -0.0 and 0.0 differ, which is what the engine would hold)."""
    elements = moved = 0
    for name, t in after.items():
        now = t.detach().to(torch.bfloat16)
        elements += now.numel()
        moved += int((now.view(torch.int16) != before[name].to(torch.bfloat16).view(torch.int16)).sum())
    return {"elements": elements, "changed": moved}


def delta_summary(parts: list[dict[str, int] | None], lr: float) -> dict[str, float]:
    """Sums the ranks' counts: the changed fraction and each encoding's bytes / the full bf16 bytes."""
    elements = sum(p["elements"] for p in parts if p)
    moved = sum(p["changed"] for p in parts if p)
    full = 2 * elements
    return {"lr": lr, "elements": elements, "changed": moved, "changed_fraction": moved / elements,
            "positions_values_bytes_ratio": 6 * moved / full,
            "bitmask_values_bytes_ratio": (elements / 8 + 2 * moved) / full}


def measure(actor, key: str, vocab_size: int, lr: float, steps: int = 3, seed: int = 0) -> list[dict[str, float]]:
    """``steps`` real optimizer steps of next-token loss on random tokens at ``lr``; the bf16 change
    each made against the one before (what each step's sync would send). Not one step alone: the
    first starts from weights that are exact bf16 values (a bf16 checkpoint), so it must move a
    weight half a spacing to change it; later steps start from fp32 master weights anywhere inside
    a spacing, and change about ``step / spacing`` of them."""
    from megarl.workers import megatron_model

    out = []
    for step in range(steps):
        tokens = torch.randint(0, vocab_size, (4, 33), generator=torch.Generator().manual_seed(seed + step))
        actor.run(snapshot, key=key)
        actor.run(megatron_model.lm_train_step, key=key, tokens=tokens, lr=lr)
        out.append(delta_summary(actor.run(changed, key=key), lr))
    return out
