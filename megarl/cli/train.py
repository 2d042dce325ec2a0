"""``megarl train``: an RL run from a recipe (YAML) and dotted overrides."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import traceback
from pathlib import Path

DESCRIPTION = """Runs RLHF: rollout in vLLM, actor/critic/reference/reward as Megatron groups on Ray.

  megarl train                                   the embedded CPU demo (GRPO, SmolLM2-135M)
  megarl train RECIPE.yaml                       a recipe (see model_configs/)
  megarl train RECIPE.yaml actor.parallel.tp=2   ... with dotted overrides (NeMo style)
  megarl train RECIPE.yaml --check               validate and print the resolved config only

A run writes into its output_dir: metrics.jsonl (one object per step), tensorboard/,
plots/ (reward, KL and response-length curves) and checkpoints/. Running it again
continues from the last checkpoint (trainer.resume=auto).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run RL training (default: the embedded CPU demo)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=None, help="YAML recipe (default: the embedded CPU demo)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    p.add_argument("--check", action="store_true", help="validate and print the resolved config, then exit")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from megarl.config.loader import ConfigError
    from megarl.models.hf_arch import ArchError
    from megarl.recipes import load_run_config
    from megarl.validation.checks import validate_run

    try:
        cfg = load_run_config(args.recipe, args.overrides)
        validate_run(cfg)
    except (ConfigError, ArchError, OSError) as e:  # OSError: an unreadable recipe, model or data file
        print(f"megarl train: error: {e}", file=sys.stderr)
        return 2
    resolved = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    # what this machine holds: a recipe for a cluster is sound anywhere (--check), but a run started
    # here would wait for resources a local Ray instance never has
    from megarl.cluster.placement import capacity_errors

    too_big = capacity_errors(cfg)
    if args.check:
        print(resolved)
        for problem in too_big:
            print(f"megarl train: note: to run here: {problem}", file=sys.stderr)
        return 0
    if too_big:
        print(f"megarl train: error: {too_big[0]}", file=sys.stderr)
        return 2
    out = Path(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(resolved)
    except OSError as e:  # e.g. no permission: refused before any process starts
        print(f"megarl train: error: output_dir={cfg.output_dir!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    from megarl.trainer.loop import train

    print(f"megarl train: {cfg.name} -> {out}  ({cfg.algorithm.name}, {cfg.trainer.steps} steps)", flush=True)
    try:
        history = train(cfg)
    except Exception as e:
        print(f"megarl train: failed: {_one_line(e)}", file=sys.stderr)
        detail = out / "failure.log"
        detail.write_text("".join(traceback.format_exception(e)))
        print(f"megarl train: the full error is in {detail}", file=sys.stderr)
        return 1
    _summary(history)
    return 0


def _one_line(error: Exception) -> str:
    """The head of an error (a rank's or vLLM's traceback follows it), without terminal colour codes."""
    head = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", head)


def _summary(history: list[dict]) -> None:
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
    if len(rewards) >= 4:
        k = max(1, len(rewards) // 4)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        print(f"mean reward: first {k} step(s) {first:.3f} -> last {k} step(s) {last:.3f}", flush=True)
