"""Generation through the rollout engine (vLLM on CPU), checked against vLLM's own scoring."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_hf

from megarl.rollout.sampling import SamplingConfig


class _Remote:
    """Calls a Ray actor's methods synchronously (the engine runs in its own actor, as in a run)."""

    def __init__(self, handle):
        self.handle = handle

    def __getattr__(self, name):
        import ray

        return lambda *args, **kwargs: ray.get(getattr(self.handle, name).remote(*args, **kwargs), timeout=300)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_hf("llama", tmp_path_factory.mktemp("rollout") / "llama", hidden_size=128,
                         intermediate_size=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def engine(model):
    import ray

    from megarl.cluster.ray_env import ensure_ray
    from megarl.rollout.remote import start_engine, wait_ready

    ensure_ray()
    handle = start_engine(str(model), tp=1, max_model_len=256, max_num_seqs=8)
    wait_ready([handle])
    yield _Remote(handle)
    ray.kill(handle)


def test_samples_carry_the_engines_own_logprobs(engine):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=12, n=3, seed=0))
    assert [len(group) for group in out] == [3, 3]
    for prompt, group in zip(prompts, out, strict=True):
        for sample in group:
            assert sample.prompt_ids == prompt
            assert len(sample.response_ids) == len(sample.logprobs) == 12
            assert sample.finish_reason == "length"
            # oracle: the engine scoring the whole sequence gives the same log-probabilities
            scored = engine.prompt_logprobs([prompt + sample.response_ids])[0][len(prompt) - 1:]
            assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(scored), atol=1e-4)
    # three samples of one prompt are not all equal (sampling, not greedy)
    assert len({tuple(s.response_ids) for s in out[0]}) > 1


def test_stop_tokens_seed_and_greedy(engine):
    greedy = engine.generate([[1, 2, 3]], SamplingConfig(temperature=0.0, max_tokens=8))[0][0]
    again = engine.generate([[1, 2, 3]], SamplingConfig(temperature=0.0, max_tokens=8))[0][0]
    assert greedy.response_ids == again.response_ids
    stop = greedy.response_ids[3]
    stopped = engine.generate([[1, 2, 3]], SamplingConfig(temperature=0.0, max_tokens=8, stop_token_ids=[stop]))
    sample = stopped[0][0]
    assert sample.finish_reason == "stop"
    assert sample.response_ids == greedy.response_ids[:greedy.response_ids.index(stop) + 1]
    a = engine.generate([[4, 5]], SamplingConfig(temperature=1.0, max_tokens=10, seed=7))[0][0].response_ids
    b = engine.generate([[4, 5]], SamplingConfig(temperature=1.0, max_tokens=10, seed=7))[0][0].response_ids
    assert a == b


def test_sample_logprobs_are_the_tempered_policys_as_the_trainer_scores_it(engine, model):
    """At T = 0.7 the tokens come from softmax(logits / 0.7): vLLM reports their log-probs under it,
    and a Megatron rank scoring the batch (as the actor and reference do) uses the same T."""
    from megarl.config.schema import ParallelConfig
    from megarl.trainer.batch import build_batch
    from megarl.workers import WorkerGroup, megatron_model, rl_fns

    out = engine.generate([[1, 2, 3, 4, 5], [9, 8, 7]], SamplingConfig(temperature=0.7, max_tokens=12, n=2, seed=3))
    batch = build_batch(out, pad_id=0, temperature=0.7)
    with WorkerGroup("scorer", 1) as group:
        group.run(megatron_model.load, key="scorer", source=str(model), parallel=ParallelConfig())
        tempered, untempered = (
            rl_fns.gather_shards(group.run(rl_fns.logprobs, key="scorer", micro_batch_size=4,
                                           batch=dataclasses.replace(batch.to_workers(), temperature=t)))
            for t in (0.7, 1.0))
    response = batch.mask.bool()
    assert response.sum() == 4 * 12
    assert (tempered - batch.rollout_logprobs)[response].abs().max() < 1e-4
    # the check can fail: scored without the temperature, the same tokens are far off
    assert (untempered - batch.rollout_logprobs)[response].abs().max() > 0.05
