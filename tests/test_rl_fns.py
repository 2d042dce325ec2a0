"""The RL roles' rank functions: vocab-parallel math and policy updates, against oracles."""

from __future__ import annotations

from dataclasses import replace

import pytest
import rank_jobs
import torch

from megarl.config.schema import AlgorithmConfig, OptimizerConfig, ParallelConfig
from megarl.workers import megatron_model, rl_fns
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import gather_shards


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_vocab_parallel_logprobs_and_entropy_match_the_full_vocabulary(tp, chunk_rows, pools):
    # vocab 250 padded to 256: the last TP rank's slice is partly padding. chunk_rows=3 walks the
    # 3 x 7 tokens of the non-contiguous logits[:, :-1] in chunks that do not divide a sequence.
    for result in pools.get(4).run(rank_jobs.vocab_parallel_vs_naive, tp=tp, vocab=250, padded=256,
                                   chunk_rows=chunk_rows):
        assert result["logprob"] < 1e-5 and result["entropy"] < 1e-4 and result["grad"] < 1e-5, result


@pytest.mark.parametrize("tp", [1, 2])
def test_logprob_bench_measures_the_chunked_path_far_below_the_naive_one(tp, pools):
    from megarl_bench.logprob import _row, run_rank_cases

    # 2 x 64 tokens, vocab 1000 padded to 1024 (the last rank's slice is partly padding), 8-token chunks
    cases = [{"vocab": 1000, "padded": 1024, "batch": 2, "seq": 64, "dtype": "float32", "backward": backward,
              "chunk_rows": 8} for backward in (False, True)]
    per_rank = pools.get(4).run(run_rank_cases, tp=tp, cases=cases)
    width, tokens = 1024 // tp, 2 * 63
    chunk = 8 * width * 4
    for fwd, bwd in per_rank:
        assert fwd["input_bytes"] == bwd["input_bytes"] == 2 * 64 * width * 4
        assert fwd["naive_bytes"] >= tokens * 1000 * 4  # at least the full-vocabulary log-softmax
        assert fwd["megarl_bytes"] <= 2 * chunk + 64 * tokens  # two chunk buffers + per-token vectors
        assert bwd["megarl_bytes"] <= bwd["input_bytes"] + 2 * chunk + 64 * tokens  # + the logits' gradient
        assert bwd["split_bytes"] > bwd["megarl_bytes"]
    for i, case in enumerate(cases):
        row = _row(tp, case, [r[i] for r in per_rank])
        assert row["values_match"] and row["pass"], row


def _batch(seed=0, batch=8, prompt=5, seq=20, vocab=250) -> RankBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    seq_lens = torch.randint(prompt + 3, seq + 1, (batch,), generator=g)
    positions = torch.arange(seq - 1).unsqueeze(0)
    mask = ((positions >= prompt - 1) & (positions < (seq_lens - 1).unsqueeze(1))).float()
    advantages = torch.randn(batch, generator=g).unsqueeze(1).expand(batch, seq - 1) * mask
    return RankBatch(tokens=tokens, mask=mask, advantages=advantages.contiguous(), seq_lens=seq_lens)


