"""The parallel layout does not change the math of a training step.

Oracle: transformers' loss and gradient norm for the same weights and batch.
"""

from __future__ import annotations

import pytest
import rank_jobs
import torch
from conftest import random_tokens

from megarl.config.schema import ParallelConfig


def _hf_loss_and_grad_norm(hf_dir, tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    return loss.item(), norm.item()


def _run(pools, hf_dir, par, tokens):
    results = pools.get(4).run(rank_jobs.lm_train_losses, hf_dir=str(hf_dir), parallel=par, tokens=tokens,
                               steps=3)
    return next(r for r in results if r is not None)


def test_training_step_matches_transformers_and_is_layout_independent(pools, tiny_models):
    tokens = random_tokens(batch=4, seq=33, seed=3)  # one global batch of 4, split over dp
    hf_loss, hf_norm = _hf_loss_and_grad_norm(tiny_models["llama"], tokens)
    base = _run(pools, tiny_models["llama"], ParallelConfig(tp=1, world_size=4), tokens)
    # Step 0 is before any update: loss and gradient norm are those of transformers.
    assert abs(base["loss"][0] - hf_loss) <= 1e-5, (base["loss"][0], hf_loss)
    assert abs(base["grad_norm"][0] - hf_norm) <= 1e-5 * hf_norm, (base["grad_norm"][0], hf_norm)
    assert base["loss"][2] < base["loss"][0] - 0.1, f"three Adam steps should lower the loss: {base}"
    for par in (ParallelConfig(tp=2, world_size=4),
                ParallelConfig(tp=2, sequence_parallel=True, world_size=4),
                ParallelConfig(tp=2, pp=2, world_size=4)):
        other = _run(pools, tiny_models["llama"], par, tokens)
        for key in ("loss", "grad_norm"):
            for step, (a, b) in enumerate(zip(base[key], other[key], strict=True)):
                assert abs(a - b) <= 1e-5, f"{par}: step {step} {key} {b} != {a} at tp=1"


# Qwen3: Qwen3's training step is transformers' at every layout, QK-norm gradients included.
#
# Under tensor parallelism each rank normalises only its own heads with the whole (replicated)
# QK-norm weights, so each rank's gradient of them is partial; megatron-core sums them over the
# tensor-parallel ranks when its config says ``qk_layernorm`` (the Qwen3 family sets it). Without
# the sum, the step-0 gradient norm is not transformers' and the replicas drift apart.
# Gemma-3 (gemma3_text): the same, with its four (1 + w) norms per layer, GeGLU, windowed and global
# layers with their own rotary bases and its scaled embedding, whose gradient reaches the tied weight.
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_qk_norm_family_training_step_matches_transformers_and_is_layout_independent(family, pools, tiny_models):
    tokens = random_tokens(batch=4, seq=33, seed=3)
    hf_loss, hf_norm = _hf_loss_and_grad_norm(tiny_models[family], tokens)
    for par in (ParallelConfig(tp=1, world_size=4), ParallelConfig(tp=2, world_size=4),
                ParallelConfig(tp=2, sequence_parallel=True, world_size=4), ParallelConfig(tp=2, pp=2, world_size=4)):
        run = _run(pools, tiny_models[family], par, tokens)
        # step 0 is before any update: transformers' loss and gradient norm
        assert abs(run["loss"][0] - hf_loss) <= 1e-5, (par, run["loss"][0], hf_loss)
        assert abs(run["grad_norm"][0] - hf_norm) <= 1e-5 * hf_norm, (par, run["grad_norm"][0], hf_norm)
        if par.tp == 1:
            base = run
            assert base["loss"][2] < base["loss"][0] - 0.1, f"three Adam steps should lower the loss: {base}"
        for key in ("loss", "grad_norm"):
            for step, (a, b) in enumerate(zip(base[key], run[key], strict=True)):
                assert abs(a - b) <= 1e-5, f"{par}: step {step} {key} {b} != {a} at tp=1"
