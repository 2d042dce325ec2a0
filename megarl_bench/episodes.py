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
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET = 1.0
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "model_configs" / "cpu_tool_calc.yaml"


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
    sampling = sampling_of(cfg)
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    arms = {"overlap": lambda c: setattr(c.env, "overlap", True),
            "lockstep": lambda c: setattr(c.env, "overlap", False)}
    rounds = alternate_on_one_engine(cfg, items, sampling, arms, args.rounds, progress)
    result = report(rounds)
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return 0


def sampling_of(cfg: Any) -> Any:
    """The recipe's sampling (its stop token is the tokenizer's, set when the engine starts)."""
    from megarl.rollout.sampling import SamplingConfig

    r = cfg.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                          n=r.n, stop_token_ids=[], seed=cfg.seed)


def alternate_on_one_engine(cfg: Any, items: list, sampling: Any, arms: dict[str, Callable[[Any], None]],
                            rounds: int, progress: Callable[..., None]) -> dict[str, list[dict[str, float]]]:
    """Starts the recipe's engine once, then per round runs the episodes under each arm (a change
    of ``cfg``) in turn, on the same items and seeds; each arm's figures per round, the first round
    (warm-up) left out. ``megarl bench endpoint`` shares it."""
    import ray

    from megarl.cluster.ray_env import ensure_ray, shutdown_ray
    from megarl.rollout.remote import start_engine, submit_episodes, wait_ready
    from megarl.trainer.run import hf_folder

    r = cfg.rollout
    ensure_ray()
    try:
        from transformers import AutoTokenizer

        path = hf_folder(cfg.actor.model.path)
        sampling.stop_token_ids = [AutoTokenizer.from_pretrained(str(path)).eos_token_id]
        engine = start_engine(str(path), tp=r.tp, dtype=r.dtype, max_model_len=r.max_model_len,
                              max_num_seqs=r.max_num_seqs, kv_cache_gib=r.kv_cache_gib)
        wait_ready([engine], timeout_s=cfg.trainer.step_timeout_s)
        figures: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
        for round_index in range(rounds + 1):
            for name, arm in arms.items():
                arm(cfg)
                started = time.perf_counter()
                refs = submit_episodes([engine], items, sampling, cfg)
                episodes = [t for part in ray.get(refs, timeout=cfg.trainer.step_timeout_s) for t in part]
                measured = _figures(episodes, time.perf_counter() - started)
                progress(f"round {round_index}{' (warm-up)' if round_index == 0 else ''}: "
                         f"{name:<10} {measured['tokens_per_s']:.1f} tokens/s")
                if round_index > 0:
                    figures[name].append(measured)
    finally:
        shutdown_ray()
    return figures


def _figures(episodes: list, seconds: float) -> dict[str, float]:
    tokens = sum(sum(t.response_mask) for t in episodes)
    return {"tokens_per_s": tokens / seconds, "episodes_per_s": len(episodes) / seconds, "seconds": seconds,
            "tool_seconds": sum(t.info.get("tool_seconds", 0.0) for t in episodes),
            "turns_mean": statistics.fmean(len(t.turns) for t in episodes),
            "tool_call_fraction": statistics.fmean(t.info.get("tool_calls", 0) > 0 for t in episodes)}


def report(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each schedule's medians over its rounds, and overlap's tokens/s over lockstep's."""
    out: dict[str, Any] = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
                           for name, rs in rounds.items()}
    ratio = out["overlap"]["tokens_per_s"] / out["lockstep"]["tokens_per_s"]
    out["speedup"] = {"measured": ratio, "target": TARGET, "measured/target": ratio / TARGET}
    return out


def format_table(result: dict[str, Any]) -> str:
    keys = ("tokens_per_s", "episodes_per_s", "seconds", "tool_seconds", "turns_mean", "tool_call_fraction")
    lines = [f"{'':<20}{'overlap':>12}{'lockstep':>12}"]
    lines += [f"{key:<20}{result['overlap'][key]:>12.3f}{result['lockstep'][key]:>12.3f}" for key in keys]
    s = result["speedup"]
    lines.append(f"overlap / lockstep tokens/s: {s['measured']:.2f}x (target >= {s['target']:.2f}x, "
                 f"measured/target {s['measured/target']:.2f})")
    return "\n".join(lines)


def add_parser(bs: argparse._SubParsersAction) -> None:
    p = bs.add_parser("episodes", help="multi-turn episodes: overlapping tool calls vs lockstep turns (tokens/s)",
                      formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    p.add_argument("--recipe", default=None, help=f"YAML recipe with an env section (default: {DEFAULT_RECIPE.name})")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. env.max_turns=2")
    p.add_argument("--prompts", type=int, default=16, help="prompts per round (x rollout.n episodes; default 16)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per schedule, after one warm-up (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run_episodes_cmd)
