"""GPU paths: megatron-core's local spec on CUDA, Transformer Engine (BF16, FP8), NCCL, vLLM on CUDA.

Marked `gpu`: skipped without CUDA (see conftest). Run on a GPU machine with
`python -m pytest -q -m gpu tests`. What a bare CUDA machine lacks is skipped with the
reason (Transformer Engine, vLLM, Ray), so the run says exactly what it could not check.
FP8 GEMMs need dimensions that are multiples of 16, so these tests use a model of hidden
size 128.
"""

from __future__ import annotations

import importlib.util

import pytest
import rank_jobs
import torch
from conftest import build_tiny_hf, hf_logits, random_tokens, vllm_fused_linears, w8a8_fp8_linear

from megarl.config.schema import OptimizerConfig, ParallelConfig

pytestmark = pytest.mark.gpu


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


needs_te = pytest.mark.skipif(bool(_missing("transformer_engine")), reason="transformer-engine is not installed")
needs_vllm = pytest.mark.skipif(bool(_missing("vllm", "ray")),
                                reason=f"not installed: {', '.join(_missing('vllm', 'ray')) or '-'}")


@pytest.fixture(scope="module")
def te_model(tmp_path_factory):
    return build_tiny_hf("llama", tmp_path_factory.mktemp("gpu") / "llama", hidden_size=128,
                         intermediate_size=256, vocab_size=512)


def _one(results):
    (out,) = [r for r in results if r is not None]
    return out


def test_platform_picks_nccl_and_no_cpu_shims():
    """No CUDA shim on a GPU; without Transformer Engine, exactly the shims for its absence (the
    MoE router's ``te_general_gemm`` NameError, torch Adam's checkpoint state, the local norm)."""
    from megarl.platform import cpu_shims, current_platform, init_megatron_runtime

    platform = current_platform()
    assert platform.backend == "nccl"
    without_te = sorted(name for name, shim in cpu_shims.SHIMS.items() if shim.without_te)
    assert init_megatron_runtime() == ([] if platform.has_transformer_engine else without_te)


@needs_te
def test_platform_picks_transformer_engine():
    from megarl.platform import current_platform

    assert current_platform().layer_spec_kind == "te"


def test_nccl_pool(pools):
    world = min(2, torch.cuda.device_count())
    assert pools.get(world).run(rank_jobs.nccl_all_reduce) == [4.0 * sum(range(1, world + 1))] * world


