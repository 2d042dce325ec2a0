"""The PNG of ``megarl bench scaling``: efficiency against rank count, one line per curve."""

from __future__ import annotations

from typing import Any


def plot_efficiency(result: dict[str, Any], path: str) -> None:
    """Left: training-step efficiency per mode; right: weight-sync GB/s (sync and raw) and its efficiency."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    with_sync = bool(result.get("sync"))
    fig, axes = plt.subplots(1, 2 if with_sync else 1, figsize=(11 if with_sync else 6, 4.2), squeeze=False)
    ranks = sorted(result["args"]["ranks"])
    ax = axes[0][0]
    ax.axhline(1.0, color="grey", linestyle=":", label="ideal")
    for mode, rows in result["train"].items():
        ax.plot([r["ranks"] for r in rows], [r["efficiency"] for r in rows], marker="o", label=mode)
    if with_sync:
        rows = result["sync"]
        ax.plot([r["ranks"] for r in rows], [r["efficiency"] for r in rows], marker="s", linestyle="--",
                label="weight sync (raw / sync)")
    _rank_axis(ax, ranks)
    ax.set_ylabel("efficiency")
    ax.set_ylim(bottom=0)
    m = result["machine"]
    where = f"{m.get('gpus', 0)} GPU(s), NCCL" if m["device"] == "cuda" else f"{m['cores']} CPU cores, gloo"
    ax.set_title(f"efficiency vs ranks ({where})")
    ax.legend(fontsize=8)
    if with_sync:
        ax = axes[0][1]
        rows = result["sync"]
        ax.plot([r["ranks"] for r in rows], [r["gb_per_s"] for r in rows], marker="o", label="weight sync")
        ax.plot([r["ranks"] for r in rows], [r["raw_gb_per_s"] for r in rows], marker="s", linestyle="--",
                label="raw transfer, same bytes")
        _rank_axis(ax, ranks)
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"weight sync actor tp=N -> vLLM tp={result['args']['rollout_tp']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rank_axis(ax, ranks: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks)
    ax.set_xticklabels([str(r) for r in ranks])
    ax.set_xlabel("ranks")
    ax.grid(alpha=0.3)
