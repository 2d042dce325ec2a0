"""``megarl sft``, ``megarl rm``, ``megarl dpo``: the supervised stages of the RLHF pipeline."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from pathlib import Path

HELP = {
    "sft": "supervised fine-tuning on conversations (loss on the assistant tokens only)",
    "rm": "train a reward model on preference pairs (Bradley-Terry)",
    "dpo": "direct preference optimisation against a frozen reference model",
}

DESCRIPTION = """{help}, on megatron-core at the recipe's tp/pp/dp layout.

  megarl {stage} RECIPE.yaml                      run the recipe (examples: model_configs/cpu_rlhf_sft.yaml,
                                                cpu_rlhf_rm.yaml; a DPO recipe adds a dpo: section)
  megarl {stage} RECIPE.yaml model.optim.lr=1e-5  ... with dotted overrides
  megarl {stage} RECIPE.yaml --check              validate the recipe and every record, print the config

Data (data.train, data.eval): JSONL, Parquet or reasoning_gym:<task>. SFT records are
{{"messages": [...]}} or {{"prompt", "response"}}; preference records are
{{"prompt" or "messages", "chosen", "rejected"}} (optional "margin", "system"); KTO
(dpo.loss_type: kto) also reads unpaired records {{"prompt", "completion", "label": true|false}}.
Every record is tokenized with the model's chat template and checked before any process starts.

The run writes into output_dir: metrics.jsonl, tensorboard/, plots/ (training and held-out
loss, held-out pair accuracy) and checkpoints/ (megarl checkpoints: `megarl convert
mcore-to-hf` exports them; an RM checkpoint is a reward_model or critic source for
`megarl train`). Running it again continues from the last checkpoint (trainer.resume=auto).
"""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for stage, text in HELP.items():
        description = DESCRIPTION.format(stage=stage, help=text[0].upper() + text[1:])
        p = sub.add_parser(stage, help=text, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("recipe", help="YAML recipe")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.batch_size=32")
        p.add_argument("--check", action="store_true", help="validate the recipe and the data, print the config")
        p.set_defaults(handler=run, stage=stage)


def run(args: argparse.Namespace) -> int:
    import yaml

    from megarl.config.loader import ConfigError, load_config
    from megarl.config.supervised import SupervisedConfig
    from megarl.data.supervised import DataError
    from megarl.models.hf_arch import ArchError
    from megarl.trainer.supervised import load_stage_data, total_steps
    from megarl.validation.supervised_checks import validate_supervised

    name = f"megarl {args.stage}"
    try:
        cfg = load_config(SupervisedConfig, args.recipe, args.overrides)
        if cfg.stage and cfg.stage != args.stage:
            raise ConfigError(f"stage: the recipe is for {cfg.stage!r}; run it with `megarl {cfg.stage}`")
        cfg.stage = args.stage
        validate_supervised(cfg)
        data = load_stage_data(cfg, _tokenizer(cfg.model.model.path))
    except (ConfigError, ArchError, DataError, OSError) as e:  # OSError: an unreadable recipe, model or data
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    resolved = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    steps = total_steps(cfg, len(data.train))
    summary = (f"{len(data.train)} training and {len(data.eval)} held-out examples, {steps} steps of "
               f"{cfg.data.batch_size} {'sequences' if cfg.stage == 'sft' else 'pairs'}")
    if args.check:
        print(resolved + f"# {summary}")
        return 0
    out = Path(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(resolved)
    except OSError as e:
        print(f"{name}: error: output_dir={cfg.output_dir!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    from megarl.trainer.supervised import run_stage

    print(f"{name}: {cfg.name} -> {out}  ({summary})", flush=True)
    try:
        history = run_stage(cfg, data)
    except Exception as e:
        from megarl.cli.train import _one_line

        print(f"{name}: failed: {_one_line(e)}", file=sys.stderr)
        (out / "failure.log").write_text("".join(traceback.format_exception(e)))
        print(f"{name}: the full error is in {out / 'failure.log'}", file=sys.stderr)
        return 1
    for key in ("eval/heldout/loss", "eval/heldout/accuracy"):
        points = [h[key] for h in history if key in h]
        if len(points) >= 2:
            print(f"{key}: {points[0]:.4f} before -> {points[-1]:.4f} after", flush=True)
    return 0


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    from megarl.trainer.run import hf_folder

    return AutoTokenizer.from_pretrained(str(hf_folder(path)))