def _hf_policy_loss_and_grad_norm(hf_dir, batch: RankBatch):
    """Oracle: transformers' log-probs with old = current (ratio 1): loss -sum(A m)/N, its gradient."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    logp = torch.log_softmax(model(batch.tokens).logits[:, :-1], -1)
    lp = logp.gather(-1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = -(batch.advantages * batch.mask).mul(torch.exp(lp - lp.detach())).sum() / batch.mask.sum()
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    return loss.item(), norm, lp.detach()


def test_policy_update_matches_transformers_at_every_layout(pools, tiny_models):
    hf = str(tiny_models["llama"])
    batch = _batch()
    loss_hf, norm_hf, lp_hf = _hf_policy_loss_and_grad_norm(hf, batch)
    batch = replace(batch, old_logprobs=lp_hf * batch.mask, denoms=[batch.mask.sum().item()])
    algo = AlgorithmConfig(name="grpo")
    optim = OptimizerConfig(lr=1e-5)
    on_policy = replace(batch, old_logprobs=None, select_mask=batch.mask)
    for par in (ParallelConfig(tp=1, world_size=4), ParallelConfig(tp=2, world_size=4),
                ParallelConfig(tp=2, world_size=4, sequence_parallel=True),
                ParallelConfig(tp=2, pp=2, world_size=4),
                # context parallelism: dp 2 x cp 2, and tp 2 x cp 2 with sequence parallelism
                ParallelConfig(cp=2, world_size=4),
                ParallelConfig(tp=2, cp=2, world_size=4, sequence_parallel=True)):
        pool = pools.get(4)
        # with the old log-probs given (off-policy form), and on-policy (the update's own, detached);
        # under context parallelism also in token-budget micro-batches (rows cut to their longest
        # sequence, rounded up to what 2 x cp chunks split)
        runs = [(batch, {}), (on_policy, {})]
        if par.cp > 1:
            runs.append((on_policy, {"max_tokens_per_microbatch": 40}))
        for given, budget in runs:
            pool.run(megatron_model.load, key="actor", source=hf, parallel=par)
            results = [r for r in pool.run(rl_fns.train_policy, key="actor", batch=given, algo=algo, optim=optim,
                                           micro_batch_size=1, **budget) if r is not None]
            steps = [r.steps for r in results]
            # per data-parallel shard partial sums of the global loss and clip fraction
            pg_loss = sum(s[0]["pg_loss"] for s in steps)
            assert abs(pg_loss - loss_hf) < 1e-5, (par, pg_loss, loss_hf)
            assert abs(steps[0][0]["grad_norm"] - norm_hf) < 1e-4 * norm_hf, (par, steps[0][0]["grad_norm"], norm_hf)
            assert sum(s[0]["clip_fraction"] for s in steps) == 0.0  # ratio 1: nothing clipped
            if given is on_policy:  # the log-probs of the update's forward, at every response token
                got = gather_shards([r.per_token for r in results])
                assert (got.logprobs - lp_hf * batch.mask).abs().max() < 1e-4, par
                assert ((got.entropy > 0) == (batch.mask > 0)).all()
            else:
                assert all(r.per_token is None for r in results)
        pool.run(megatron_model.unload, key="actor")


def test_logprobs_are_gathered_in_batch_order(pools, tiny_models):
    hf = str(tiny_models["llama"])
    batch = _batch(seed=1)
    _, _, lp_hf = _hf_policy_loss_and_grad_norm(hf, batch)
    pool = pools.get(4)
    pool.run(megatron_model.load, key="ref", source=hf, parallel=ParallelConfig(tp=2, world_size=4))
    every = gather_shards(pool.run(rl_fns.logprobs, key="ref", batch=batch, micro_batch_size=2, entropy=True,
                                   response_only=False))
    assert (every.logprobs - lp_hf).abs().max() < 1e-4
    assert every.entropy.shape == lp_hf.shape and (every.entropy > 0).all()
    # by default only the response positions (batch.mask) are projected onto the vocabulary
    got = gather_shards(pool.run(rl_fns.logprobs, key="ref", batch=batch, micro_batch_size=2, entropy=True))
    assert (got.logprobs - lp_hf * batch.mask).abs().max() < 1e-4
    assert ((got.entropy > 0) == (batch.mask > 0)).all()
    pool.run(megatron_model.unload, key="ref")


@pytest.mark.parametrize("par", [ParallelConfig(tp=1, world_size=4), ParallelConfig(tp=2, pp=2, world_size=4)],
                         ids=["tp1-dp4", "tp2-pp2"])
def test_token_budget_and_packing_match_the_padded_path(par, pools, tiny_models, tiny_reward_model):
    # Lengths 6..32 over 16 sequences: 4 per data-parallel rank at dp=4, where ranks get
    # different numbers of micro-batches; under pp=2 the micro-batch shapes vary.
    hf = str(tiny_models["llama"])
    batch = _batch(seed=2, batch=16, prompt=5, seq=32)
    batch.tokens[:, :5] = batch.tokens[::4, :5].repeat_interleave(4, dim=0)  # groups of 4 share a prompt
    _, _, lp_hf = _hf_policy_loss_and_grad_norm(hf, batch)
    batch.old_logprobs = (lp_hf + 0.05 * torch.randn(lp_hf.shape, generator=torch.Generator().manual_seed(3))) \
        * batch.mask
    batch.denoms = [batch.mask.sum().item()]
    algo = AlgorithmConfig(name="grpo", entropy_coef=0.01)
    # adam_eps=1: the first step moves each weight by g / (|g| + 1), close to linear in its
    # gradient, so equal updated weights mean equal gradients, not just equal signs.
    optim = OptimizerConfig(lr=1.0, adam_eps=1.0)
    results = [r for r in pools.get(4).run(rank_jobs.packing_vs_padded, hf_dir=hf, reward_dir=str(tiny_reward_model),
                                           parallel=par, batch=batch,
                                           algo=algo, optim=optim, budget=48) if r is not None]
    assert results
    for result in results:
        assert result["train/params_moved"] > 1e-3, result
        for name, diff in result.items():
            if name != "train/params_moved":
                assert diff <= 1e-5, (name, diff, result)
