"""Megatron models built by megarl give transformers' logits (fp32), at every layout.

Each tiny model is converted once to a megatron-core checkpoint at tp=2, pp=2 (the
job `megarl convert hf-to-mcore` runs); the checkpoint is then loaded at each
layout, which also checks megatron-core's resharding of what megarl wrote.
"""

from __future__ import annotations

import pytest
import rank_jobs
import torch
from conftest import hf_logits, random_tokens

from megarl.config.schema import ParallelConfig
from megarl.convert import jobs

TOL = 1e-3
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]


def _single(results):
    (out,) = [r["logits"] for r in results if r["logits"] is not None]
    return out


@pytest.fixture(scope="module")
def checkpoints(pools, tiny_models, tmp_path_factory):
    pool = pools.get(4)
    out = {}
    for family in DENSE:
        path = tmp_path_factory.mktemp("ckpt") / family
        path.mkdir()
        pool.run(jobs.hf_to_mcore, hf_dir=str(tiny_models[family]), out_dir=str(path),
                 parallel=ParallelConfig(tp=2, pp=2, world_size=4), dtype="float32")
        out[family] = path
    return out


@pytest.fixture(scope="module")
def references(tiny_models):
    tokens = random_tokens(batch=2, seq=32)
    return tokens, {family: hf_logits(tiny_models[family], tokens) for family in tiny_models}


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_checkpoint_logits_match_transformers(family, tp, pp, pools, checkpoints, references):
    tokens, expected = references
    results = pools.get(4).run(jobs.checkpoint_logits, ckpt_dir=str(checkpoints[family]),
                               parallel=ParallelConfig(tp=tp, pp=pp, world_size=4), tokens=tokens)
    logits = _single(results)
    assert logits.shape == expected[family].shape
    assert (logits - expected[family]).abs().max().item() <= TOL


def test_interleaved_pipeline_logits(pools, checkpoints, references):
    tokens, expected = references
    # vpp=2 over pp=2: four model chunks of one layer each, two per rank.
    results = pools.get(4).run(jobs.checkpoint_logits, ckpt_dir=str(checkpoints["llama"]),
                               parallel=ParallelConfig(pp=2, vpp=2, world_size=4), tokens=tokens,
                               num_microbatches=2)
    assert (_single(results) - expected["llama"]).abs().max().item() <= TOL


def test_sliding_window_matters(tiny_models, references):
    """The Mistral fixture's window (8) is shorter than the sequence (32), so the check above
    covers the window: full causal attention gives different logits."""
    import transformers

    tokens, expected = references
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["mistral"], dtype=torch.float32,
                                                              sliding_window=None)
    with torch.no_grad():
        full = model(tokens).logits
    assert (full - expected["mistral"]).abs().max().item() > 1e-2


def test_qk_norm_matters(tiny_models, references):
    """The Qwen3 fixture's QK-norm weights are neither ones nor equal, so the check above covers
    them: the norms at ones, or q's and k's swapped, give different logits."""
    import transformers

    tokens, expected = references
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        q, k = attn.q_norm.weight.clone(), attn.k_norm.weight.clone()
        attn.q_norm.weight.copy_(k)
        attn.k_norm.weight.copy_(q)
        swapped = model(tokens).logits
        attn.q_norm.weight.fill_(1.0)
        attn.k_norm.weight.fill_(1.0)
        ones = model(tokens).logits
    assert (swapped - expected["qwen3"]).abs().max().item() > 1e-2
    assert (ones - expected["qwen3"]).abs().max().item() > 1e-2


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (2, 1)])
def test_mixtral_moe_logits(tp, ep, pools, tiny_models, references, tmp_path_factory):
    tokens, expected = references
    pool = pools.get(4)
    path = tmp_path_factory.mktemp("moe") / f"tp{tp}ep{ep}"
    path.mkdir()
    pool.run(jobs.hf_to_mcore, hf_dir=str(tiny_models["mixtral"]), out_dir=str(path),
             parallel=ParallelConfig(tp=tp, ep=ep, world_size=4), dtype="float32")
    # Load at a different expert layout than the one written.
    other = ParallelConfig(tp=1, ep=2 if ep == 1 else 1, world_size=4)
    for par in (ParallelConfig(tp=tp, ep=ep, world_size=4), other):
        logits = _single(pool.run(jobs.checkpoint_logits, ckpt_dir=str(path), parallel=par, tokens=tokens))
        assert (logits - expected["mixtral"]).abs().max().item() <= TOL, par


@pytest.mark.parametrize("family,tp,ep,pp,etp", [
    ("qwen3_moe", 1, 1, 1, None), ("qwen3_moe", 1, 2, 1, None), ("qwen3_moe", 2, 1, 1, None),
    ("qwen3_moe", 1, 2, 2, None), ("qwen2_moe", 2, 2, 1, None), ("qwen2_moe", 1, 2, 2, None),
    ("qwen3_moe", 2, 2, 1, 1), ("qwen2_moe", 2, 1, 1, 1)])
