"""``megarl bench e2e``: megarl's GRPO against TRL's GRPOTrainer, same task, same machine.

Both systems run the same recipe (by default the embedded CPU demo: GRPO on
SmolLM2-135M-Instruct, reasoning-gym chain_sum) one after the other in one
command. Throughput is generated response tokens / optimizer-step wall time,
summed over the steps after the first (the first is warm-up: lazy allocations,
first-call compilation); start-up and teardown are reported apart, as the wall
time outside the timed steps. With ``--rounds`` > 1 the order alternates
(megarl first, then TRL first, ...) so slow drift on a shared machine hits both.

TRL's side is in :mod:`megarl_bench.e2e_trl`, imported only when the bench runs;
TRL is an optional dependency (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from megarl.utils.cores import usable_cores
from megarl_bench.e2e_records import StepRecord, SystemResult

TARGET_RATIO = 1.5
STARTUP_TARGET = 2.0  # megarl's start-up to the first step, at most this multiple of TRL's
TRL_MISSING = ("megarl bench e2e compares against TRL's GRPOTrainer, but the package trl is not installed; "
               "install it with: pip install -e .[bench]")


class MissingDependency(RuntimeError):
    """An optional package the benchmark needs is not installed (the message says how to install it)."""


def require_trl() -> str:
    """TRL's version, or MissingDependency naming the install command."""
    try:
        import trl
    except ImportError:
        raise MissingDependency(TRL_MISSING) from None
    return trl.__version__


def throughput(steps: list[StepRecord], warmup: int = 1) -> tuple[int, float, float]:
    """(tokens, seconds, tokens/s) over the steps after the first ``warmup``."""
    timed = steps[warmup:]
    if not timed:
        raise ValueError(f"{len(steps)} step(s) leave none to time after {warmup} warm-up step(s); run more steps")
    tokens = sum(s.tokens for s in timed)
    seconds = sum(s.seconds for s in timed)
    if seconds <= 0:
        raise ValueError(f"timed steps took {seconds} s")
    return tokens, seconds, tokens / seconds


def summarize(result: SystemResult, warmup: int = 1) -> dict[str, Any]:
    tokens, seconds, rate = throughput(result.steps, warmup)
    timed = len(result.steps) - warmup
    return {"system": result.system, "steps": len(result.steps), "timed_steps": timed, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": rate,
            "mean_response_tokens": tokens / (timed * result.samples_per_step),
            "reward_first": result.steps[0].reward, "reward_last": result.steps[-1].reward,
            "overhead_s": result.overhead_s, "startup_s": result.startup_s,
            "step_seconds": [s.seconds for s in result.steps],
            "step_tokens": [s.tokens for s in result.steps], "step_rewards": [s.reward for s in result.steps],
            "notes": result.notes}


def pooled(results: list[SystemResult], warmup: int = 1) -> dict[str, float]:
    """Tokens and seconds summed over rounds (each without its warm-up steps)."""
    parts = [throughput(r.steps, warmup) for r in results]
    tokens, seconds = sum(p[0] for p in parts), sum(p[1] for p in parts)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def verdict(megarl_rate: float, trl_rate: float, target: float = TARGET_RATIO) -> dict[str, Any]:
    ratio = megarl_rate / trl_rate
    return {"ratio": ratio, "target": target, "passed": ratio >= target}


def megarl_steps(history: list[dict[str, Any]]) -> list[StepRecord]:
    """Per-step records from megarl's metrics history (``train``'s return value). The held-out
    evaluation before training logs a row of its own (step 0, no step time): not a step."""
    out = []
    for h in history:
        if h.get("step") == 0:
            continue
        for key in ("time/step_s", "throughput/tokens_per_s", "reward/mean"):
            if key not in h:
                raise KeyError(f"megarl step {h.get('step')}: no {key!r} in its metrics")
        # the loop logs tokens_per_s = generated / step_s; undo the division
        out.append(StepRecord(tokens=round(h["throughput/tokens_per_s"] * h["time/step_s"]),
                              seconds=h["time/step_s"], reward=h["reward/mean"]))
    return out