# -- the platform's spec on CUDA (local when Transformer Engine is absent) ----------------------


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.25)])
def test_cuda_logits_match_transformers(dtype, tol, pools, te_model):
    tokens = random_tokens(batch=2, seq=64, vocab=512)
    expected = hf_logits(te_model, tokens)
    out = _one(pools.get(1).run(rank_jobs.gpu_logits, hf_dir=str(te_model), parallel=ParallelConfig(),
                                tokens=tokens, dtype=dtype))
    logits = out["logits"].float().cpu()
    assert (logits - expected).abs().max().item() <= tol, out["layer_spec"]
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_cuda_moe_logits_match_transformers(family, pools, tmp_path):
    """Routed-expert models (tiny Qwen3-MoE: QK-norm, top-k routing; Qwen2-MoE: a shared expert
    behind a sigmoid gate) on CUDA equal transformers' logits in FP32."""
    hf_dir = build_tiny_hf(family, tmp_path / family, hidden_size=128, vocab_size=512)
    tokens = random_tokens(batch=2, seq=64, vocab=512)
    expected = hf_logits(hf_dir, tokens)
    out = _one(pools.get(1).run(rank_jobs.gpu_logits, hf_dir=str(hf_dir), parallel=ParallelConfig(),
                                tokens=tokens, dtype="float32"))
    assert any(".experts." in name for name in out["param_names"]), "no expert layers were built"
    assert (out["logits"].float().cpu() - expected).abs().max().item() <= 2e-3


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_cuda_training_step_starts_at_the_transformers_loss_and_lowers_it(dtype, tol, pools, te_model):
    tokens = random_tokens(batch=4, seq=65, vocab=512, seed=3)
    logits = hf_logits(te_model, tokens[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    losses = _one(pools.get(1).run(rank_jobs.gpu_train_losses, hf_dir=str(te_model), tokens=tokens, dtype=dtype))
    assert abs(losses[0] - expected.item()) <= tol, (losses, expected.item())
    assert losses[-1] < losses[0]


def test_cuda_sft_and_dpo_steps_equal_their_oracles(pools, te_model):
    """The supervised stages' updates on CUDA (FP32): SFT's loss is transformers' mean NLL of the
    completion tokens; DPO against its own starting point as the reference loses exactly log 2."""
    import math
    from dataclasses import replace

    from megarl.config.supervised import DpoConfig
    from megarl.workers.rank_batch import RankBatch

    tokens = random_tokens(batch=4, seq=48, vocab=512, seed=5)
    mask = torch.zeros(4, 47)
    mask[:, 20:] = 1.0  # the completion: tokens 21.. are trained on
    logits = hf_logits(te_model, tokens)[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1), reduction="none")
    expected = (nll * mask.reshape(-1)).sum() / mask.sum()
    batch = RankBatch(tokens=tokens, mask=mask, seq_lens=torch.full((4,), 48), denoms=[float(mask.sum())])
    optim = OptimizerConfig(lr=1e-4)
    sft = _one(pools.get(1).run(rank_jobs.preference_step, kind="sft", model_dir=str(te_model),
                                parallel=ParallelConfig(), batch=batch, optim=optim))[0].steps[0]
    assert abs(sft["sft_loss"] - expected.item()) <= 1e-4, (sft, expected.item())
    dpo = _one(pools.get(1).run(rank_jobs.preference_step, kind="dpo", model_dir=str(te_model),
                                ref_dir=str(te_model), parallel=ParallelConfig(), batch=replace(batch, denoms=[2.0]),
                                optim=optim, settings=DpoConfig(beta=0.5)))[0].steps[0]
    assert abs(dpo["dpo_loss"] - math.log(2)) <= 1e-5 and abs(dpo["dpo/margin"]) <= 1e-5, dpo


def test_cuda_vocab_parallel_logprobs_use_a_quarter_of_the_naive_memory(pools):
    """The chunked log-prob + entropy path on a Llama-3 vocabulary, forward and backward, measured
    by the CUDA caching allocator's own peak (the benchmark's cross-check column)."""
    from megarl_bench.logprob import run_rank_cases

    case = {"vocab": 128256, "padded": 128256, "batch": 2, "seq": 1024, "dtype": "bfloat16", "backward": True}
    (row,) = pools.get(1).run(run_rank_cases, tp=1, cases=[case])[0]
    assert row["megarl_bytes"] <= 0.25 * row["naive_bytes"], row
    assert row["megarl_rss"] <= 0.25 * row["naive_rss"], row  # torch.cuda.max_memory_allocated rises
    assert row["megarl_diff"] <= 5e-2, row


def test_cuda_packing_matches_the_padded_path(pools, tiny_models, tiny_reward_model):
    """Token budgets, packed rows and shared prompts give the padded path's log-probs, values and
    policy step on CUDA (THD with Transformer Engine, the explicit mask on the local spec)."""
    from test_rl_fns import _batch, _hf_policy_loss_and_grad_norm

    from megarl.config.schema import AlgorithmConfig, OptimizerConfig

    batch = _batch(seed=2, batch=8, prompt=5, seq=32)
    batch.tokens[:, :5] = batch.tokens[::4, :5].repeat_interleave(4, dim=0)
    # old log-probs near the model's own (as a rollout's are): zeros made every ratio ~1/vocab, a
    # gradient too small for the step to move the weights measurably past the comparison tolerance
    _, _, lp_hf = _hf_policy_loss_and_grad_norm(str(tiny_models["llama"]), batch)
    batch.old_logprobs = (lp_hf + 0.05 * torch.randn(lp_hf.shape, generator=torch.Generator().manual_seed(3))) \
        * batch.mask
    batch.denoms = [batch.mask.sum().item()]
    out = _one(pools.get(1).run(rank_jobs.packing_vs_padded, hf_dir=str(tiny_models["llama"]),
                                reward_dir=str(tiny_reward_model), parallel=ParallelConfig(), batch=batch,
                                algo=AlgorithmConfig(name="grpo", entropy_coef=0.01),
                                optim=OptimizerConfig(lr=1.0, adam_eps=1.0), budget=48))
    assert out["train/params_moved"] > 1e-3, out
    for name, diff in out.items():
        if name != "train/params_moved":
            assert diff <= 1e-4, (name, diff, out)


# -- FP8 rollout weights (rollout.weights: fp8) -----------------------------------------------


def test_fp8_rollout_rounding_is_the_operand_of_a_real_fp8_gemm(capsys):
    """The rounding the weight sync applies on CPU (``megarl.rollout.fp8``) is exactly the weight a
    real FP8 GEMM on this GPU multiplies with (``torch._scaled_mm``, E4M3 with the same per-tensor
    scale): with activations E4M3 holds exactly, the GEMM's output equals the CPU's matmul with the
    rounded weight. With activations quantized per tensor too (vLLM's W8A8 path on Hopper), the
    extra error is measured and printed: what the CPU model of FP8 rollout leaves out."""
    from megarl.rollout.fp8 import E4M3_MAX, fake_quant_fp8

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 512, generator=g) * 0.05  # [out, in], as a linear layer holds it
    rounded = fake_quant_fp8(weight)  # on CPU, as the sync does there
    scale = weight.abs().amax() / E4M3_MAX
    w8 = (weight.cuda() / scale.cuda()).to(torch.float8_e4m3fn)
    assert torch.equal(w8.float().cpu() * scale, rounded), "GPU and CPU round the weight differently"

    one = torch.ones((), device="cuda")
    exact_x = torch.randint(-16, 17, (64, 512), generator=g).float() / 4  # multiples of 1/4 up to 4
    x8 = exact_x.cuda().to(torch.float8_e4m3fn)
    assert torch.equal(x8.float().cpu(), exact_x)
    out = torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=scale.cuda().float(), out_dtype=torch.float32)
    expected = exact_x.double() @ rounded.double().t()
    weight_only = ((out.double().cpu() - expected).abs().max() / expected.abs().max()).item()
    # Hopper's FP8 tensor cores accumulate with fewer bits than fp32 (measured on an H200: 1.6e-4)
    assert weight_only <= 1e-3, weight_only

    x = torch.randn(64, 512, generator=g)  # activations as a layer sees them
    x_scale = x.abs().amax() / E4M3_MAX
    xq = (x.cuda() / x_scale.cuda()).to(torch.float8_e4m3fn)
    w8a8 = torch._scaled_mm(xq, w8.t(), scale_a=x_scale.cuda().float(), scale_b=scale.cuda().float(),
                            out_dtype=torch.float32).double().cpu()
    full = x.double() @ weight.double().t()
    fake = x.double() @ rounded.double().t()
    err_fake = ((fake - full).norm() / full.norm()).item()
    err_w8a8 = ((w8a8 - full).norm() / full.norm()).item()
    with capsys.disabled():
        print(f"\nFP8 GEMM, relative error vs the fp32 weights: weights rounded (the CPU model) {err_fake:.4f}, "
              f"weights and activations (W8A8 on {torch.cuda.get_device_name()}) {err_w8a8:.4f}")
    assert err_fake < err_w8a8 < 4 * err_fake + 0.05