def test_qwen_moe_logits(family, tp, ep, pp, etp, pools, tiny_models, references, tmp_path_factory):
    """Qwen3-MoE (QK-norm attention, routed experts of moe_intermediate_size, top-k renormalised) and
    Qwen2-MoE (q/k/v biases, the top k unrenormalised, a wider shared expert scaled by its sigmoid
    gate) at each (tp, ep, pp), written at that layout and read back at it; etp=1: attention (and
    Qwen2-MoE's shared expert) split over tp while every routed expert stays whole."""
    tokens, expected = references
    pool = pools.get(4)
    par = ParallelConfig(tp=tp, ep=ep, pp=pp, etp=etp, world_size=4)
    path = tmp_path_factory.mktemp(family) / f"tp{tp}ep{ep}pp{pp}etp{etp}"
    path.mkdir()
    pool.run(jobs.hf_to_mcore, hf_dir=str(tiny_models[family]), out_dir=str(path), parallel=par, dtype="float32")
    logits = _single(pool.run(jobs.checkpoint_logits, ckpt_dir=str(path), parallel=par, tokens=tokens))
    assert (logits - expected[family]).abs().max().item() <= TOL, par


def test_qwen3_moe_without_renormalised_top_k(pools, tmp_path_factory):
    """norm_topk_prob=false: the top-k probabilities of the softmax over all experts, unrenormalised
    (megatron-core's pre-softmax router); the renormalised routing would give other logits."""
    from conftest import build_tiny_hf

    hf = build_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("hf") / "qwen3_moe_raw", norm_topk_prob=False)
    tokens = random_tokens()
    expected = hf_logits(hf, tokens)
    path = tmp_path_factory.mktemp("qwen3moe") / "raw"
    path.mkdir()
    par = ParallelConfig(tp=1, ep=2, world_size=2)
    pool = pools.get(2)
    pool.run(jobs.hf_to_mcore, hf_dir=str(hf), out_dir=str(path), parallel=par, dtype="float32")
    logits = _single(pool.run(jobs.checkpoint_logits, ckpt_dir=str(path), parallel=par, tokens=tokens))
    assert (logits - expected).abs().max().item() <= TOL


def test_value_head_matches_sequence_classifier(pools, tiny_reward_model, tmp_path_factory):
    """A reward model (HF LlamaForSequenceClassification): per-token scores of the Megatron
    value head equal transformers' score head on every position."""
    import transformers

    tokens = random_tokens(batch=2, seq=16)
    model = transformers.LlamaForSequenceClassification.from_pretrained(tiny_reward_model,
                                                                        dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.score(model.model(tokens).last_hidden_state)
    path = tmp_path_factory.mktemp("rm") / "ckpt"
    path.mkdir()
    pool = pools.get(4)
    pool.run(jobs.hf_to_mcore, hf_dir=str(tiny_reward_model), out_dir=str(path),
             parallel=ParallelConfig(tp=2, pp=2, world_size=4), dtype="float32", value_head=True)
    for par in (ParallelConfig(tp=2, world_size=4), ParallelConfig(tp=2, sequence_parallel=True, world_size=4)):
        values = _single(pool.run(jobs.checkpoint_logits, ckpt_dir=str(path), parallel=par, tokens=tokens))
        assert values.shape == (2, 16, 1)
        assert (values - expected).abs().max().item() <= TOL, par


@pytest.fixture(scope="module")
def smollm2_conversion(pools, smollm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2") / "tp3"
    path.mkdir()
    stats = pools.get(3).run(jobs.hf_to_mcore, hf_dir=str(smollm2), out_dir=str(path),
                             parallel=ParallelConfig(tp=3, world_size=3), dtype="float32")
    return path, stats


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2_conversion):
    return smollm2_conversion[0]


def test_conversion_reads_each_shard_once_and_holds_no_second_copy(smollm2_conversion, smollm2):
    """Each rank reads only its own bytes, and its memory grows by its weights plus at most
    one more copy of them (the checkpoint writer's buffers) and a fixed allowance for
    megatron-core's save machinery (measured ~200 MiB)."""
    _, stats = smollm2_conversion
    model_bytes = (smollm2 / "model.safetensors").stat().st_size
    total_read = sum(s["bytes_read"] for s in stats)
    # everything once; the replicated norms once per TP rank (61 vectors of 576 fp32)
    assert model_bytes * 0.99 <= total_read <= model_bytes + 2 * 61 * 576 * 4 + 1024
    for s in stats:
        assert s["bytes_read"] < model_bytes / 2, s  # a third of the model per rank
        assert s["peak_above_baseline"] <= 2 * s["weights_bytes"] + 256 * 2**20, s


@pytest.fixture(scope="module")
def smollm2_batches(smollm2):
    from megarl.convert.parity import verification_tokens

    # chat-formatted text through the model's own template, and one uniformly random batch
    return [verification_tokens(str(smollm2), batch=2, seq=64),
            random_tokens(batch=2, seq=48, vocab=49152, seed=0)]


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_real_weights(tp, pools, smollm2, smollm2_checkpoint, smollm2_batches):
    """SmolLM2-135M-Instruct (9 heads, 3 query groups, tied embeddings) written at tp=3."""
    for tokens in smollm2_batches:
        expected = hf_logits(smollm2, tokens)
        logits = _single(pools.get(3).run(jobs.checkpoint_logits, ckpt_dir=str(smollm2_checkpoint),
                                          parallel=ParallelConfig(tp=tp, world_size=3), tokens=tokens))
        assert (logits - expected).abs().max().item() <= TOL
        assert (logits.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.99


def test_a_bfloat16_model_is_bfloat16_throughout(pools, tiny_models):
    """Norms included: the local spec builds torch norms in fp32 whatever params_dtype says, which made
    every rms_norm of a BF16 model a mixed-dtype call that CUDA runs unfused (seen on an H200)."""
    results = [r for r in pools.get(4).run(rank_jobs.param_dtypes, hf_dir=str(tiny_models["qwen3"]), dtype="bfloat16")
               if r is not None]
    assert results == [["torch.bfloat16"]]
