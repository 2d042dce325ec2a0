"""``data.source: verifiers:<environment>[@eval]``: a verifiers environment's own dataset as the
run's prompts. Its questions are checked against reasoning-gym's own generation of the same
task (vf_chain_sum builds its datasets from it, so the two must agree item for item), and a source
that cannot load is refused in one line before start."""

from __future__ import annotations

import pytest

from megarl.config.loader import ConfigError, load_config
from megarl.config.schema import RunConfig
from megarl.data.prompts import from_reasoning_gym, from_verifiers

VF = "verifiers:megarl.envs.examples.vf_chain_sum"
SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_the_environments_dataset_and_eval_dataset_are_its_task_item_for_item():
    train = from_verifiers(VF, {**SUMS, "size": 12, "seed": 3})
    held_out = from_verifiers(VF + "@eval", {**SUMS, "eval_size": 5, "eval_seed": 100000})
    for items, size, seed in ((train, 12, 3), (held_out, 5, 100000)):
        gym = from_reasoning_gym("chain_sum", size=size, seed=seed, instruction_template="{question}", **SUMS)
        assert [i.prompt for i in items] == [g.messages[-1]["content"] for g in gym]
        assert [i.metadata["answer"] for i in items] == [str(g.metadata["answer"]) for g in gym]
        assert all(i.metadata["task"] == "default" and i.metadata["info"] == {} for i in items)


@pytest.mark.parametrize("source, options, match", [
    ("verifiers:", {}, "names no environment"),
    ("verifiers:no-such-env-here", {}, "no module 'no_such_env_here' is installed"),
    (VF, {"colour": "red"}, "load_environment failed: .*colour"),
])
def test_a_source_that_cannot_load_is_refused_in_one_line(source, options, match):
    with pytest.raises(ValueError, match=match) as refused:
        from_verifiers(source, options)
    assert "\n" not in str(refused.value)


def test_the_run_refuses_it_before_start_naming_the_field(smollm2):
    from megarl.validation.checks import validate_run

    cfg = load_config(RunConfig, None, [f"actor.model.path={smollm2}", "data.source=verifiers:no-such-env-here"])
    with pytest.raises(ConfigError, match="data.source: 'verifiers:no-such-env-here': no module") as refused:
        validate_run(cfg)
    assert len(str(refused.value).splitlines()) <= 2
