"""Inputs refused in one line before any process starts (issue 40, item 4): the enumerated fields
checked from their ``Literal`` types (read from YAML or set in code), and the values that used to
get through: a zero learning rate, a negative entropy coefficient, a group larger than an engine
batches, more ranks than the machine holds, a model path that is a file, a config.json whose head
count is not a positive number, a recipe's own reward term that does not import."""

from __future__ import annotations

import json

import pytest

from megarl.cli.main import main
from megarl.config.loader import enumeration_errors, load_config
from megarl.config.schema import RunConfig

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256}


def refusal(capsys: pytest.CaptureFixture, *overrides: str) -> str:
    """`megarl train --check` on the demo recipe with ``overrides``: what it says on stderr, one
    line per problem (several problems: a heading and an indented line each), no traceback."""
    capsys.readouterr()
    assert main(["train", "--check", *overrides]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("megarl train: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("override,message", [
    ("actor.optim.lr=0", "actor.optim.lr=0.0 must be > 0"),
    ("algorithm.entropy_coef=-0.1", "algorithm.entropy_coef=-0.1 must be >= 0"),
    ("rollout.n=5000", "rollout.n=5000: a prompt's samples are generated together on one engine, which batches at "
                       "most rollout.max_num_seqs=64 sequences (8 rounds of it: 512)"),
    ("actor.model.path=README.md", "actor.model.path: model path README.md is a file"),
    ("rewards=[{kind: 'no_such_module:score'}]", "rewards[0].kind: cannot import 'no_such_module'"),
    ("rewards=[{kind: format, options: {x: 1}}]", "rewards[0].options are for a recipe's own scorer"),
    ("trainer.verify_sync=evry", "trainer.verify_sync: 'evry' is not one of first, every, never (did you mean "
                                 "'every'?)"),
])
def test_refused_in_one_line(capsys, override, message):
    assert message in refusal(capsys, override)


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("num_attention_heads", "32"),
                                         ("hidden_size", -64), ("num_key_value_heads", 1.5)])
def test_a_config_json_count_that_is_not_a_positive_number(capsys, tmp_path, field, value):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | {field: value}))
    line = refusal(capsys, f"actor.model.path={tmp_path}", f"reference.model.path={tmp_path}")
    assert f"config.json: {field}={value!r} must be a positive whole number" in line


def test_enumerations_of_a_config_built_in_code():
    cfg = load_config(RunConfig, None, [])
    assert enumeration_errors(cfg) == []
    cfg.actor.precision.dtype, cfg.algorithm.aggregation, cfg.rollout.weights = "bf16", None, "int4"
    cfg.algorithm.off_policy_correction = "tis"
    assert enumeration_errors(cfg) == [
        "actor.precision.dtype: 'bf16' is not one of float32, bfloat16, float16 (did you mean 'bfloat16'?)",
        "rollout.weights: 'int4' is not one of model, fp8, fp8_emulated"]


def test_more_ranks_than_the_machine_holds(capsys, tmp_path):
    """A recipe is sound anywhere (--check notes it), but a run started here with more CPUs in its
    bundles than a local Ray instance has would wait for them: refused before anything starts."""
    out = tmp_path / "run"
    args = ["train", "actor.cpus_per_rank=20", f"output_dir={out}"]
    assert main([*args, "--check"]) == 0
    assert "note: to run here: the run's ranks (actor 1, reference 1, rollout 1) ask for 22 cores" in \
        capsys.readouterr().err
    assert main(args) == 2
    assert "ask for 22 cores (local Ray's logical CPUs) and this machine has" in capsys.readouterr().err
    assert not out.exists()
