"""The RL roles' rank functions: vocab-parallel math and policy updates, against oracles."""

from __future__ import annotations

import pytest
import rank_jobs
import torch

from megarl.config.schema import AlgorithmConfig, OptimizerConfig, ParallelConfig
from megarl.workers import megatron_model, rl_fns


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_logprobs_and_entropy_match_the_full_vocabulary(tp, pools):
    # vocab 250 padded to 256: the last TP rank's slice is partly padding
    for result in pools.get(4).run(rank_jobs.vocab_parallel_vs_naive, tp=tp, vocab=250, padded=256):
        assert result["logprob"] < 1e-5 and result["entropy"] < 1e-4 and result["grad"] < 1e-5, result


def _batch(seed=0, batch=8, prompt=5, seq=20, vocab=250):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    seq_lens = torch.randint(prompt + 3, seq + 1, (batch,), generator=g)
    positions = torch.arange(seq - 1).unsqueeze(0)
    mask = ((positions >= prompt - 1) & (positions < (seq_lens - 1).unsqueeze(1))).float()
    advantages = torch.randn(batch, generator=g).unsqueeze(1).expand(batch, seq - 1) * mask
    return {"tokens": tokens, "mask": mask, "advantages": advantages.contiguous(), "seq_lens": seq_lens}


def _hf_policy_loss_and_grad_norm(hf_dir, batch):
    """Oracle: transformers' log-probs with old = current (ratio 1): loss -sum(A m)/N, its gradient."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    logp = torch.log_softmax(model(batch["tokens"]).logits[:, :-1], -1)
    lp = logp.gather(-1, batch["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = -(batch["advantages"] * batch["mask"]).mul(torch.exp(lp - lp.detach())).sum() / batch["mask"].sum()
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    return loss.item(), norm, lp.detach()


def test_policy_update_matches_transformers_at_every_layout(pools, tiny_models):
    hf = str(tiny_models["llama"])
    batch = _batch()
    loss_hf, norm_hf, lp_hf = _hf_policy_loss_and_grad_norm(hf, batch)
    batch["old_logprobs"] = lp_hf * batch["mask"]
    batch["denoms"] = [batch["mask"].sum().item()]
    algo = vars(AlgorithmConfig(name="grpo"))
    optim = vars(OptimizerConfig(lr=1e-5))
    results = {}
    for par in (ParallelConfig(tp=1, world_size=4), ParallelConfig(tp=2, world_size=4),
                ParallelConfig(tp=2, pp=2, world_size=4)):
        pool = pools.get(4)
        pool.run(megatron_model.load, key="actor", source=hf, parallel=par)
        steps = [r for r in pool.run(rl_fns.train_policy, key="actor", batch=batch, algo=algo, optim=optim,
                                     micro_batch_size=1) if r is not None]
        # per data-parallel shard partial sums of the global loss and clip fraction
        pg_loss = sum(s[0]["pg_loss"] for s in steps)
        results[(par.tp, par.pp)] = (pg_loss, steps[0][0]["grad_norm"])
        assert abs(pg_loss - loss_hf) < 1e-5, (par, pg_loss, loss_hf)
        assert abs(steps[0][0]["grad_norm"] - norm_hf) < 1e-4 * norm_hf, (par, steps[0][0]["grad_norm"], norm_hf)
        assert sum(s[0]["clip_fraction"] for s in steps) == 0.0  # ratio 1: nothing clipped
        pool.run(megatron_model.unload, key="actor")


def test_logprobs_are_gathered_in_batch_order(pools, tiny_models):
    hf = str(tiny_models["llama"])
    batch = _batch(seed=1)
    _, _, lp_hf = _hf_policy_loss_and_grad_norm(hf, batch)
    pool = pools.get(4)
    pool.run(megatron_model.load, key="ref", source=hf, parallel=ParallelConfig(tp=2, world_size=4))
    got = rl_fns.gather_shards(pool.run(rl_fns.logprobs, key="ref", batch=batch, micro_batch_size=2, entropy=True))
    assert (got["logprobs"] - lp_hf).abs().max() < 1e-4
    assert got["entropy"].shape == lp_hf.shape and (got["entropy"] > 0).all()
    pool.run(megatron_model.unload, key="ref")
