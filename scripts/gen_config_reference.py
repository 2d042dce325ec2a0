"""Writes the configuration reference and the recipe table of the documentation from the code.

    python scripts/gen_config_reference.py           # rewrite docs/reference/{configuration,recipes}.md
    python scripts/gen_config_reference.py --check   # exit 1, naming the page, when a page is out of date

Every field of ``RunConfig`` (``megarl train``) and ``SupervisedConfig`` (``megarl sft / rm / dpo``),
nested dataclasses included, gets one table row: its dotted name, type, default, allowed values (the
choices of its ``typing.Literal`` type, or the names of the registry it is looked up in) and the comment
that explains it in ``megarl/config/schema.py`` or ``supervised.py`` (the comment lines right above the
field and the comment on its own line, read with ``tokenize``). Every recipe in ``model_configs/`` and
``megarl/recipes/`` gets a row: the command that runs it, what it is for (the first sentence of its
header comment) and the hardware it is laid out for.

This is documentation tooling, not part of megarl: nothing in ``megarl/`` imports it (the layer
contracts in pyproject.toml cover the package only). ``tests/test_docs_reference.py`` fails when a
checked-in page and the code drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PAGE = ROOT / "docs" / "reference" / "configuration.md"
RECIPES_PAGE = ROOT / "docs" / "reference" / "recipes.md"
RECIPE_DIRS = (ROOT / "model_configs", ROOT / "megarl" / "recipes")

# Fields named by a registry rather than a Literal type: where the names come from.
REGISTRIES: dict[tuple[str, str], tuple[str, str, str]] = {
    # (class, field): (module, attribute, what else is accepted)
    ("AlgorithmConfig", "name"): ("megarl.algorithms.registry", "ALGORITHMS", ""),
    ("RewardTermConfig", "kind"): ("megarl.rewards.terms", "REWARD_KINDS", "or `package.module:name`"),
    ("RewardTermConfig", "extractor"): ("megarl.rewards.extract", "EXTRACTORS", "or several joined by `|`"),
    ("EnvConfig", "kind"): ("megarl.envs.registry", "ENV_KINDS", "or `package.module:Class`"),
    ("EnvConfig", "tool_parser"): ("megarl.envs.tool_parsers.registry", "PARSERS", ""),
    ("ToolConfig", "name"): ("megarl.envs.tools.registry", "TOOL_NAMES", "or `package.module:Class`"),
    ("SupervisedConfig", "stage"): ("megarl.config.supervised", "STAGES", ""),
    ("RolloutConfig", "backend"): ("megarl.rollout.backends", "BACKENDS", ""),
}

# What a field is for, where megarl/config has no comment beside it. A comment added in the schema
# takes over: tests/test_docs_reference.py fails while a note here shadows one, so move the text there.
NOTES: dict[tuple[str, str], str] = {
    ("RunConfig", "name"): "The run's name, printed at start and in the logs.",
    ("RunConfig", "output_dir"): "Where the run writes metrics.jsonl, tensorboard/, plots/, checkpoints/ and "
                                 "failure.log; running again with the same directory resumes.",
    ("RunConfig", "seed"): "Seeds the data order, sampling and initialisation; a run is a function of it.",
    ("RunConfig", "actor"): "The trained policy: a megatron-core role.",
    ("RunConfig", "reference"): "The frozen reference policy for the KL terms; null: no reference.",
    ("RunConfig", "critic"): "The value model (PPO); null: none.",
    ("RunConfig", "reward_model"): "A megatron-core reward model scoring rollouts (a `model` reward term); "
                                   "null: none.",
    ("RunConfig", "rollout"): "The vLLM engines that generate.",
    ("RunConfig", "data"): "The training prompts.",
    ("RunConfig", "rewards"): "The reward terms, summed with their weights.",
    ("RunConfig", "algorithm"): "The RL algorithm and its loss settings.",
    ("RunConfig", "trainer"): "Steps, checkpoints, timeouts and the rollout schedule.",
    ("RolloutConfig", "tp"): "Tensor-parallel size of each vLLM engine.",
    ("RolloutConfig", "engines"): "Number of vLLM engines (data-parallel rollout).",
    ("RolloutConfig", "dtype"): "vLLM's compute dtype. float32 on CPU keeps its log-probs within 3e-5 of "
                                "the trainer's.",
    ("RolloutConfig", "max_model_len"): "vLLM's context length: prompt plus response (plus observations "
                                        "in multi-turn episodes).",
    ("RolloutConfig", "max_num_seqs"): "Sequences one engine decodes at once.",
    ("RolloutConfig", "colocate_with"): "A role whose bundles the engines share (colocated: they sleep "
                                        "while it trains); null: their own bundles.",
    ("RolloutConfig", "temperature"): "Sampling temperature; the actor and reference score at the same "
                                      "temperature.",
    ("RolloutConfig", "top_p"): "Nucleus sampling; 1.0: off.",
    ("RolloutConfig", "top_k"): "Top-k sampling; -1: off.",
    ("DataConfig", "system_prompt"): "A system message before every prompt; null: none.",
    ("DataConfig", "prompts_per_step"): "Prompts per step; the batch is prompts_per_step x rollout.n samples.",
    ("DataConfig", "max_prompt_len"): "Prompt tokens; a longer prompt is refused at start-up.",
    ("DataConfig", "seed"): "reasoning-gym: entry i is generated from seed + i.",
    ("RewardTermConfig", "weight"): "The term's weight in the summed reward.",
    ("RewardTermConfig", "extractor"): "How the answer is read from the response before it is scored.",
    ("RewardTermConfig", "timeout_s"): "remote: seconds per request attempt.",
    ("RewardTermConfig", "max_retries"): "remote: retries on 5xx, 429, refused connections and timeouts.",
    ("RewardTermConfig", "max_concurrency"): "remote: requests in flight at once.",
    ("AlgorithmConfig", "kl_coef"): "Weight of the KL to the reference (in the loss, or in the reward "
                                    "with kl_in_reward); 0: no KL.",
    ("AlgorithmConfig", "kl_estimator"): "Per-token KL estimator: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1, "
                                         "with d = log pi - log pi_ref.",
    ("AlgorithmConfig", "clip_high"): "The upper clip bound, 1 + clip_high (see clip_low); None: the "
                                      "algorithm's default.",
    ("AlgorithmConfig", "dual_clip"): "Dual clip c > 1: a negative-advantage token's loss is capped at "
                                      "-A * c; null: off.",
    ("AlgorithmConfig", "entropy_coef"): "Weight of the entropy bonus; 0: off.",
    ("AlgorithmConfig", "gamma"): "Discount of the per-token returns (PPO, REINFORCE++).",
    ("AlgorithmConfig", "lam"): "GAE's lambda (PPO).",
    ("AlgorithmConfig", "value_clip"): "PPO: the critic's new values are clipped to old +- value_clip in its "
                                       "loss; null: unclipped.",
    ("AlgorithmConfig", "ppo_epochs"): "Passes over each step's batch.",
    ("AlgorithmConfig", "overlong_penalty"): "The penalty at the length limit; it grows linearly over the last "
                                             "overlong_buffer tokens.",
    ("AlgorithmConfig", "is_cap"): "tis: the cap on each token's weight.",
    ("AlgorithmConfig", "is_low"): "mis, icepop, token_mask: the lower end of the ratio band.",
    ("AlgorithmConfig", "is_high"): "mis, icepop, token_mask: the upper end of the ratio band.",
    ("AlgorithmConfig", "clip_cov_high"): "clip_cov: the upper end of the covariance band (see clip_cov_low).",
    ("AlgorithmConfig", "sapo_tau_neg"): "sapo: the soft gate's temperature for negative advantages (see "
                                         "sapo_tau_pos).",
    ("TrainerConfig", "steps"): "Training steps (one rollout batch and its update each).",
    ("TrainerConfig", "bucket_mib"): "The weight sync's bucket size: the memory a rank adds while it sends "
                                     "or receives.",
    ("TrainerConfig", "tensorboard"): "Write TensorBoard logs under output_dir/tensorboard.",
    ("TrainerConfig", "step_timeout_s"): "The longest one phase of a step may take (generation, a role's "
                                         "call) before the run ends with the phase named.",
    ("TrainerConfig", "collective_timeout_s"): "The longest a collective or a short control call may take.",
    ("EvalSetConfig", "system_prompt"): "A system message before every prompt; null: none.",
    ("EnvConfig", "tools"): "kind tools: the tools the policy may call.",
    ("EnvConfig", "timeout_s"): "remote: seconds per request attempt.",
    ("EnvConfig", "max_retries"): "remote: retries on 5xx, 429, refused connections and timeouts.",
    ("EnvConfig", "max_concurrency"): "remote: requests in flight per engine.",
    ("SupervisedConfig", "name"): "The run's name, printed at start and in the logs.",
    ("SupervisedConfig", "output_dir"): "Where the stage writes metrics, plots and checkpoints; the last "
                                        "checkpoint is also output_dir/final, the next stage's input.",
    ("SupervisedConfig", "seed"): "Seeds initialisation and data order.",
    ("SupervisedConfig", "model"): "The trained model: a megatron-core role.",
    ("SupervisedConfig", "data"): "The training and held-out records.",
    ("SupervisedConfig", "trainer"): "Steps, evaluation, checkpoints and timeouts.",
    ("SupervisedConfig", "dpo"): "DPO and KTO settings (megarl dpo).",
    ("SupervisedDataConfig", "eval_size"): "Records of train held out when eval is empty.",
    ("SupervisedDataConfig", "task_config"): "reasoning-gym dataset options.",
    ("SupervisedTrainerConfig", "epochs"): "Passes over the training records when steps is 0.",
    ("SupervisedTrainerConfig", "tensorboard"): "Write TensorBoard logs under output_dir/tensorboard.",
    ("SupervisedTrainerConfig", "step_timeout_s"): "The longest one step may take before the run ends.",
    ("SupervisedTrainerConfig", "collective_timeout_s"): "The longest a collective or a short control call "
                                                         "may take.",
    ("DpoConfig", "beta"): "The strength of the KL regularisation toward the reference (DPO's and KTO's beta).",
    ("DpoConfig", "undesirable_weight"): "kto: the weight of undesirable examples' losses (see "
                                         "desirable_weight).",
    ("RoleConfig", "model"): "Which weights the role loads.",
    ("RoleConfig", "parallel"): "The role's layout.",
    ("RoleConfig", "precision"): "The role's dtype and FP8.",
    ("RoleConfig", "cpus_per_rank"): "CPUs Ray reserves for each rank.",
    ("ParallelConfig", "tp"): "Tensor-parallel size: must divide the attention heads and query groups.",
    ("ParallelConfig", "pp"): "Pipeline-parallel size: must divide the layers (or see first_stage_layers).",
    ("ParallelConfig", "cp"): "Context-parallel size: each rank holds 2 of the 2·cp chunks of every sequence.",
    ("ParallelConfig", "sequence_parallel"): "Megatron-core's sequence parallelism over the tp ranks "
                                             "(required to train a MoE model at tp > 1).",
    ("ParallelConfig", "last_stage_layers"): "The last pipeline stage's layer count (see first_stage_layers).",
    ("PrecisionConfig", "fp8_recipe"): "Transformer Engine's FP8 scaling recipe (mxfp8 needs Blackwell).",
    ("PrecisionConfig", "fp8_amax_history_len"): "Transformer Engine's amax history for the delayed recipe.",
    ("OptimizerConfig", "lr"): "Adam's learning rate (must be > 0).",
    ("OptimizerConfig", "weight_decay"): "Weight decay.",
    ("OptimizerConfig", "adam_beta1"): "Adam's beta1.",
    ("OptimizerConfig", "adam_beta2"): "Adam's beta2.",
    ("OptimizerConfig", "adam_eps"): "Adam's epsilon.",
    ("OptimizerConfig", "clip_grad"): "Gradient norm clipping; 0: off.",
    ("OptimizerConfig", "use_distributed_optimizer"): "megatron-core's distributed optimizer: Adam's state "
                                                      "sharded over the data-parallel ranks.",
    ("RecomputeConfig", "granularity"): "none, selective (the modules below) or full (whole layers).",
    ("MoeConfig", "load_balancing"): "The auxiliary load-balancing loss; none: no extra loss.",
    ("MoeConfig", "aux_loss_coeff"): "The load-balancing loss's weight (> 0 exactly when load_balancing is set).",
    ("MoeConfig", "z_loss_coeff"): "The router z-loss's weight; null: none.",
    ("MoeConfig", "token_drop_policy"): "Which tokens an overflowing expert drops: lowest router "
                                        "probability (probs) or latest position.",
}

# A section that appears under several names is written once, under a placeholder.
PLACEHOLDERS = {"RoleConfig": "ROLE"}

HEADER = """# Configuration reference

