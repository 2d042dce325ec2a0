"""Loss masks of multi-turn episodes: a hand-built trajectory (prompt, policy turn, tool
observation, policy turn) trains on the policy's tokens only. Its observation tokens stay in the
context (they change the later turns' log-probs) but leave the policy loss, the KL term and the
entropy bonus, at tp1 and at tp2 x pp2; transformers' log-probs give the expected values."""

from __future__ import annotations

import torch
from conftest import VOCAB

from megarl.algorithms.kl import kl_estimate
from megarl.config.schema import AlgorithmConfig, OptimizerConfig, ParallelConfig
from megarl.rollout.sampling import RolloutSample
from megarl.rollout_driver.batch import build_batch
from megarl.workers import megatron_model, rl_fns
from megarl.workers.rank_batch import RankBatch

# (prompt, turn 1, observation, turn 2) lengths of each sample; two prompts x two samples
SHAPES = [(5, 4, 3, 3), (5, 2, 4, 5), (6, 3, 3, 2), (6, 5, 2, 4)]
GARBAGE = 1e3  # what the batch holds at observation positions: it must not reach any loss term


def _samples() -> list[list[RolloutSample]]:
    g = torch.Generator().manual_seed(7)
    samples = []
    for prompt, turn1, obs, turn2 in SHAPES:
        ids = torch.randint(3, VOCAB, (prompt + turn1 + obs + turn2,), generator=g).tolist()
        mask = [1] * turn1 + [0] * obs + [1] * turn2
        samples.append(RolloutSample(ids[:prompt], ids[prompt:], [0.0] * len(mask), "stop", response_mask=mask))
    for i in (1, 3):  # a group's samples share their prompt
        samples[i].prompt_ids = list(samples[i - 1].prompt_ids)
    return [samples[:2], samples[2:]]


def test_the_batch_mask_marks_exactly_the_policy_tokens():
    batch = build_batch(_samples(), pad_id=0)
    prompt, turn1, obs, turn2 = SHAPES[0]
    row = batch.mask[0].tolist()
    # label position k predicts token k+1: the first response token is predicted at prompt - 1
    expected = [0.0] * (prompt - 1) + [1.0] * turn1 + [0.0] * obs + [1.0] * turn2
    assert row[:len(expected)] == expected and not any(row[len(expected):])
    assert batch.mask.sum() == sum(t1 + t2 for _, t1, _, t2 in SHAPES)


def _oracle(hf_dir: str, tokens: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, ref: torch.Tensor,
            algo: AlgorithmConfig):
    """transformers' per-token log-probs, and the loss terms and gradient norm over ``mask``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    logp = torch.log_softmax(model(tokens).logits[:, :-1].float(), -1)
    lp = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    n = mask.sum()
    pg = -(adv * mask * torch.exp(lp - lp.detach())).sum() / n
    kl = (kl_estimate(lp, ref, estimator=algo.kl_estimator) * mask).sum() / n
    ent = (entropy * mask).sum() / n
    (pg + algo.kl_coef * kl - algo.entropy_coef * ent).backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()
    return lp.detach(), {"pg_loss": pg.item(), "kl_loss": kl.item(), "entropy": ent.item()}, norm


def test_observation_tokens_leave_the_loss_kl_and_entropy_at_every_layout(pools, tiny_models):
    hf = str(tiny_models["llama"])
    batch = build_batch(_samples(), pad_id=0)
    mask, tokens = batch.mask, batch.tokens
    context = torch.zeros_like(mask)  # observation label positions: in a sequence, not the policy's
    for i, (prompt, turn1, obs, _) in enumerate(SHAPES):
        context[i, prompt - 1 + turn1:prompt - 1 + turn1 + obs] = 1.0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * mask
    algo = AlgorithmConfig(name="grpo", kl_coef=0.1, entropy_coef=0.01)
    g = torch.Generator().manual_seed(1)
    lp, expected, norm = _oracle(hf, tokens, mask, adv, torch.zeros_like(mask), algo)
    ref = (lp - 0.3 * torch.rand(lp.shape, generator=g)) * mask
    lp, expected, norm = _oracle(hf, tokens, mask, adv, ref, algo)
    rank_batch = RankBatch(
        tokens=tokens, mask=mask, seq_lens=batch.seq_lens,
        # what the policy-gradient, KL and entropy terms would read at the observation positions
        advantages=adv + GARBAGE * context, old_logprobs=lp * mask + GARBAGE * context,
        ref_logprobs=ref - GARBAGE * context, denoms=[float(mask.sum())],
    )
    for par in (ParallelConfig(tp=1, world_size=4), ParallelConfig(tp=2, pp=2, world_size=4)):
        pool = pools.get(4)
        pool.run(megatron_model.load, key="actor", source=hf, parallel=par)
        results = [r for r in pool.run(rl_fns.train_policy, key="actor", batch=rank_batch, algo=algo,
                                       optim=OptimizerConfig(lr=1e-5), micro_batch_size=1) if r is not None]
        pool.run(megatron_model.unload, key="actor")
        steps = [r.steps[0] for r in results]
        for name, value in expected.items():  # each data-parallel shard reports its share of the mean
            got = sum(s[name] for s in steps)
            assert abs(got - value) < 1e-5 * max(1.0, abs(value)), (par, name, got, value)
        assert abs(steps[0]["grad_norm"] - norm) < 1e-4 * norm, (par, steps[0]["grad_norm"], norm)
