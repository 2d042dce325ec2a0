"""``megarl plan``: layouts and placement for an RL run that fit the GPUs, before any queue wait."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.algorithms.registry import ALGORITHMS
from megarl.plan.hardware import GPUS

DESCRIPTION = """\
Proposes per-role tensor/pipeline/data (and expert) parallel layouts and a placement
(colocated: every role on every GPU, time-shared; split: the Megatron roles on some GPUs,
vLLM on the rest; disaggregated: each role on GPUs of its own) that fit GPU memory, weighs
lockstep against rollout one step ahead (recommending it where it is at least 5% faster),
shows per-GPU memory by component (weights, gradients, optimizer with the distributed
optimizer, activations with the chosen recompute, vLLM weights and KV cache) and an
estimated step-time breakdown (generation, inference, training, weight sync) from FLOPs,
HBM and link bandwidths. The figures used are printed and can be overridden. With a
recipe YAML and no --gpus it checks the recipe's own layouts. Exit code 2 when nothing
fits, with how much memory is missing."""


EFFICIENCY_FLAGS = ("--train-mfu", "--prefill-mfu", "--hbm-efficiency", "--link-efficiency", "--overhead-gib",
                    "--decode-step-ms", "--moe-mfu-factor", "--cpu-adam-params-per-s")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="propose layouts and a placement that fit the GPUs",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="an HF config.json or model folder, a megarl checkpoint, a recipe YAML, or a name from "
                        "megarl/plan/arch_configs (e.g. llama3.1-70b)")
    p.add_argument("--gpus", type=int, help="GPUs to plan for (a recipe without it: check its own layouts)")
    p.add_argument("--gpu", default="h100-80gb", choices=sorted(GPUS), help="GPU type (default h100-80gb)")
    p.add_argument("--algo", choices=ALGORITHMS, help="the algorithm (its roles: actor and reference, and a "
                   "critic and reward model where it learns values, e.g. ppo); default grpo, or the recipe's")
    p.add_argument("--placement", default="any", choices=["any", "colocated", "split", "disaggregated"])
    w = p.add_argument_group("workload (defaults: a long-reasoning GRPO step)")
    w.add_argument("--prompts", type=int, default=256, help="prompts per step (default 256)")
    w.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    w.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    w.add_argument("--response-len", type=int, default=2048, help="longest response, tokens (default 2048): "
                   "memory holds it and generation runs until it ends")
    w.add_argument("--mean-response-len", type=float, help="mean response, tokens (default: the longest); "
                   "packed training and scoring compute over it, and it sets how fast generation's batch thins")
    w.add_argument("--minibatches", type=int, default=1, help="optimizer steps per step (default 1)")
    w.add_argument("--micro-batch", type=int, default=1, help="training micro-batch, sequences (default 1)")
    w.add_argument("--max-num-seqs", type=int, default=256, help="vLLM concurrent sequences per engine (256)")
    w.add_argument("--max-staleness", type=int, default=None,
                   help="rollout ahead of training by this many weight versions (trainer.max_staleness; default: "
                   "a recipe's own, else lockstep and one step ahead are both planned and the faster recommended): "
                   "split or disaggregated, generation then overlaps scoring and training")
    w.add_argument("--rollout-weights", choices=["model", "fp8", "fp8_emulated"], default=None,
                   help="vLLM's weights (rollout.weights; default model, a recipe's own): fp8 holds the layers in "
                   "E4M3 (half the bf16 bytes) and runs their GEMMs at --gpu-fp8-tflops")
    h = p.add_argument_group("hardware and efficiency overrides (defaults: the --gpu datasheet)")
    for flag, dest in (("--gpu-memory-gib", "memory_gib"), ("--gpu-tflops", "bf16_tflops"),
                       ("--gpu-fp8-tflops", "fp8_tflops"),
                       ("--hbm-gbps", "hbm_gbps"), ("--nvlink-gbps", "nvlink_gbps"),
                       ("--interconnect-gbps", "interconnect_gbps"), ("--pcie-gbps", "pcie_gbps")):
        h.add_argument(flag, dest=dest, type=float)
    h.add_argument("--gpus-per-node", dest="gpus_per_node", type=int)
    for flag in EFFICIENCY_FLAGS:
        h.add_argument(flag, type=float)
    p.set_defaults(handler=main)


# (flag, argparse dest, allowed interval): a zero here would divide the memory and time models
_RANGES = (
    ("--prompts", "prompts", "[1, inf)"), ("--n", "n", "[1, inf)"), ("--prompt-len", "prompt_len", "[1, inf)"),
    ("--response-len", "response_len", "[1, inf)"), ("--mean-response-len", "mean_response_len", "(0, inf)"),
    ("--minibatches", "minibatches", "[1, inf)"), ("--micro-batch", "micro_batch", "[1, inf)"),
    ("--max-num-seqs", "max_num_seqs", "[1, inf)"), ("--max-staleness", "max_staleness", "[0, inf)"),
    ("--gpus-per-node", "gpus_per_node", "[1, inf)"),
    ("--gpu-memory-gib", "memory_gib", "(0, inf)"), ("--gpu-tflops", "bf16_tflops", "(0, inf)"),
    ("--gpu-fp8-tflops", "fp8_tflops", "(0, inf)"),
    ("--hbm-gbps", "hbm_gbps", "(0, inf)"), ("--nvlink-gbps", "nvlink_gbps", "(0, inf)"),
    ("--interconnect-gbps", "interconnect_gbps", "(0, inf)"), ("--pcie-gbps", "pcie_gbps", "(0, inf)"),
    ("--train-mfu", "train_mfu", "(0, 1]"), ("--prefill-mfu", "prefill_mfu", "(0, 1]"),
    ("--hbm-efficiency", "hbm_efficiency", "(0, 1]"), ("--link-efficiency", "link_efficiency", "(0, 1]"),
    ("--moe-mfu-factor", "moe_mfu_factor", "(0, 1]"), ("--overhead-gib", "overhead_gib", "[0, inf)"),
    ("--decode-step-ms", "decode_step_ms", "[0, inf)"),
    ("--cpu-adam-params-per-s", "cpu_adam_params_per_s", "(0, inf)"),
)


def range_problem(args: argparse.Namespace) -> str | None:
    """The first option out of its range, as '--flag=value must be ...'; None when all are fine."""
    from megarl.validation.ranges import out_of_range

    for flag, dest, interval in _RANGES:
        problem = out_of_range(flag, getattr(args, dest, None), interval)
        if problem:
            return problem
    return None


def _model(spec: str):
    """(architecture, recipe or None) for --model."""
    from megarl.config.loader import load_config
    from megarl.config.schema import RunConfig
    from megarl.convert.checkpoint import read_model_arch
    from megarl.plan.archs import ARCHS_DIR, load_arch

    if spec.endswith((".yaml", ".yml")):
        cfg = load_config(RunConfig, spec)
        return None, cfg
    if (ARCHS_DIR / spec).is_dir() or Path(spec).is_file():
        return load_arch(spec), None
    return read_model_arch(spec), None


def main(args: argparse.Namespace) -> int:
    if problem := range_problem(args):
        print(f"megarl plan: error: {problem}", file=sys.stderr)
        return 2
    from dataclasses import replace

    from megarl.config.loader import ConfigError
    from megarl.models.hf_arch import ArchError
    from megarl.plan.hardware import Efficiency, gpu_spec
    from megarl.plan.recipe import evaluate_recipe, rl_shape
    from megarl.plan.report import format_plan
    from megarl.plan.search import NoFit, PlanInputs, plan, recommend
    from megarl.plan.steptime import RLShape
    from megarl.validation import validate_run

    gpu = gpu_spec(args.gpu, **{k: getattr(args, k) for k in ("memory_gib", "bf16_tflops", "fp8_tflops", "hbm_gbps",
                                                              "nvlink_gbps", "interconnect_gbps", "pcie_gbps",
                                                              "gpus_per_node")})
    keys = [f[2:].replace("-", "_") for f in EFFICIENCY_FLAGS]
    eff = replace(Efficiency(), **{k: v for k in keys if (v := getattr(args, k)) is not None})
    try:
        arch, recipe = _model(args.model)
        if recipe is not None and args.rollout_weights:
            # the recipe as it would run with these weights: FP8 ones cannot be verified bit for bit
            verify = recipe.trainer.verify_sync if args.rollout_weights == "model" else "never"
            recipe = replace(recipe, rollout=replace(recipe.rollout, weights=args.rollout_weights),
                             trainer=replace(recipe.trainer, verify_sync=verify))
        if recipe is not None and args.gpus is None:
            result = evaluate_recipe(recipe, validate_run(recipe), gpu, eff)
            rl = rl_shape(recipe)
            print(format_plan(result, gpu, eff, rl, f"recipe {args.model}"))
            return 0 if result.fits else 2
        if recipe is not None:
            arch = validate_run(recipe)["actor"]
            rl = replace(rl_shape(recipe), algo=args.algo or rl_shape(recipe).algo)
        else:
            rl = RLShape(algo=args.algo or "grpo", prompts=args.prompts, n=args.n, prompt_len=args.prompt_len,
                         response_len=args.response_len, mean_response_len=args.mean_response_len,
                         minibatches=args.minibatches)
        if not args.gpus or args.gpus < 1:
            raise ConfigError("--gpus N (>= 1) is needed to plan a model")
        staleness = args.max_staleness if args.max_staleness is not None else (
            recipe.trainer.max_staleness if recipe is not None else 0)
        weights = args.rollout_weights or (recipe.rollout.weights if recipe is not None else "model")
        inputs = PlanInputs(gpu, rl, eff, micro_batch=args.micro_batch, max_num_seqs=args.max_num_seqs,
                            max_staleness=staleness, rollout_weights=weights)
        if args.max_staleness is None and staleness == 0:  # nothing asked: weigh both, recommend
            result = recommend(arch, args.gpus, inputs, args.placement).chosen
        else:
            result = plan(arch, args.gpus, inputs, args.placement)
    except NoFit as e:
        print(f"megarl plan: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ArchError, ValueError, OSError) as e:
        print(f"megarl plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(result, gpu, eff, rl, f"plan for {args.model} ({arch.num_parameters() / 1e9:.1f}B)"))
    return 0