<!-- Generated by `python scripts/gen_config_reference.py` from megarl/config/schema.py and
megarl/config/supervised.py: edit the comments there, not this page. -->

A run is a YAML recipe read into typed dataclasses, with dotted overrides on the command line:

```bash
megarl train RECIPE.yaml actor.parallel.tp=2 trainer.steps=50   # RL
megarl sft RECIPE.yaml model.optim.lr=1e-5                      # supervised stages: sft, rm, dpo
megarl train RECIPE.yaml --check                                # print the resolved config and exit
```

An unknown key, a value of the wrong type, or a value outside a field's allowed values is refused
before anything starts, with the dotted field named. `null` in YAML is Python's `None`.
This page is generated from the schema: every field below has its type, default, allowed values and
the comment beside it in the source. Recipes to start from: [Recipes](recipes.md).

**{n_fields} fields in {n_sections} sections.**

"""


# ---------------------------------------------------------------- comments from the source


@functools.cache
def _source(path: str) -> tuple[ast.Module, dict[int, str], set[int]]:
    """The module's tree, each line's comment text, and the lines that hold only a comment."""
    text = Path(path).read_text()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = text.splitlines()
    only = {n for n in comments if lines[n - 1].lstrip().startswith("#")}
    return ast.parse(text), comments, only


def _class_node(cls: type) -> ast.ClassDef:
    tree, _, _ = _source(inspect.getsourcefile(cls))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    raise LookupError(f"{cls.__name__}: no class definition in {inspect.getsourcefile(cls)}")


def field_sources(cls: type) -> dict[str, tuple[str, str]]:
    """Each field's annotation as written and its comment: the comment-only lines right above it
    (up to a blank line or code) followed by the comments on its own lines."""
    _, comments, only = _source(inspect.getsourcefile(cls))
    out = {}
    for stmt in _class_node(cls).body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line in only:
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments and n not in only]
        text = " ".join(part for part in above + beside if part)
        out[stmt.target.id] = (ast.unparse(stmt.annotation), text)
    return out


def class_doc(cls: type) -> str:
    doc = ast.get_docstring(_class_node(cls))
    return inspect.cleandoc(doc) if doc else ""


# ---------------------------------------------------------------- types, defaults, choices


def _is_dataclass_type(t) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _optional(hint) -> tuple[object, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _name(t) -> str:
    if t is type(None):
        return "null"
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return "str"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(t))
    if origin is not None:
        args = ", ".join(_name(a) for a in typing.get_args(t))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    if _is_dataclass_type(t):
        return "section"
    return getattr(t, "__name__", str(t))


def nested(hint) -> tuple[type | None, bool]:
    """The dataclass a field holds (itself, optionally, or as list items) and whether it is a list."""
    inner, _ = _optional(hint)
    if typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        return (item, True) if _is_dataclass_type(item) else (None, False)
    return (inner, False) if _is_dataclass_type(inner) else (None, False)


def choices(cls: type, name: str, hint) -> tuple[list[str], str]:
    """Allowed values (as shown) and what else is accepted."""
    inner, none_ok = _optional(hint)
    values: list[str] = []
    extra = ""
    if typing.get_origin(inner) is typing.Literal:
        values = [str(v) for v in typing.get_args(inner)]
    elif (cls.__name__, name) in REGISTRIES:
        module, attr, extra = REGISTRIES[(cls.__name__, name)]
        values = [str(v) for v in getattr(importlib.import_module(module), attr)]
    if values and none_ok:
        values.append("null")
    return values, extra


def _yaml_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    if dataclasses.is_dataclass(value):
        return "{...}"
    if isinstance(value, list):
        if value and dataclasses.is_dataclass(value[0]):
            return f"{len(value)} entry with the defaults below" if len(value) == 1 else f"{len(value)} entries"
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _yaml_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "the section's defaults"
        return _yaml_value(value)
    return "required"


# ---------------------------------------------------------------- markdown


def _escape(text: str) -> str:
    """Markdown table-cell text: code spans (``x`` or `x`) kept, the rest escaped."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    parts = re.split(r"(`[^`]+`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(part.replace("|", "&#124;"))
        else:
            part = part.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            out.append(re.sub(r"([*_\[\]])", r"\\\1", part))
    return "".join(out)


def _code(text: str) -> str:
    return "`" + text.replace("|", "&#124;") + "`"


