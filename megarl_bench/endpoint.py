"""``megarl bench endpoint``: single-turn episodes through the rollout endpoint (an agent asking
with the stock ``openai`` client, ``megarl.envs.examples.agents:answer_once``) against the same
episodes run in process (``env.kind: single_turn``), on one engine, in one command.

The recipe's model and prompts (by default ``model_configs/cpu_agent_check.yaml``); the engine
starts once and the two paths alternate for ``--rounds`` rounds on the same prompts and seeds.
Per path: the policy's sampled tokens per second, episodes per second and seconds. The first
round warms the engine (and the endpoint's server) up and is left out. Target: the endpoint at
>= 0.8x the in-process path's tokens/s (what the HTTP hop, the chat template and the session
bookkeeping may cost).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megarl_bench.engine_arms import add_arms_parser, alternate_on_one_engine, compare, sampling_of, table

TARGET = 0.8
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "model_configs" / "cpu_agent_check.yaml"
AGENT = "megarl.envs.examples.agents:answer_once"
KEYS = ("tokens_per_s", "episodes_per_s", "seconds")


def _path(kind: str):
    def use(cfg: Any) -> None:
        cfg.env.kind, cfg.env.options, cfg.env.max_turns = kind, {}, 1

    return use


def run_endpoint_cmd(args: argparse.Namespace) -> int:
    from megarl.config.schema import EnvConfig
    from megarl.data.prompts import prompt_dataset
    from megarl.rollout.remote import episode_item
    from megarl_bench.e2e import bench_config

    recipe = args.recipe or DEFAULT_RECIPE
    cfg = bench_config(str(recipe), args.overrides, 1, Path("/tmp/megarl-bench-endpoint"))
    cfg.env = cfg.env or EnvConfig(kind="single_turn")
    data = prompt_dataset(cfg.data)
    items = [episode_item(data.items[i]) for i in range(min(args.prompts, len(data.items)))]
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    arms = {"endpoint": _path(AGENT), "in_process": _path("single_turn")}
    result = report(alternate_on_one_engine(cfg, items, sampling_of(cfg), arms, args.rounds, progress))
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return 0 if result["ratio"]["measured/target"] >= 1.0 else 1


def report(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each path's medians over its rounds, and the endpoint's tokens/s over the in-process path's."""
    return compare(rounds, KEYS, TARGET, "ratio")


def format_table(result: dict[str, Any]) -> str:
    return table(result, ("endpoint", "in_process"), KEYS, "ratio")


def add_parser(bs: argparse._SubParsersAction) -> None:
    add_arms_parser(bs, "endpoint", "episodes through the OpenAI-compatible endpoint vs in process (tokens/s)",
                    __doc__, DEFAULT_RECIPE, "rollout.max_tokens=32", run_endpoint_cmd)
