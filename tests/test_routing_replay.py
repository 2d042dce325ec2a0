"""Rollout routing replay (R3) on a tiny Qwen3-MoE (4 experts, top 2).

vLLM records the experts it routed every token to (``megarl.rollout.vllm_routes``); oracle:
transformers' own router top-k of the same sequences and weights. The actor (ep 2, pp 2, built
with ``moe.routing_replay``) then routes each token where vLLM did (megatron-core's
``RouterReplay``): after a training step and a weight sync its log-probs equal vLLM's at T = 0.7,
and against an engine whose weights landed in FP8 (its router rounded too, so some tokens route
elsewhere) replay removes the routing part of the train/rollout mismatch.
A module of its own: its engines start after the other modules' have stopped.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_hf, random_tokens
from test_weight_sync import BUCKET

from megarl.config.schema import MoeConfig, ParallelConfig
from megarl.rollout.sampling import SamplingConfig
from megarl.trainer.batch import build_batch
from megarl.workers import megatron_model, rl_fns
from megarl.workers.weight_sync import WeightSync

LAYOUT = ParallelConfig(ep=2, pp=2, world_size=4)
PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8], [21, 4, 4, 17, 6, 30], [2, 19]]
SAMPLING = SamplingConfig(n=2, temperature=0.7, max_tokens=12, seed=3)


@pytest.fixture(scope="module")
def r3(ray_session, tmp_path_factory):
    from megarl.rollout.remote import start_engine, wait_ready

    model = build_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("r3") / "qwen3_moe")
    engines = {"tp2": start_engine(str(model), tp=2, max_model_len=256, max_num_seqs=8, routing_replay=True),
               "fp8": start_engine(str(model), tp=1, max_model_len=256, max_num_seqs=8, routing_replay=True,
                                   fp8_weights=True)}
    wait_ready(list(engines.values()))
    yield model, engines
    import ray

    for engine in engines.values():
        ray.kill(engine)


def _generate(engine) -> list:
    import ray

    return ray.get(engine.generate.remote(PROMPTS, SAMPLING))


def _sets(experts: torch.Tensor) -> torch.Tensor:
    return experts.long().sort(dim=-1).values


def test_vllm_routes_are_transformers_routes(r3):
    """Before any sync the engine holds the HF weights: its recorded experts of every prompt and
    response token (all but the last, which never runs) are transformers' top-k, every layer."""
    import transformers

    model, engines = r3
    groups = _generate(engines["tp2"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model).float().eval()
    k = hf.config.num_experts_per_tok
    compared = 0
    for sample in [s for g in groups for s in g]:
        seq = torch.tensor([sample.prompt_ids + sample.response_ids[:-1]])
        assert sample.routes.shape == (seq.shape[1] + 1, hf.config.num_hidden_layers, k)
        with torch.no_grad():
            router_logits = hf(seq, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            expected = _sets(logits.float().topk(k, dim=-1).indices)
            assert torch.equal(_sets(sample.routes[:-1, layer]), expected), layer
            compared += len(expected)
    assert compared > 100


def _synced_actor(actor, model, engine) -> None:
    actor.run(megatron_model.load, key="actor", source=str(model), parallel=LAYOUT, moe=MoeConfig(routing_replay=True))
    actor.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=33, seed=4))
    sync = WeightSync(actor, "actor", [engine], bucket_bytes=BUCKET)
    try:
        sync.setup()
        sync.sync()
    finally:
        sync.close()


def _actor_logprobs(actor, batch, replay: bool) -> torch.Tensor:
    worker_batch = batch.to_workers()
    if not replay:
        worker_batch.routes = None
    out = rl_fns.gather_shards(actor.run(rl_fns.logprobs, key="actor", batch=worker_batch, micro_batch_size=2))
    return out


def _counts(actor) -> tuple[int, int]:
    per_rank = actor.run(rl_fns.routing_replay_counts, key="actor")
    return sum(c for c, _ in per_rank), sum(d for _, d in per_rank)


def test_replayed_logprobs_equal_vllm_after_a_step_and_a_sync(actor4, r3):
    model, engines = r3
    _synced_actor(actor4, model, engines["tp2"])
    batch = build_batch(_generate(engines["tp2"]), pad_id=0, pad_to_multiple=8, temperature=SAMPLING.temperature)
    mask = batch.mask.bool()
    _counts(actor4)  # start from zero
    replayed = _actor_logprobs(actor4, batch, replay=True)
    compared, differing = _counts(actor4)
    # every real token (all but each sequence's last) at each of the 2 layers, counted once per
    # data-parallel shard's rank holding the layer (pp 2: each stage its own layer)
    assert compared == int((batch.seq_lens - 1).sum()) * 2
    assert differing == 0  # fp32 both sides: the actor's own routing agrees with vLLM's
    assert (replayed - batch.rollout_logprobs)[mask].abs().max() <= 1e-3
    free = _actor_logprobs(actor4, batch, replay=False)
    assert (free - batch.rollout_logprobs)[mask].abs().max() <= 1e-3


def test_replay_removes_the_routing_mismatch_of_fp8_rollout(actor4, r3):
    """FP8 rollout weights (the router's too) send some tokens to other experts than the actor's
    own top-k would: the actor counts them, and replaying vLLM's routes brings its log-probs
    closer to the engine's than its own routing does."""
    model, engines = r3
    _synced_actor(actor4, model, engines["fp8"])
    batch = build_batch(_generate(engines["fp8"]), pad_id=0, pad_to_multiple=8, temperature=SAMPLING.temperature)
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