@dataclasses.dataclass
class Section:
    cls: type
    path: str  # dotted prefix of its fields ("trainer", "ROLE.parallel", "rewards[]", "" for the root)
    where: list[str]  # every place it appears (for sections under a placeholder)
    rows: list[tuple[str, str, str, str, str]] = dataclasses.field(default_factory=list)

    @property
    def anchor(self) -> str:
        return self.cls.__name__.lower()


def _walk(root: type, sections: dict[type, Section], order: list[Section], prefix: str = "") -> None:
    """Depth-first: a section, then the sections its fields hold, in field order."""
    if root in sections:
        return
    section = Section(root, prefix, [prefix] if prefix else [])
    sections[root] = section
    order.append(section)
    hints = typing.get_type_hints(root)
    sources = field_sources(root)
    children = []
    for f in dataclasses.fields(root):
        hint = hints[f.name]
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        child, is_list = nested(hint)
        annotation, comment = sources.get(f.name, ("", ""))
        comment = comment or NOTES.get((root.__name__, f.name), "")
        values, extra = choices(root, f.name, hint)
        allowed = ", ".join(_code(v) for v in values)
        if extra:
            allowed = f"{allowed} {extra}" if allowed else extra
        type_text = _name(hint)
        if child is not None:
            sub = PLACEHOLDERS.get(child.__name__, dotted + ("[]" if is_list else ""))
            if child in sections:
                sections[child].where.append(dotted)
            else:
                children.append((child, sub, dotted))
            target = f"[{_escape(child.__name__)}](#{child.__name__.lower()})"
            type_text = f"list of {target}" if is_list else (f"{target} or null" if _optional(hint)[1] else target)
            type_cell = type_text
        else:
            type_cell = _escape(type_text)
        section.rows.append((_code(dotted), type_cell, _escape(default(f)), allowed, _escape(comment)))
    for child, sub, dotted in children:
        if child in sections:
            sections[child].where.append(dotted)
            continue
        _walk(child, sections, order, sub)
        if sub != dotted:  # a placeholder: the first place it appears is a "where" too
            sections[child].where[:] = [dotted]


