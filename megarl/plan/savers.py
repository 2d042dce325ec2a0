"""Memory savers a trained role can use, as the search weighs them: activation recompute
(none, selective attention core, full recompute of some or all of a stage's layers by
megatron-core's block method, or every layer) and optimizer CPU offload (none, half, all).

Each option is a Workload (what memory sees) and a TrainCost (what step time sees); the
search tries a layout's options from the cheapest in estimated time and keeps the first
that fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.plan.memory import Workload
from megarl.plan.steptime import TrainCost

OFFLOAD_FRACTIONS = (0.0, 0.5, 1.0)


@dataclass(frozen=True)
class Saver:
    recompute: str = "none"  # none | selective | full
    method: str = "uniform"  # full: uniform | block
    layers: int = 1  # full: per unit (uniform) or recomputed per stage (block)
    offload: float = 0.0

    def describe(self) -> str:
        if self.recompute == "full":
            rc = f"full ({self.method}, {self.layers} layer{'s' if self.layers > 1 else ''})"
        else:
            rc = self.recompute
        return f"recompute={rc}, optimizer offload={self.offload:g}"

    def workload(self, base: Workload) -> Workload:
        return replace(base, recompute=self.recompute, recompute_method=self.method,
                       recompute_layers=self.layers, offload_fraction=self.offload)

    def cost(self, stage_layers: int) -> TrainCost:
        share = 1.0 if self.method == "uniform" else min(1.0, self.layers / max(stage_layers, 1))
        return TrainCost(recompute=self.recompute, recompute_fraction=share, offload_fraction=self.offload)


def savers(stage_layers: int) -> list[Saver]:
    """Every option for a stage of ``stage_layers`` layers (block recompute of a quarter, half, all)."""
    recompute = [Saver(), Saver("selective")]
    blocks = sorted({max(1, stage_layers * k // 4) for k in (1, 2, 3)} - {stage_layers})
    recompute += [Saver("full", "block", n) for n in blocks]
    recompute.append(Saver("full", "uniform", 1))
    return [replace(r, offload=f) for r in recompute for f in OFFLOAD_FRACTIONS]


def most_saving() -> Saver:
    """Full recompute of every layer and the whole optimizer on the host."""
    return Saver("full", "uniform", 1, 1.0)
