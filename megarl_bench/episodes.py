"""``megarl bench episodes``: multi-turn episodes with overlap (while one episode waits for its
tool, the others generate) against lockstep turns (every episode's tool answers before any
generates again), on one engine, in one command.

The recipe's model, environment, tools and prompts (by default ``model_configs/cpu_tool_calc.yaml``);
the engine starts once and the two schedules alternate for ``--rounds`` rounds on the same
prompts and seeds. Per schedule: the policy's generated tokens per second (observation tokens
are not generated), episodes per second, the tool time summed over episodes, the mean number of
turns and the fraction of episodes that called a tool. The first round warms the engine up and
is left out. Target: overlap at >= 1.0x lockstep's tokens/s (it must never be slower; how much
faster depends on the tools' latency against a turn's generation time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megarl_bench.engine_arms import add_arms_parser, alternate_on_one_engine, compare, sampling_of, table

TARGET = 1.0
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "model_configs" / "cpu_tool_calc.yaml"
KEYS = ("tokens_per_s", "episodes_per_s", "seconds", "tool_seconds", "turns_mean", "tool_call_fraction")


def run_episodes_cmd(args: argparse.Namespace) -> int:
    from megarl.data.prompts import prompt_dataset
    from megarl.rollout.remote import episode_item
    from megarl_bench.e2e import bench_config

    recipe = args.recipe or DEFAULT_RECIPE
    cfg = bench_config(str(recipe), args.overrides, 1, Path("/tmp/megarl-bench-episodes"))
    if cfg.env is None:
        print(f"megarl bench episodes: {recipe} has no env section (multi-turn episodes)", file=sys.stderr)
        return 2
    data = prompt_dataset(cfg.data)
    items = [episode_item(data.items[i]) for i in range(min(args.prompts, len(data.items)))]
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    arms = {"overlap": lambda c: setattr(c.env, "overlap", True),
            "lockstep": lambda c: setattr(c.env, "overlap", False)}
    result = report(alternate_on_one_engine(cfg, items, sampling_of(cfg), arms, args.rounds, progress))
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return 0


def report(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each schedule's medians over its rounds, and overlap's tokens/s over lockstep's."""
    return compare(rounds, KEYS, TARGET, "speedup")


def format_table(result: dict[str, Any]) -> str:
    return table(result, ("overlap", "lockstep"), KEYS, "speedup")


def add_parser(bs: argparse._SubParsersAction) -> None:
    add_arms_parser(bs, "episodes", "multi-turn episodes: overlapping tool calls vs lockstep turns (tokens/s)",
                    __doc__, DEFAULT_RECIPE, "env.max_turns=2", run_episodes_cmd)
