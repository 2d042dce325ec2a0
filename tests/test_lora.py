"""LoRA on megatron-core (megarl.models.lora) against PEFT on transformers: the oracle.

A PEFT adapter with random A and B (not PEFT's zero B, so it changes the output) on a tiny Llama
is loaded into megarl's adapted actor at tp 1 and 2; the logits and the adapters' gradients of the
mean next-token NLL must equal PEFT's. The targets leave out ``k_proj`` and ``gate_proj``, so the
fused ``linear_qkv`` / ``linear_fc1`` are adapted on some of their rows only.
"""

from __future__ import annotations

import lora_jobs
import pytest
import torch
from conftest import random_tokens

from megarl.config.lora import LoraConfig
from megarl.config.schema import ParallelConfig

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS)
TOL = 1e-4


@pytest.fixture(scope="module")
def peft_oracle(tiny_models, tmp_path_factory):
    """PEFT's adapter folder, logits and adapter gradients on the tiny Llama."""
    import peft
    import transformers

    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32,
                                                             attn_implementation="eager")
    config = peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=TARGETS,
                             init_lora_weights=False)  # random B too: the adapter changes the output
    model = peft.get_peft_model(base, config)
    folder = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(folder)
    tokens = random_tokens(batch=2, seq=24)
    logits = model(tokens).logits
    nll = -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).mean()
    nll.backward()
    grads = {name.replace(".default", ""): p.grad.clone() for name, p in model.named_parameters() if "lora_" in name}
    with torch.no_grad(), model.disable_adapter():
        plain = model(tokens).logits
    return {"folder": folder, "tokens": tokens, "logits": logits.detach(), "base": plain, "grads": grads}


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_forward_and_gradients_match_peft(tp, pools, tiny_models, peft_oracle):
    (out,) = [r for r in pools.get(2).run(
        lora_jobs.lora_forward_grads, hf_dir=str(tiny_models["llama"]), adapter_dir=str(peft_oracle["folder"]),
        parallel=ParallelConfig(tp=tp, world_size=2), tokens=peft_oracle["tokens"], lora=LORA) if r is not None]
    logit_diff = (out["logits"] - peft_oracle["logits"]).abs().max().item()
    base_diff = (out["base"] - peft_oracle["base"]).abs().max().item()
    assert set(out["grads"]) == set(peft_oracle["grads"])
    grad_diff = max((out["grads"][k] - g).abs().max().item() for k, g in peft_oracle["grads"].items())
    grad_scale = max(g.abs().max().item() for g in peft_oracle["grads"].values())
    print(f"tp={tp}: max |logits - PEFT| {logit_diff:.2e}, adapters off vs base {base_diff:.2e}, "
          f"max |grad - PEFT| {grad_diff:.2e} (largest grad {grad_scale:.2e})")
    # the adapter matters: the adapted logits are far from the base's
    assert (peft_oracle["logits"] - peft_oracle["base"]).abs().max().item() > 1e-2
    assert logit_diff <= TOL and base_diff <= TOL
    assert grad_diff <= TOL * max(1.0, grad_scale)
    total = sum(g.numel() for g in peft_oracle["grads"].values())
    # one rank holds every adapter whole at tp 1, and the split halves of B (column) / A (row) at tp 2
    assert out["trainable"] == total if tp == 1 else out["trainable"] < total
    assert out["frozen_with_grad"] == []


def test_lora_config_errors_name_the_field(tiny_models):
    from dataclasses import replace

    from megarl.config.schema import RoleConfig
    from megarl.models.hf_arch import arch_from_hf_dir
    from megarl.validation.lora_checks import lora_errors

    dense, moe = arch_from_hf_dir(tiny_models["llama"]), arch_from_hf_dir(tiny_models["mixtral"])
    role = RoleConfig(lora=LORA)
    assert lora_errors("actor", role, dense) == []
    assert lora_errors("reference", role, dense) == [
        "reference.lora.rank=4: only the actor trains adapters (set it to 0)"]
    assert lora_errors("actor", role, moe)[0].startswith("actor.lora: adapters on mixture-of-experts")
    assert lora_errors("actor", RoleConfig(lora=replace(LORA, dropout=1.0)), dense) == [
        "actor.lora.dropout must be in [0, 1), got 1.0"]
    assert lora_errors("actor", RoleConfig(lora=replace(LORA, target_modules=[])), dense)[0].startswith(
        "actor.lora.target_modules is empty")


def test_lora_checkpoint_resumes_and_exports_what_peft_and_transformers_load(groups, pools, tiny_models, tmp_path):
    """A tp-2 LoRA actor after a step: its checkpoint (column B / row A split over the two ranks)
    resumes to the same log-probs, and `mcore_to_hf` writes the merged model (transformers) and a
    PEFT adapter folder (``PeftModel.from_pretrained`` on the base) that score the tokens as it does."""
    import peft
    import transformers

    from megarl.config.schema import OptimizerConfig
    from megarl.convert import jobs
    from megarl.workers import checkpoint_fns, megatron_model

    hf_dir, parallel = str(tiny_models["llama"]), ParallelConfig(tp=2, world_size=2)
    actor, tokens = groups.get("lora", 2), random_tokens(batch=2, seq=24)
    actor.run(megatron_model.load, key="actor", source=hf_dir, parallel=parallel, lora=LORA)
    actor.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=4, seq=25, seed=5), lr=0.05)
    (trained,) = [r for r in actor.run(lora_jobs.adapted_and_base_logprobs, key="actor", tokens=tokens) if r]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    actor.run(checkpoint_fns.save, key="actor", out_dir=str(ckpt), source=hf_dir)
    # resume as a run does: the model from its source (fresh adapters, B = 0), then the checkpoint
    actor.run(megatron_model.load, key="actor", source=hf_dir, parallel=parallel, lora=LORA)
    actor.run(checkpoint_fns.load, key="actor", ckpt_dir=str(ckpt), optim=OptimizerConfig(lr=0.05))
    (resumed,) = [r for r in actor.run(lora_jobs.adapted_and_base_logprobs, key="actor", tokens=tokens) if r]
    actor.shutdown()  # room for the export's ranks
    pools.get(2).run(jobs.mcore_to_hf, ckpt_dir=str(ckpt), out_dir=str(tmp_path / "out"), parallel=parallel)

    def scored(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(tokens).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]

    load = transformers.AutoModelForCausalLM.from_pretrained
    merged = scored(load(tmp_path / "out", dtype=torch.float32, attn_implementation="eager"))
    base = load(hf_dir, dtype=torch.float32, attn_implementation="eager")
    adapted = scored(peft.PeftModel.from_pretrained(base, tmp_path / "out" / "adapter"))
    moved = (trained["adapted"] - trained["base"]).abs().max().item()
    diffs = {"resumed": (resumed["adapted"] - trained["adapted"]).abs().max().item(),
             "merged (transformers)": (merged - trained["adapted"]).abs().max().item(),
             "adapter (PEFT)": (adapted - trained["adapted"]).abs().max().item()}
    print(f"LoRA checkpoint at tp 2: adapters moved log-probs by {moved:.2e}; max |dlogprob| vs the actor: "
          + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert moved > 100 * TOL  # a checkpoint that lost the adapters (or rank 1's half) would fail below
    assert diffs["resumed"] == 0.0 and diffs["merged (transformers)"] <= TOL and diffs["adapter (PEFT)"] <= TOL
