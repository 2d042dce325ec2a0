"""Metrics of a run: console, ``metrics.jsonl``, TensorBoard, wandb (when installed), plots.

``metrics.jsonl`` holds one JSON object per step (keys such as ``reward/mean``); a
resumed run first cuts it back to the checkpoint's step, so the file reads as if
the run had never stopped.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

CONSOLE_KEYS = ("reward/mean", "kl/mean", "entropy/mean", "actor/clip_fraction", "response/length_mean",
                "tool/call_fraction", "model/sft_loss", "model/rm_loss", "model/dpo_loss", "eval/heldout/loss",
                "time/step_s", "throughput/tokens_per_s")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, config: dict[str, Any], tensorboard: bool = True,
                 wandb: bool = True, resume_step: int = 0, run_name: str = "megarl"):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._truncate(resume_step)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=resume_step + 1)
        self._wandb = None
        if wandb and importlib.util.find_spec("wandb") is not None:
            import wandb as wandb_module

            self._wandb = wandb_module.init(project="megarl", name=run_name, config=config, dir=str(self.dir),
                                            resume="allow")

    def _truncate(self, resume_step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def rewind(self, step: int) -> None:
        """Back to ``step`` in the middle of a run (a restart in place, ``megarl.trainer.restarts``):
        the steps after it are dropped and will be logged again. wandb keeps what it was sent."""
        self._truncate(step)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        keys = [*CONSOLE_KEYS, *eval_accuracy_keys([record])]  # an evaluated step shows each set's accuracy
        shown = "  ".join(f"{k.split('/')[-1] if k.startswith('time') else k}={_short(record[k])}"
                          for k in keys if k in record)
        print(f"step {step:>4}  {shown}", flush=True)

    def history(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> list[Path]:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        return write_plots(self.history(), self.dir / "plots")


def _plain(value: Any) -> Any:
    return float(value) if hasattr(value, "item") or isinstance(value, (int, float)) else value


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


PLOTS = {
    "reward": ("reward/mean", "mean reward"),
    "kl": ("kl/mean", "KL(actor || reference)"),
    "reverse_kl": ("distill/reverse_kl", "reverse KL(student || teacher) per token"),  # distillation only
    "reverse_kl_seq": ("distill/reverse_kl_seq", "reverse KL(student || teacher) per sequence"),
    "response_length": ("response/length_mean", "response tokens"),
    "tool_calls": ("tool/call_fraction", "episodes that call a tool"),  # multi-turn runs only
    # the supervised stages (megarl sft / rm / dpo)
    "sft_loss": ("model/sft_loss", "SFT loss (completion tokens)"),
    "rm_loss": ("model/rm_loss", "reward-model loss (Bradley-Terry)"),
    "dpo_loss": ("model/dpo_loss", "DPO loss"),
    "heldout_loss": ("eval/heldout/loss", "held-out loss"),
}


def eval_accuracy_keys(history: list[dict[str, Any]]) -> list[str]:
    """The ``eval/<set>/accuracy`` keys present in ``history``, sorted."""
    return sorted({k for r in history for k in r if k.startswith("eval/") and k.endswith("/accuracy")})


def write_plots(history: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG curves of reward, KL and response length over steps, and of each eval set's accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (key, label) in PLOTS.items():
        points = [(r["step"], r[key]) for r in history if key in r]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if keys := eval_accuracy_keys(history):  # one line per set, on the steps it was evaluated at
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            points = [(r["step"], r[key]) for r in history if key in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                    label=key.split("/")[1])
        ax.set_xlabel("step")
        ax.set_ylabel("eval accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / "eval_accuracy.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
