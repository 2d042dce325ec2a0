"""Held-out evaluation (megarl.trainer.evaluation).

The metric arithmetic against hand-computed values; then one vLLM engine on the real
SmolLM2-135M-Instruct evaluating reasoning-gym sums: two evaluations of the same weights are
identical, and the greedy set's accuracy equals the one computed here without megarl's data,
tokenizer or reward code (reasoning-gym's entries and verifier, the chat template, the engine).
"""

from __future__ import annotations

import math
import re

import pytest

from megarl.config.schema import EvalConfig, EvalSetConfig, RewardTermConfig, RolloutConfig, RunConfig
from megarl.rewards.combined import RunReward
from megarl.trainer.evaluation import Evaluator, eval_due, final_table, pass_at_k, set_metrics
from megarl.trainer.metrics import write_plots

TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # the CPU demo's sums
MAX_TOKENS = 32  # rollout.max_tokens, which the greedy set takes
SAMPLED_MAX_TOKENS = 24  # the sampled set's own

# ---------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 0, 4, 0.0), (4, 1, 4, 1.0), (4, 4, 1, 1.0), (1, 0, 1, 0.0), (1, 1, 1, 1.0),
    (4, 1, 1, 0.25),  # one draw of four, one correct
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
])
def test_pass_at_k_is_chens_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_set_metrics_by_hand():
    # three prompts x four samples; correct = reward > 0.5: counts 0, 1 (the 0.5 is not), 4
    rewards = [[0.0, 0.0, 0.2, 0.0], [1.0, 0.5, 0.0, 0.0], [1.0, 1.0, 0.9, 1.0]]
    lengths = [[10, 12, 8, 10], [4, 4, 4, 4], [1, 2, 3, 2]]
    m = set_metrics("sums", rewards, lengths, threshold=0.5)
    assert m["eval/sums/accuracy"] == pytest.approx(5 / 12)
    assert m["eval/sums/mean_at_k"] == pytest.approx((0 + 1 / 4 + 1) / 3)
    assert m["eval/sums/pass_at_k"] == pytest.approx(2 / 3)  # any correct: prompts 2 and 3
    assert m["eval/sums/reward_mean"] == pytest.approx((0.2 + 1.5 + 3.9) / 12)
    assert m["eval/sums/response_length_mean"] == pytest.approx(64 / 12)
    assert m["eval/sums/prompts"] == 3.0
    greedy = set_metrics("g", [[1.0], [0.0], [0.75], [0.25]], [[1], [1], [1], [1]], threshold=0.5)
    assert greedy["eval/g/accuracy"] == greedy["eval/g/mean_at_k"] == greedy["eval/g/pass_at_k"] == 0.5
    with pytest.raises(ValueError, match="same number"):
        set_metrics("x", [[1.0], [1.0, 0.0]], [[1], [1, 1]], threshold=0.5)


def test_when_evaluation_is_due():
    sets = [EvalSetConfig(name="a", source="reasoning_gym:chain_sum")]
    every3 = EvalConfig(every=3, sets=sets)
    assert [s for s in range(11) if eval_due(every3, s, last_step=10)] == [0, 3, 6, 9, 10]
    ends = EvalConfig(every=0, before_training=False, sets=sets)
    assert [s for s in range(11) if eval_due(ends, s, last_step=10)] == [10]
    assert not any(eval_due(EvalConfig(every=1), s, last_step=10) for s in range(11))  # no sets: off


def test_final_table_and_plot(tmp_path):
    history = [
        {"step": 0, "eval/sums/accuracy": 0.25, "eval/sums/prompts": 16.0},
        {"step": 1, "reward/mean": 0.3},
        {"step": 2, "reward/mean": 0.4, "eval/sums/accuracy": 0.5, "eval/sums/prompts": 16.0,
         "eval/other/accuracy": 1.0},
    ]
    lines = final_table(history).splitlines()
    assert lines[0].split() == ["set", "metric", "before", "(step", "0)", "after", "(step", "2)"]
    assert lines[1].split() == ["other", "accuracy", "-", "1.0000"]
    assert lines[2].split() == ["sums", "accuracy", "0.2500", "0.5000"]
    assert lines[3].split() == ["sums", "prompts", "16", "16"]
    assert final_table([{"step": 1, "reward/mean": 0.3}]) == ""
    # one evaluation (none before training): one column, not the same figures twice
    single = final_table(history[1:]).splitlines()
    assert single[0].split() == ["set", "metric", "step", "2"] and single[2].split() == ["sums", "accuracy", "0.5000"]
    written = write_plots(history, tmp_path)
    assert {p.name for p in written} == {"reward.png", "eval_accuracy.png"}


