"""A MoE role's routing settings in training (``<role>.moe``): megatron-core's load-balancing and
z losses, and token dropping by expert capacity, on a tiny Mixtral at expert parallel 2.

Oracle for the load-balancing loss: transformers' own router logits of the same model, with the
switch loss computed by hand per layer and data-parallel shard."""

from __future__ import annotations

import pytest
import rank_jobs
import torch
from conftest import random_tokens

from megarl.config.schema import MoeConfig, ParallelConfig

EP2 = ParallelConfig(ep=2, world_size=2)  # dp 2 for the dense parts, one expert pair per rank


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(batch=2, seq=24, seed=5)


@pytest.fixture(scope="module")
def default_step(pools, tiny_models, tokens):
    return _step(pools, tiny_models, tokens, MoeConfig())


def _step(pools, tiny_models, tokens, moe: MoeConfig) -> dict:
    (out,) = [r for r in pools.get(2).run(rank_jobs.moe_routing_step, hf_dir=str(tiny_models["mixtral"]),
                                          parallel=EP2, moe=moe, tokens=tokens) if r is not None]
    return out


def _switch_loss_by_hand(hf_dir, tokens: torch.Tensor) -> float:
    """E / k * sum_e f_e * P_e per layer (f_e: share of the top-k slots routed to e, P_e: mean router
    probability), averaged over layers and over the sequences (one per data-parallel rank)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    k, n_experts = model.config.num_experts_per_tok, model.config.num_local_experts
    losses = []
    with torch.no_grad():
        for row in tokens[:, :-1]:  # the training step's inputs
            for logits in model(row.unsqueeze(0), output_router_logits=True).router_logits:
                probs = logits.float().softmax(-1)
                chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
                share = chosen.sum(0) / (k * probs.shape[0])
                losses.append(float(n_experts * (share * probs.mean(0)).sum()))
    return sum(losses) / len(losses)


def test_defaults_add_no_loss_and_drop_no_token(default_step):
    assert default_step["moe"] == {}
    assert default_step["router_grad"] > 0


def test_load_balancing_loss_is_the_switch_loss_and_reaches_the_router(pools, tiny_models, tokens, default_step):
    out = _step(pools, tiny_models, tokens, MoeConfig(load_balancing="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=1e-3))
    expected = _switch_loss_by_hand(tiny_models["mixtral"], tokens)
    assert out["moe"]["load_balancing_loss"] == pytest.approx(expected, rel=1e-4), (out["moe"], expected)
    assert out["moe"]["z_loss"] > 0
    # the forward is untouched; the losses add to the router's gradient only
    assert torch.equal(out["logprobs"], default_step["logprobs"])
    assert abs(out["router_grad"] - default_step["router_grad"]) > 1e-3 * default_step["router_grad"]


def test_capacity_factor_drops_tokens_only_when_experts_overflow(pools, tiny_models, tokens, default_step):
    roomy = _step(pools, tiny_models, tokens, MoeConfig(capacity_factor=4.0))  # 4 experts: room for every token
    assert torch.allclose(roomy["logprobs"], default_step["logprobs"], atol=1e-6)
    tight = _step(pools, tiny_models, tokens, MoeConfig(capacity_factor=0.5, token_drop_policy="position"))
    assert (tight["logprobs"] - default_step["logprobs"]).abs().max() > 1e-3
