"""Two ways of running the same episodes, alternated on one engine: what ``megarl bench episodes``
(overlap against lockstep turns) and ``megarl bench endpoint`` (through the OpenAI-compatible
endpoint against in process) share. Each bench names its two arms (a change of the config each),
its figures and its target; this module starts the engine, alternates the arms round by round on
the same prompts and seeds, and reports the medians and the first arm's tokens/s over the second's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Arm = Callable[[Any], None]  # sets the config for one way of running the episodes


def sampling_of(cfg: Any) -> Any:
    """The recipe's sampling (its stop token is the tokenizer's, set when the engine starts)."""
    from megarl.rollout.sampling import SamplingConfig

    r = cfg.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                          n=r.n, stop_token_ids=[], seed=cfg.seed)


def alternate_on_one_engine(cfg: Any, items: list, sampling: Any, arms: dict[str, Arm], rounds: int,
                            progress: Callable[..., None]) -> dict[str, list[dict[str, float]]]:
    """Starts the recipe's engine once, then per round runs the episodes under each arm in turn, on
    the same items and seeds; each arm's figures per round, the first round (warm-up) left out."""
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
                              max_num_seqs=r.max_num_seqs, kv_cache_gib=r.kv_cache_gib, cpu_gemm=r.cpu_gemm)
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
    """The policy's sampled tokens per second (observation tokens are not sampled) and the rest."""
    tokens = sum(sum(t.response_mask) for t in episodes)
    return {"tokens_per_s": tokens / seconds, "episodes_per_s": len(episodes) / seconds, "seconds": seconds,
            "tool_seconds": sum(t.info.get("tool_seconds", 0.0) for t in episodes),
            "turns_mean": statistics.fmean(len(t.turns) for t in episodes),
            "tool_call_fraction": statistics.fmean(t.info.get("tool_calls", 0) > 0 for t in episodes)}


def compare(rounds: dict[str, list[dict[str, float]]], keys: tuple[str, ...], target: float,
            verdict: str) -> dict[str, Any]:
    """Each arm's medians of ``keys`` over its rounds, and under ``verdict`` the first arm's
    tokens/s over the second's against ``target``."""
    out: dict[str, Any] = {name: {key: statistics.median(r[key] for r in rs) for key in keys}
                           for name, rs in rounds.items()}
    first, second = list(rounds)
    ratio = out[first]["tokens_per_s"] / out[second]["tokens_per_s"]
    out[verdict] = {"measured": ratio, "target": target, "measured/target": ratio / target}
    return out


def table(result: dict[str, Any], arms: tuple[str, str], keys: tuple[str, ...], verdict: str) -> str:
    first, second = arms
    lines = [f"{'':<20}{first:>12}{second:>12}"]
    lines += [f"{key:<20}{result[first][key]:>12.3f}{result[second][key]:>12.3f}" for key in keys]
    v = result[verdict]
    lines.append(f"{first} / {second} tokens/s: {v['measured']:.2f}x (target >= {v['target']:.2f}x, "
                 f"measured/target {v['measured/target']:.2f})")
    return "\n".join(lines)


def add_arms_parser(bs: argparse._SubParsersAction, name: str, help: str, doc: str, recipe: Path,
                    example: str, run: Callable[[argparse.Namespace], int]) -> None:
    p = bs.add_parser(name, help=help, formatter_class=argparse.RawDescriptionHelpFormatter, description=doc)
    p.add_argument("--recipe", default=None, help=f"YAML recipe (default: {recipe.name})")
    p.add_argument("overrides", nargs="*", help=f"dotted overrides of the recipe, e.g. {example}")
    p.add_argument("--prompts", type=int, default=16, help="prompts per round (x rollout.n episodes; default 16)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per arm, after one warm-up (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)