def collect(roots: list[type]) -> list[Section]:
    sections: dict[type, Section] = {}
    order: list[Section] = []
    for root in roots:
        _walk(root, sections, order)
    return order


def _where(section: Section) -> str:
    if not section.path or section.path == section.where[0] and len(section.where) == 1:
        return ""
    return "Appears as " + ", ".join(_code(w) for w in section.where) + "."


def _algorithm_defaults() -> str:
    from megarl.config.schema import ALGORITHM_DEFAULTS

    keys = list(ALGORITHM_DEFAULTS["*"])
    lines = ["Fields left `null` take their algorithm's value when the config is built:", "",
             "| algorithm | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, row in ALGORITHM_DEFAULTS.items():
        merged = {**ALGORITHM_DEFAULTS["*"], **row}
        label = "every other" if name == "*" else _code(name)
        lines.append(f"| {label} | " + " | ".join(_code(_yaml_value(merged[k])) for k in keys) + " |")
    return "\n".join(lines) + "\n\n"


def _render_section(section: Section) -> str:
    name = section.path or "top level"
    parts = [f"### {_code(name) if section.path else name} {{#{section.anchor}}}\n\n"]
    text = class_doc(section.cls)
    if text and section.path:
        parts.append(_escape_prose(text) + "\n\n")
    if section.cls.__name__ == "AlgorithmConfig":
        parts.append(_algorithm_defaults())
    where = _where(section)
    parts.append("Class: " + _code(f"{section.cls.__module__}.{section.cls.__qualname__}") + "."
                 + (f" {where}" if where else "") + "\n\n")
    parts.append("| field | type | default | allowed values | description |\n|---|---|---|---|---|\n")
    parts += ["| " + " | ".join(row) + " |\n" for row in section.rows]
    return "".join(parts) + "\n"


def render_config(run_cls: type | None = None, supervised_cls: type | None = None) -> str:
    """The configuration page; the two roots can be replaced (the drift test renders a changed schema)."""
    if run_cls is None or supervised_cls is None:
        from megarl.config.schema import RunConfig
        from megarl.config.supervised import SupervisedConfig

        run_cls, supervised_cls = run_cls or RunConfig, supervised_cls or SupervisedConfig
    seen: dict[type, Section] = {}
    run_order: list[Section] = []
    supervised_order: list[Section] = []
    _walk(run_cls, seen, run_order)
    _walk(supervised_cls, seen, supervised_order)
    shared = tuple(PLACEHOLDERS.values())

    def is_shared(section: Section) -> bool:
        return section.path.split(".")[0] in shared

    groups = [
        ("`megarl train`: RunConfig", "An RL run: its roles, rollout, data, rewards, algorithm and trainer.",
         [s for s in run_order if not is_shared(s)]),
        ("`megarl sft`, `megarl rm`, `megarl dpo`: SupervisedConfig",
         "The supervised stages: one recipe shape for the three; `stage` is set by the command.",
         [s for s in supervised_order if not is_shared(s)]),
        ("Roles (`ROLE`)", "A Megatron role: the RL run's `actor`, `reference`, `critic` and `reward_model`, "
         "the supervised stages' `model` and `reference`. Each is a megatron-core model with its own layout; "
         "`ROLE` below stands for the role's name (`actor.parallel.tp`, `model.optim.lr`).",
         [s for s in run_order + supervised_order if is_shared(s)]),
    ]
    parts = []
    for title, intro, sections in groups:
        parts.append(f"## {title}\n\n{intro}\n\n")
        parts += [_render_section(s) for s in sections]
    every = run_order + supervised_order
    n_fields = sum(len(s.rows) for s in every)
    head = HEADER.replace("{n_fields}", str(n_fields)).replace("{n_sections}", str(len(every)))
    return (head + "".join(parts)).rstrip("\n") + "\n"


def _escape_prose(text: str) -> str:
    """A class docstring as a paragraph: reST ``code`` to Markdown, angle brackets escaped."""
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    parts = re.split(r"(`[^`]+`)", text)
    return "".join(p if i % 2 else p.replace("<", "&lt;").replace("*", "\\*") for i, p in enumerate(parts))


def schema_field_count(roots: list[type]) -> int:
    """Fields of every dataclass reachable from ``roots``, each dataclass counted once."""
    seen: set[type] = set()
    stack = list(roots)
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        stack += [c for f in dataclasses.fields(cls) if (c := nested(hints[f.name])[0]) is not None]
    return sum(len(dataclasses.fields(c)) for c in seen)


# ---------------------------------------------------------------- recipes


def _header(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    paragraph = " ".join(lines).split("  ")[0]
    return paragraph.strip()


def _first_sentence(text: str) -> str:
    match = re.search(r"^(.+?[.])(\s|$)", text)
    return (match.group(1) if match else text).strip()


def _ranks(role: dict) -> int:
    parallel = role.get("parallel") or {}
    size = parallel.get("world_size")
    if size is None:
        size = (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1)) * (parallel.get("dp") or 1)
    return int(size)


def recipe_row(path: Path) -> tuple[str, str, str, str]:
    text = path.read_text()
    raw = yaml.safe_load(text) or {}
    header = _header(text)
    stage = raw.get("stage")
    command = f"megarl {stage}" if stage else "megarl train"
    if stage:
        what = stage
    elif raw.get("env"):
        what = f"{(raw.get('algorithm') or {}).get('name', 'grpo')}, multi-turn"
    else:
        what = (raw.get("algorithm") or {}).get("name", "grpo")
    gpus = re.search(r":? ?(\d+) GPUs? \(([^)]*)\)", header)
    purpose = _first_sentence(header)
    if gpus:
        hardware = f"{gpus.group(1)} GPUs ({gpus.group(2)})"
        # "Model, GRPO: N GPUs (...)." says the hardware; the layout sentence after it says more
        rest = header[len(purpose):].strip()
        purpose = purpose.replace(gpus.group(0), "").rstrip(". ,") + ". " + _first_sentence(rest)
    else:
        if stage:
            roles = [raw.get("model") or {}] + ([raw["reference"]] if raw.get("reference") else [])
        else:
            roles = [raw.get(r) for r in ("actor", "reference", "critic", "reward_model") if raw.get(r)]
        ranks = sum(_ranks(r) for r in roles)
        hardware = f"CPU: {ranks} Megatron rank{'s' if ranks > 1 else ''}"
        if not stage:
            rollout = raw.get("rollout") or {}
            engines = rollout.get("engines", 1)
            hardware += f", {engines} vLLM engine{'s' if engines > 1 else ''} (tp {rollout.get('tp', 1)})"
    shown = path.relative_to(ROOT).as_posix()
    return (f"`{shown}`", f"`{command}` ({what})", _escape(purpose), _escape(hardware))


def recipe_paths() -> list[Path]:
    return [p for d in RECIPE_DIRS for p in sorted(d.glob("*.yaml"))]


def render_recipes() -> str:
    rows = [recipe_row(p) for p in recipe_paths()]
    lines = [
        "# Recipes",
        "",
        "<!-- Generated by `python scripts/gen_config_reference.py` from the recipes' header comments:",
        "edit those, not this page. -->",
        "",
        "A recipe is a YAML file of [configuration](configuration.md) fields. Start from the one closest",
        "to your model and hardware, and change it with dotted overrides or a copy of the file.",
        "`megarl train RECIPE.yaml --check` (or `megarl sft ... --check`) validates it on any machine;",
        "the GPU recipes name their architecture (`model.arch`), so they validate and plan without the",
        "weights: `megarl plan --model RECIPE.yaml` prints each GPU's memory.",
        "",
        f"**{len(rows)} recipes.** The embedded demo (`megarl/recipes/cpu_demo_grpo.yaml`) is what a bare",
        "`megarl train` runs.",
        "",
        "| recipe | command | what it is for | hardware |",
        "|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line


def pages() -> dict[Path, str]:
    return {CONFIG_PAGE: render_config(), RECIPES_PAGE: render_recipes()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a checked-in page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, text in pages().items():
        shown = path.relative_to(ROOT)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(shown))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {shown}")
    if stale:
        print("out of date (run python scripts/gen_config_reference.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