# -- the report ----------------------------------------------------------------------------------


def build_report(setup: dict[str, Any], rounds: list[dict[str, SystemResult]], warmup: int = 1,
                 target: float = TARGET_RATIO) -> dict[str, Any]:
    """Everything printed, as one JSON-ready dict; the verdict uses tokens and seconds pooled over rounds."""
    per_round = []
    for r in rounds:
        m, t = summarize(r["megarl"], warmup), summarize(r["trl"], warmup)
        per_round.append({"order": r["order"], "megarl": m, "trl": t,
                          **verdict(m["tokens_per_s"], t["tokens_per_s"], target)})
    pm, pt = pooled([r["megarl"] for r in rounds], warmup), pooled([r["trl"] for r in rounds], warmup)
    return {"setup": setup, "rounds": per_round, "pooled": {"megarl": pm, "trl": pt},
            "startup": startup_comparison(rounds), **verdict(pm["tokens_per_s"], pt["tokens_per_s"], target)}


def startup_comparison(rounds: list[dict[str, SystemResult]]) -> dict[str, Any] | None:
    """Start-up to the first step, each side's mean over the rounds, and megarl's as a multiple of
    TRL's (target at most STARTUP_TARGET); None when a side did not report it."""
    times = {side: [r[side].startup_s for r in rounds] for side in ("megarl", "trl")}
    if any(t is None for ts in times.values() for t in ts):
        return None
    megarl_s, trl_s = (sum(times[side]) / len(rounds) for side in ("megarl", "trl"))
    return {"megarl_s": megarl_s, "trl_s": trl_s, "ratio": megarl_s / trl_s, "target": STARTUP_TARGET,
            "passed": megarl_s / trl_s <= STARTUP_TARGET}