def test_fp8_rollout_model_vs_real_fp8_gemms(te_model, capsys):
    """A whole model: transformers with megarl's FP8 rounding of the weights (the CPU model of
    ``rollout.weights: fp8``, grouped as vLLM fuses them) against the same weights run through real
    W8A8 FP8 GEMMs (per-token activation scales, as vLLM's dynamic FP8 on Hopper). Measures, as the
    KL between next-token distributions, how much of FP8 rollout's train/rollout mismatch the CPU
    model leaves out (the activations' rounding), beside what it keeps (the weights')."""
    import transformers

    from megarl.rollout.fp8 import E4M3_MAX, fake_quant_fp8

    full = transformers.AutoModelForCausalLM.from_pretrained(te_model).float().cuda().eval()
    rounded = transformers.AutoModelForCausalLM.from_pretrained(te_model).float().cuda().eval()
    real = transformers.AutoModelForCausalLM.from_pretrained(te_model).float().cuda().eval()
    with torch.no_grad():
        for layer_r, layer_8 in zip(rounded.model.layers, real.model.layers, strict=True):
            for group_r, group_8 in zip(vllm_fused_linears(layer_r), vllm_fused_linears(layer_8), strict=True):
                fused = torch.cat([m.weight for m in group_r])
                scale = fused.abs().amax() / E4M3_MAX
                sizes = [m.weight.shape[0] for m in group_r]
                fused8 = (fused / scale).to(torch.float8_e4m3fn)
                for m_r, m_8, part_r, part_8 in zip(group_r, group_8, fake_quant_fp8(fused).split(sizes),
                                                    fused8.split(sizes), strict=True):
                    m_r.weight.copy_(part_r)
                    m_8.forward = w8a8_fp8_linear(part_8.contiguous(), scale, m_8.bias, per_token=True)
        tokens = random_tokens(batch=4, seq=64, vocab=full.config.vocab_size, seed=3).cuda()
        logp = {name: torch.log_softmax(m(tokens).logits.float(), dim=-1)
                for name, m in (("full", full), ("rounded", rounded), ("real", real))}

    def kl(p: str, q: str) -> float:  # mean over positions of KL(p || q)
        return (logp[p].exp() * (logp[p] - logp[q])).sum(-1).mean().item()

    weights_only, activations, both = kl("full", "rounded"), kl("rounded", "real"), kl("full", "real")
    with capsys.disabled():
        print(f"\nFP8 rollout, next-token KL on {torch.cuda.get_device_name()}: weights rounded (the CPU model) "
              f"{weights_only:.2e}; real W8A8 GEMMs vs that model {activations:.2e}; real vs FP32 {both:.2e}")
    assert 0 < weights_only and 0 < activations
    # the CPU model keeps the order of FP8's mismatch: the activations' rounding adds at most a few times it
    assert both < 6 * weights_only, (weights_only, activations, both)


