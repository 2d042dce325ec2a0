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

TARGET = 0.8
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "model_configs" / "cpu_agent_check.yaml"
AGENT = "megarl.envs.examples.agents:answer_once"


def _path(kind: str, options: dict[str, Any]):
    def use(cfg: Any) -> None:
        cfg.env.kind, cfg.env.options, cfg.env.max_turns = kind, options, 1

    return use


def run_endpoint_cmd(args: argparse.Namespace) -> int:
    from megarl.config.schema import EnvConfig
    from megarl.data.prompts import prompt_dataset
    from megarl.rollout.remote import episode_item
    from megarl_bench.e2e import bench_config
    from megarl_bench.episodes import alternate_on_one_engine, sampling_of

    recipe = args.recipe or DEFAULT_RECIPE
    cfg = bench_config(str(recipe), args.overrides, 1, Path("/tmp/megarl-bench-endpoint"))
    cfg.env = cfg.env or EnvConfig(kind="single_turn")
    data = prompt_dataset(cfg.data)
    items = [episode_item(data.items[i]) for i in range(min(args.prompts, len(data.items)))]
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    arms = {"endpoint": _path(AGENT, {}), "in_process": _path("single_turn", {})}
    result = report(alternate_on_one_engine(cfg, items, sampling_of(cfg), arms, args.rounds, progress))
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return 0 if result["ratio"]["measured/target"] >= 1.0 else 1


def report(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each path's medians over its rounds, and the endpoint's tokens/s over the in-process path's."""
    import statistics

    keys = ("tokens_per_s", "episodes_per_s", "seconds")
    out: dict[str, Any] = {name: {key: statistics.median(r[key] for r in rs) for key in keys}
                           for name, rs in rounds.items()}
    ratio = out["endpoint"]["tokens_per_s"] / out["in_process"]["tokens_per_s"]
    out["ratio"] = {"measured": ratio, "target": TARGET, "measured/target": ratio / TARGET}
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'':<16}{'endpoint':>12}{'in process':>12}"]
    lines += [f"{key:<16}{result['endpoint'][key]:>12.3f}{result['in_process'][key]:>12.3f}"
              for key in ("tokens_per_s", "episodes_per_s", "seconds")]
    r = result["ratio"]
    lines.append(f"endpoint / in-process tokens/s: {r['measured']:.2f}x (target >= {r['target']:.2f}x, "
                 f"measured/target {r['measured/target']:.2f})")
    return "\n".join(lines)


def add_parser(bs: argparse._SubParsersAction) -> None:
    p = bs.add_parser("endpoint", help="episodes through the OpenAI-compatible endpoint vs in process (tokens/s)",
                      formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    p.add_argument("--recipe", default=None, help=f"YAML recipe (default: {DEFAULT_RECIPE.name})")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. rollout.max_tokens=32")
    p.add_argument("--prompts", type=int, default=16, help="prompts per round (x rollout.n episodes; default 16)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per path, after one warm-up (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run_endpoint_cmd)