def format_table(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [f"megarl bench e2e: {s['task']}",
             f"steps per system per round: {s['steps']} (step 1 is warm-up, not timed); "
             f"rounds: {len(report['rounds'])}; torch threads: {s['threads']} of {s['cores']} cores",
             f"{'round':>5} | {'system':<28} | {'timed steps':>11} | {'tokens':>6} | {'seconds':>8} | "
             f"{'tokens/s':>8} | {'resp len':>8} | {'reward first -> last':>20} | {'outside steps s':>15}"]
    for i, r in enumerate(report["rounds"], start=1):
        for key in r["order"]:
            x = r[key]
            lines.append(f"{i:>5} | {x['system']:<28} | {x['timed_steps']:>11} | {x['tokens']:>6} | "
                         f"{x['seconds']:>8.1f} | {x['tokens_per_s']:>8.2f} | {x['mean_response_tokens']:>8.1f} | "
                         f"{x['reward_first']:>9.3f} -> {x['reward_last']:<7.3f} | {x['overhead_s']:>15.1f}")
        lines.append(f"{i:>5} | ratio megarl/TRL tokens/s: {r['ratio']:.2f}")
    p = report["pooled"]
    lines.append(f"megarl {p['megarl']['tokens_per_s']:.2f} tokens/s vs TRL {p['trl']['tokens_per_s']:.2f} tokens/s "
                 f"(pooled over rounds): ratio {report['ratio']:.2f} (target >= {report['target']}): "
                 f"{'PASS' if report['passed'] else 'FAIL'}")
    if start := report.get("startup"):
        lines.append(f"start-up to the first step (mean over rounds): megarl {start['megarl_s']:.1f} s vs TRL "
                     f"{start['trl_s']:.1f} s: {start['ratio']:.2f}x (target <= {start['target']:g}x): "
                     f"{'PASS' if start['passed'] else 'FAIL'}")
    notes = {n for r in report["rounds"] for key in ("megarl", "trl") for n in r[key]["notes"]}
    lines += [f"note: {n}" for n in sorted(notes)] + [f"note: {n}" for n in s["notes"]]
    return "\n".join(lines)


# -- running it ------------------------------------------------------------------------------------


def bench_config(recipe: str | None, overrides: list[str], steps: int, output_dir: Path):
    """The recipe as megarl trains it here: ``steps`` steps into a fresh directory, no resume,
    no TensorBoard/wandb writers (the logger runs outside the timed step either way)."""
    from megarl.recipes import load_run_config
    from megarl.validation.checks import validate_run

    cfg = load_run_config(recipe, [*overrides, f"trainer.steps={steps}", f"output_dir={output_dir}",
                                   "trainer.resume=never", "trainer.tensorboard=false", "trainer.wandb=false"])
    validate_run(cfg)
    return cfg


def run_megarl(cfg) -> SystemResult:
    from megarl.cluster.ray_env import shutdown_ray
    from megarl.trainer.loop import train

    started = time.perf_counter()
    try:
        history = train(cfg)
    finally:
        shutdown_ray()  # free the cores and memory before the other system runs
    total = time.perf_counter() - started
    steps = megarl_steps(history)
    from megarl.algorithms import get_algorithm

    old = ("a scoring pass for the old log-probs" if get_algorithm(cfg.algorithm.name).needs_old_logprobs(cfg.algorithm)
           else "no separate old-log-prob pass (on-policy: the update's forward gives them, as TRL's "
                "num_iterations=1)")
    layout = ", ".join(f"{name}: {_batching(role)}" for name, role in cfg.roles().items())
    notes = [f"megarl: vLLM rollout + Megatron actor/reference on Ray, {cfg.actor.precision.dtype}; "
             f"steps include rollout, reward, reference log-probs, update and weight sync; {old}",
             f"megarl micro-batches: {layout}"]
    # the driver's imports, which this process did before train(): timed in a fresh interpreter
    startup = next((h["time/startup_s"] for h in history if "time/startup_s" in h), None)
    startup = None if startup is None else startup + fresh_import_seconds("megarl.trainer.loop")
    return SystemResult(system="megarl (vLLM + Megatron)", steps=steps,
                        overhead_s=total - sum(s.seconds for s in steps),
                        samples_per_step=cfg.data.prompts_per_step * cfg.rollout.n, notes=notes, startup_s=startup)


def fresh_import_seconds(module: str) -> float:
    """Seconds a fresh Python takes to import ``module`` (interpreter start excluded)."""
    import subprocess
    import sys

    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _batching(role) -> str:
    parts = [f"{role.micro_batch_size} sequences"] if role.max_tokens_per_microbatch is None else \
        [f"<= {role.max_tokens_per_microbatch} tokens"]
    parts += ["packed"] * role.pack_sequences + ["one copy of each prompt per group"] * role.share_prompt
    return " ".join(parts)


def _task(cfg) -> str:
    d, r = cfg.data, cfg.rollout
    model = cfg.actor.model.path.removeprefix("bundled:")
    return (f"{cfg.algorithm.name.upper()} on {model}, {d.source}, {d.prompts_per_step} prompts x {r.n} samples, "
            f"max {r.max_tokens} tokens, T={r.temperature}, lr {cfg.actor.optim.lr:g}, "
            f"KL coef {cfg.algorithm.kl_coef:g}, {cfg.actor.precision.dtype}")


def plan_e2e(recipe: str | None, overrides: list[str], steps: int, rounds: int, out: Path,
             threads: int) -> list[dict[str, Any]]:
    """Each round's validated configs (one run directory per system); bad arguments or a
    recipe TRL cannot reproduce fail here, before any process starts."""
    from megarl_bench.e2e_trl import grpo_settings

    if steps < 2 or rounds < 1 or threads < 1:
        raise ValueError(f"--steps must be >= 2 (step 1 is warm-up), --rounds and --threads >= 1; "
                         f"got {steps}, {rounds}, {threads}")
    cfgs = [{name: bench_config(recipe, overrides, steps, out / f"round{i}" / name) for name in ("megarl", "trl")}
            for i in range(1, rounds + 1)]
    grpo_settings(cfgs[0]["trl"], steps, out)
    return cfgs


def run_e2e(cfgs: list[dict[str, Any]], steps: int, threads: int, progress=print,
            quiet: bool = False) -> dict[str, Any]:
    """Runs every round (alternating which system goes first) and returns the report."""
    import torch

    from megarl_bench.e2e_trl import run_trl_process

    # Idle OpenMP threads sleep instead of spinning. Set for both systems alike (megarl's Ray
    # workers and vLLM inherit it; TRL runs in a fresh process): on a shared, oversubscribed
    # machine spinning threads steal the cores the busy ones need (a 2-thread SmolLM2
    # forward/backward measured 20x slower here under load).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(threads)
    results = []
    for i, cfg in enumerate(cfgs, start=1):
        order = ("megarl", "trl") if i % 2 else ("trl", "megarl")
        result: dict[str, Any] = {"order": order}
        for name in order:
            progress(f"-- round {i}/{len(cfgs)}: {name}")
            if name == "megarl":
                result[name] = run_megarl(cfg[name])
            else:
                result[name] = run_trl_process(cfg[name], steps, Path(cfg[name].output_dir), threads, quiet)
        results.append(result)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    first = cfgs[0]["megarl"]
    setup = {"task": _task(first), "steps": steps, "threads": threads, "cores": usable_cores(),
             "out": str(Path(first.output_dir).parent.parent),
             "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
             "notes": [f"1-minute load average at the end: {load:.2f} on {usable_cores()} cores; other jobs on the "
                       "machine slow either side, so compare ratios from back-to-back runs only",
                       f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} for both systems"]}
    return build_report(setup, results)


DESCRIPTION = """Runs the same GRPO task with the same model on this machine through megarl (`megarl train`'s
loop: vLLM rollout, Megatron actor and reference on Ray) and through TRL's GRPOTrainer
(transformers generate; TRL's vLLM mode needs CUDA), one after the other, and prints
generated response tokens per second of step wall time for both and their ratio
(target megarl/TRL >= 1.5).

Both sides take every setting from one recipe (default: the embedded CPU demo): model,
prompts in the same order, chat template, group size, prompts per step, response
length, temperature, learning rate, KL coefficient, clipping, token-mean loss and
megarl's reward functions. The first step of each run is warm-up and is not timed;
start-up and teardown are reported apart. Needs TRL: pip install -e .[bench]

  megarl bench e2e                        4 steps of the CPU demo on each side
  megarl bench e2e --steps 6 --rounds 2   alternate the order, pool the timings
"""


def add_e2e_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("e2e", help="GRPO tokens/s: megarl vs TRL's GRPOTrainer (target ratio >= 1.5)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=None, help="YAML recipe (default: the embedded CPU demo)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. rollout.max_tokens=32")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per system per round (default 4)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat both runs, alternating which goes first (default 1)")
    p.add_argument("--threads", type=int, default=usable_cores(), help="torch threads (default: the usable cores)")
    p.add_argument("--out", type=Path, default=None,
                   help="run directories (default runs/bench-e2e/<timestamp>)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run_e2e_cmd)


def run_e2e_cmd(args: argparse.Namespace) -> int:
    try:
        require_trl()
    except MissingDependency as e:
        print(f"megarl bench e2e: error: {e}", file=sys.stderr)
        return 2
    out = args.out or Path("runs/bench-e2e") / time.strftime("%Y%m%d-%H%M%S")
    # --json keeps stdout for the JSON object: progress and the runs' own logs go to stderr
    progress = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    try:
        cfgs = plan_e2e(args.recipe, args.overrides, args.steps, args.rounds, out, args.threads)
    except ValueError as e:
        print(f"megarl bench e2e: error: {e}", file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        report = run_e2e(cfgs, args.steps, args.threads, progress, quiet=args.json)
    report["setup"] |= {"recipe": args.recipe or "embedded cpu_demo_grpo.yaml", "overrides": args.overrides}
    text = json.dumps(report, indent=2, default=list)
    (out / "report.json").write_text(text + "\n")
    print(text if args.json else format_table(report), flush=True)
    return 0