# -- Transformer Engine ------------------------------------------------------------------


@needs_te
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-2), ("bfloat16", 0.5)])
def test_te_spec_logits_match_transformers(dtype, tol, pools, te_model):
    tokens = random_tokens(batch=2, seq=32, vocab=512)
    expected = hf_logits(te_model, tokens)
    out = _one(pools.get(1).run(rank_jobs.gpu_logits, hf_dir=str(te_model), parallel=ParallelConfig(),
                                tokens=tokens, dtype=dtype))
    assert out["layer_spec"] == "te"
    assert any("layer_norm_weight" in name for name in out["param_names"]), "not the fused TE layers"
    logits = out["logits"].cpu()
    assert (logits - expected).abs().max().item() <= tol
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


@needs_te
def test_fp8_forward_close_to_bf16(pools, te_model):
    tokens = random_tokens(batch=2, seq=32, vocab=512)
    bf16 = _one(pools.get(1).run(rank_jobs.gpu_logits, hf_dir=str(te_model), parallel=ParallelConfig(),
                                 tokens=tokens, dtype="bfloat16"))["logits"]
    fp8 = _one(pools.get(1).run(rank_jobs.gpu_logits, hf_dir=str(te_model), parallel=ParallelConfig(),
                                tokens=tokens, dtype="bfloat16", fp8="hybrid"))["logits"]
    assert torch.isfinite(fp8).all()
    assert not torch.equal(fp8, bf16), "FP8 GEMMs gave bit-identical logits: FP8 was not used"
    assert (torch.log_softmax(fp8, -1) - torch.log_softmax(bf16, -1)).abs().mean().item() <= 0.1


@needs_te
def test_fp8_training_lowers_loss(pools, te_model):
    losses = _one(pools.get(1).run(rank_jobs.fp8_train_losses, hf_dir=str(te_model), parallel=ParallelConfig(),
                                   tokens=random_tokens(batch=4, seq=33, vocab=512)))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.fixture(scope="module")
def gpu_rollout(te_model, ray_session):
    import ray

    from megarl.rollout.remote import start_engine, wait_ready

    # half of the one GPU: the actor's rank takes the other half (colocated)
    engine = start_engine(str(te_model), tp=1, dtype="float32", max_model_len=256, max_num_seqs=8,
                          gpu_memory_utilization=0.3, num_gpus=0.5)
    wait_ready([engine])
    yield engine
    ray.kill(engine)


@needs_vllm
def test_nccl_weight_sync_after_sleep_and_wake(gpu_rollout, te_model):
    """NCCL sync into vLLM on the GPU, in the colocated order: sleep (weights and KV cache
    released), train, wake the weights, sync, wake the KV cache; then vLLM's logprobs are the actor's."""
    import ray

    from megarl.workers import WorkerGroup, megatron_model
    from megarl.workers.weight_sync import WeightSync

    with WorkerGroup("actor-gpu", 1, num_gpus_per_rank=0.5) as actor:
        actor.run(megatron_model.load, key="actor", source=str(te_model), parallel=ParallelConfig())
        sync = WeightSync(actor, "actor", [gpu_rollout], bucket_bytes=1 << 20, backend="nccl")
        try:
            sync.setup()
            ray.get(gpu_rollout.sleep.remote())
            actor.run(megatron_model.lm_train_step, key="actor", tokens=random_tokens(batch=2, seq=33, vocab=512))
            ray.get(gpu_rollout.wake_up_weights.remote())
            report = sync.sync(check=True)
            ray.get(gpu_rollout.wake_up_kv_cache.remote())
            assert report.bytes_ratio == 1.0 and not report.checksum_mismatches
            assert sync.verify(random_tokens(batch=2, seq=32, vocab=512), tolerance=5e-3).max_abs_logprob_diff <= 5e-3
        finally:
            sync.close()
