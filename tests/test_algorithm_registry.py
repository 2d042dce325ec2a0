"""The algorithm home: every registered algorithm behind one interface (megarl.algorithms.base/registry).

Validation of each algorithm's default run, one line for an unknown name, the rules of their own,
the defaults that depend on the algorithm, Dr. GRPO by name and as a GRPO combination, and the
metrics: declared, and combined over data-parallel shards as declared.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megarl.algorithms import ALGORITHMS, get_algorithm
from megarl.algorithms.base import PolicyMicroBatch, ScoredBatch, combine
from megarl.algorithms.registry import algorithm_errors
from megarl.config.loader import ConfigError, load_config
from megarl.config.schema import AlgorithmConfig, ModelConfig, RoleConfig, RunConfig
from megarl.platform import Platform
from megarl.validation.checks import validate_run

CPU = Platform(name="cpu", backend="gloo", has_transformer_engine=False)
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 100, "hidden_act": "silu",
         "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA))
    return str(tmp_path / "llama")


def run_config(model_dir: str, **algorithm) -> RunConfig:
    cfg = AlgorithmConfig(**algorithm)
    role = RoleConfig(model=ModelConfig(path=model_dir))
    critic = RoleConfig(model=ModelConfig(path=model_dir)) if get_algorithm(cfg.name).needs_critic else None
    teacher = RoleConfig(model=ModelConfig(path=model_dir)) if get_algorithm(cfg.name).needs_teacher(cfg) else None
    return RunConfig(actor=role, critic=critic, teacher=teacher, algorithm=cfg)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_registered_algorithm_validates_its_default_run(name, model_dir):
    cfg = run_config(model_dir, name=name)
    assert algorithm_errors(cfg) == []
    assert "actor" in validate_run(cfg, CPU)
    assert get_algorithm(name).name == name


def test_an_unknown_name_is_one_line_naming_the_known_ones(model_dir):
    cfg = run_config(model_dir)
    cfg.algorithm.name = "grpoo"
    assert algorithm_errors(cfg) == [f"algorithm.name='grpoo' must be one of {', '.join(ALGORITHMS)}"]
    with pytest.raises(ConfigError) as info:
        validate_run(cfg, CPU)
    assert str(info.value) == f"invalid configuration: algorithm.name='grpoo' must be one of {', '.join(ALGORITHMS)}"
    with pytest.raises(ValueError, match="algorithm.name='grpoo' must be one of grpo, dr_grpo"):
        get_algorithm("grpoo")


def test_rules_of_their_own_and_shared_ones_name_the_field(model_dir):
    def errors(**algorithm):
        return algorithm_errors(run_config(model_dir, **algorithm))

    assert errors(name="dr_grpo", norm_std=True) == [
        "algorithm.norm_std=True: dr_grpo does not divide by the group's std (that is grpo)"]
    assert errors(name="dr_grpo", aggregation="token-mean") == [
        "algorithm.aggregation='token-mean': dr_grpo sums each sequence's token losses over a constant length, "
        "seq-mean-token-sum"]
    # a sequence-level reward has no token to put the KL on: it would be in neither reward nor loss
    assert errors(name="rloo", kl_in_reward=True)[0].startswith("algorithm.kl_in_reward=True: rloo rewards whole")
    assert errors(name="reinforce_pp", kl_in_reward=True) == []
    cfg = run_config(model_dir, name="ppo")
    cfg.critic = None
    assert algorithm_errors(cfg) == ["algorithm.name='ppo' needs a critic role (critic.model.path, or a "
                                     "reward_model to start from)"]
    cfg = run_config(model_dir, name="rloo")
    cfg.rollout.n = 1
    assert algorithm_errors(cfg) == ["rollout.n=1: rloo compares samples of a prompt, it needs n >= 2"]
    cfg.algorithm = AlgorithmConfig(name="reinforce_pp")  # one sample per prompt is enough
    assert algorithm_errors(cfg) == []


def test_defaults_that_depend_on_the_algorithm_are_resolved_when_the_config_is_built():
    grpo, dr = AlgorithmConfig(), load_config(RunConfig, overrides=["algorithm.name=dr_grpo"]).algorithm
    assert (grpo.clip_low, grpo.clip_high, grpo.aggregation, grpo.norm_std) == (0.2, 0.2, "token-mean", True)
    assert (dr.aggregation, dr.norm_std, dr.clip_low) == ("seq-mean-token-sum", False, 0.2)
    # a value given wins; a round trip through a dict (as tests hand the ranks) keeps the values
    assert AlgorithmConfig(name="dr_grpo", clip_high=0.28).clip_high == 0.28
    assert AlgorithmConfig(**vars(dr)) == dr


def test_dr_grpo_by_name_is_the_grpo_combination():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 2.0])
    mask = (torch.arange(4)[None] < torch.tensor([4, 2, 3, 1, 4, 2])[:, None]).float()
    by_name = AlgorithmConfig(name="dr_grpo")
    combination = AlgorithmConfig(name="grpo", norm_std=False, aggregation="seq-mean-token-sum")
    est = {cfg.name: get_algorithm(cfg.name).estimate(cfg, ScoredBatch(scores, mask, 3))
           for cfg in (by_name, combination)}
    assert torch.equal(est["dr_grpo"].advantages, est["grpo"].advantages)
    # group 0: mean 1/3, so 2/3, -1/3, -1/3 on every token (no division by the std)
    torch.testing.assert_close(est["grpo"].advantages[:3, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    lp = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    losses = {}
    for cfg in (by_name, combination):
        mb = PolicyMicroBatch(logprobs=lp, old_logprobs=lp - 0.1, advantages=est[cfg.name].advantages, mask=mask,
                              denom=6.0, norm_len=4.0)
        losses[cfg.name] = get_algorithm(cfg.name).loss(cfg, mb)[0]
    assert torch.equal(losses["dr_grpo"], losses["grpo"])


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_loss_emits_only_declared_metrics(name):
    cfg = AlgorithmConfig(name=name, kl_coef=0.1, entropy_coef=0.01)
    algorithm = get_algorithm(cfg.name)
    lp = -torch.rand(4, 3, generator=torch.Generator().manual_seed(1)) - 0.1
    mb = PolicyMicroBatch(logprobs=lp.requires_grad_(), old_logprobs=lp.detach() - 1e-4,
                          advantages=torch.tensor([1.0, -1.0, 0.5, 0.0]), mask=torch.ones(4, 3), denom=12.0,
                          norm_len=3.0, ref_logprobs=lp.detach() - 0.2, entropy=torch.full((4, 3), 0.5))
    loss, out = algorithm.loss(cfg, mb)
    loss.backward()
    declared = {m.name for m in algorithm.loss_metrics()}
    assert {"pg_loss", "kl_loss", "entropy"} <= set(out) <= declared
    assert all(m.reduce in ("mean", "sum", "same") for m in algorithm.loss_metrics())


def test_the_driver_combines_shards_as_the_ranks_declare():
    from megarl.trainer.roles import MegatronRole
    from megarl.workers.rank_batch import RankBatch
    from megarl.workers.rank_results import UpdateResult

    shard = UpdateResult(steps=[{"pg_loss": 0.25, "clip_fraction": 0.125, "grad_norm": 2.0}],
                         reduce={"pg_loss": "sum", "clip_fraction": "mean", "grad_norm": "same"})
    seen = {}

    def run(fn, timeout_s, **kwargs):
        seen.update(kwargs)
        return [shard, None, shard]  # two reporting shards and a rank that reports nothing

    role = MegatronRole("actor", RoleConfig(), SimpleNamespace(run=run), source="", timeout_s=1.0)
    algo = AlgorithmConfig()
    batch = RankBatch(tokens=torch.zeros(2, 3, dtype=torch.long), mask=torch.zeros(2, 2))
    metrics, per_token = role.train(lambda **_: None, batch, algo)
    assert metrics == {"actor/pg_loss": 0.5, "actor/clip_fraction": 0.25, "actor/grad_norm": 2.0}
    assert per_token is None
    assert seen["algo"] is algo and seen["optim"] is role.cfg.optim  # the dataclasses themselves cross to the ranks
    assert combine([1.0, 2.0], "same") == 1.0 and combine([1.0, 2.0], "sum") == 3.0