# ---------------------------------------------------------------- one engine, real model


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def _config(**set_changes) -> RunConfig:
    sets = [EvalSetConfig(name="greedy", source="reasoning_gym:chain_sum", task_config=TASK, size=16,
                          instruction="{question}", max_prompt_len=128, seed=10_000),
            EvalSetConfig(name="sampled", source="reasoning_gym:chain_sum", task_config=TASK, size=4,
                          instruction="{question}", max_prompt_len=128, seed=20_000, samples=4, temperature=1.0,
                          max_tokens=SAMPLED_MAX_TOKENS)]
    for key, value in set_changes.items():
        setattr(sets[0], key, value)
    return RunConfig(rollout=RolloutConfig(max_tokens=MAX_TOKENS), eval=EvalConfig(sets=sets),
                     rewards=[RewardTermConfig(kind="reasoning_gym", extractor="last_number")])


def test_a_reward_model_term_is_left_out_and_bad_data_stops_the_start(tokenizer):
    cfg = _config()
    terms = [RewardTermConfig(kind="model"), *cfg.rewards]
    evaluator = Evaluator(cfg, [], tokenizer, RunReward(terms))
    assert [t.kind for t in evaluator.reward.terms] == ["reasoning_gym"]
    assert [len(s.prompts) for s in evaluator.sets] == [16, 4]
    with pytest.raises(ValueError, match=r"eval.sets\[0\] \(greedy\): prompt 0 has \d+ tokens > max_prompt_len 8"):
        Evaluator(_config(max_prompt_len=8), [], tokenizer, RunReward(cfg.rewards))


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine  # shared with test_episodes (conftest)


def _oracle_accuracy(engine, tokenizer, size: int, seed: int) -> float:
    """Greedy accuracy on chain_sum, from reasoning-gym's entries and verifier and the engine alone."""
    import ray
    import reasoning_gym

    from megarl.rollout.sampling import SamplingConfig

    entries = list(reasoning_gym.create_dataset("chain_sum", size=size, seed=seed, **TASK))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": e["question"]}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for e in entries]
    greedy = SamplingConfig(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[tokenizer.eos_token_id],
                            logprobs=False)
    groups = ray.get(engine.generate.remote([list(p) for p in prompts], greedy), timeout=300)
    score = reasoning_gym.get_score_answer_fn("chain_sum")
    right = 0
    for entry, (sample,) in zip(entries, groups, strict=True):
        text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        numbers = re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?", text)  # the last number said ('5-3': 3)
        right += score(numbers[-1] if numbers else None, entry) > 0.5
    return right / size


def test_evaluation_on_a_real_engine(engine, tokenizer):
    cfg = _config()
    evaluator = Evaluator(cfg, [engine], tokenizer, RunReward(cfg.rewards))
    first = evaluator.evaluate(step=0)
    again = evaluator.evaluate(step=0, version=0)  # the engine holds the initial weights, version 0
    assert first == again  # the same weights, the same numbers, bit for bit
    with pytest.raises(Exception, match="generation asked for policy version 3"):
        evaluator.evaluate(step=3, version=3)  # weights other than the step's are refused, as for rollout
    assert (first["eval/greedy/prompts"], first["eval/sampled/prompts"]) == (16, 4)
    for name, max_tokens in (("greedy", MAX_TOKENS), ("sampled", SAMPLED_MAX_TOKENS)):
        m = {key.split("/")[-1]: value for key, value in first.items() if key.startswith(f"eval/{name}/")}
        assert set(m) == {"accuracy", "mean_at_k", "pass_at_k", "reward_mean", "response_length_mean", "prompts"}
        assert m["accuracy"] == pytest.approx(m["mean_at_k"]) and m["pass_at_k"] >= m["mean_at_k"]
        assert 0 < m["response_length_mean"] <= max_tokens and all(math.isfinite(v) for v in m.values())
    # accuracy is a count of the 16 greedy answers, and the oracle's count
    assert first["eval/greedy/accuracy"] * 16 == round(first["eval/greedy/accuracy"] * 16)
    assert first["eval/greedy/accuracy"] == _oracle_accuracy(engine, tokenizer, size=16, seed=10_000)
    assert 0 < first["eval/greedy/accuracy"] < 1  # the model gets some right: the comparison means something
