"""The layout planner: memory model against hand-computed values, refusals, and one measured case."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.plan.archs import load_arch
from megarl.plan.hardware import GIB, gpu_spec
from megarl.plan.memory import (
    Layout,
    RolloutShape,
    Workload,
    grad_buffer_numel,
    stage_tensors,
    trained_rank,
    vllm_kv_bytes_per_token,
    vllm_memory,
)
from megarl.plan.roles import pipeline_split
from megarl.plan.search import NoFit, PlanInputs, plan
from megarl.plan.steptime import RLShape, generation_s, rollout_token_s


def test_llama8b_weight_bytes_by_hand():
    arch = load_arch("llama3.1-8b")
    per_layer = 4096 * 128 * (32 * 2 + 8 * 2) + 3 * 4096 * 14336 + 2 * 4096
    params = 32 * per_layer + 2 * 128256 * 4096 + 4096
    assert params == 8_030_261_248 == arch.num_parameters()
    rank = trained_rank(arch, Layout(), Workload(distributed_optimizer=False), stage=0)
    assert rank.weights == 2 * params  # bf16
    assert rank.gradients == 4 * params  # fp32 main_grad
    assert rank.optimizer == 12 * params  # fp32 main params + two Adam moments, unsharded


def test_distributed_optimizer_divides_by_dp_and_tp_splits_weights():
    arch = load_arch("llama3.1-8b")
    one = trained_rank(arch, Layout(dp=1), Workload(), stage=0)
    eight = trained_rank(arch, Layout(dp=8), Workload(), stage=0)
    assert eight.gradients == one.gradients  # gradients stay whole on every data-parallel rank
    assert eight.optimizer == pytest.approx(one.optimizer / 8, rel=1e-6)
    tp4 = trained_rank(arch, Layout(tp=4), Workload(), stage=0)
    assert tp4.params == (arch.num_parameters() - 65 * 4096) // 4 + 65 * 4096  # norms stay whole


def test_grad_buffer_padding():
    # params start at multiples of 64, the bucket ends at a multiple of lcm(dp, 128)
    assert grad_buffer_numel([10, 10], dp=1, distributed_optimizer=True) == 128
    assert grad_buffer_numel([100, 100], dp=3, distributed_optimizer=True) == 384
    assert grad_buffer_numel([10, 10], dp=1, distributed_optimizer=False) == 20


def test_tied_embeddings_and_pipeline_stages():
    arch = load_arch("llama3.1-8b")
    first, _ = stage_tensors(arch, Layout(pp=2), stage=0)
    last, _ = stage_tensors(arch, Layout(pp=2), stage=1)
    assert sum(first) - sum(last) == -4096  # same layers and one vocab matrix each; the final norm is last
    assert pipeline_split(126, 16) == (7, 7) and pipeline_split(32, 4) == (None, None)


def test_kv_cache_bytes_per_token():
    arch = load_arch("llama3.1-8b")
    assert vllm_kv_bytes_per_token(arch, tp=2, dtype="bfloat16") == 2 * 32 * 4 * 128 * 2
    assert vllm_kv_bytes_per_token(arch, tp=16, dtype="bfloat16") == 2 * 32 * 1 * 128 * 2  # replicated KV heads


def test_fp8_rollout_holds_the_layers_in_one_byte_and_runs_their_gemms_at_the_fp8_rate():
    """rollout.weights=fp8 (vLLM's online FP8): Llama-3.1-8B's 32 layers in E4M3, its untied
    embeddings and LM head in bf16, by hand; the GEMMs at 1979 TFLOPS on an H100, at bf16 on an
    A100 (no FP8 tensor cores); the emulation (rounded values, stored in bf16) changes nothing."""
    arch = load_arch("llama3.1-8b")
    layers = 8_030_261_248 - 2 * 128256 * 4096 - 4096
    bf16, fp8 = RolloutShape(tp=2), RolloutShape(tp=2, weights="fp8")
    h100, a100 = gpu_spec("h100-80gb"), gpu_spec("a100-80gb")
    weights = {shape.weights: vllm_memory(arch, shape, h100.memory_bytes)[0].components["vllm_weights"]
               for shape in (bf16, fp8, RolloutShape(tp=2, weights="fp8_emulated"))}
    assert weights["model"] == weights["fp8_emulated"] == 2 * 8_030_261_248 / 2
    assert weights["fp8"] == (2 * (2 * 128256 * 4096 + 4096) + layers) / 2
    eff = PlanInputs(h100).eff
    mfu = 2 * 1e12 * eff.prefill_mfu  # tp 2
    per_token = 2 * 8_030_261_248 + 2 * 32 * 32 * 128 * 100  # weights and attention over 100 tokens
    assert rollout_token_s(arch, bf16, 100, h100, eff) == pytest.approx(per_token / (989 * mfu))
    assert rollout_token_s(arch, fp8, 100, h100, eff) == pytest.approx(
        2 * layers / (1979 * mfu) + (per_token - 2 * layers) / (989 * mfu))
    assert rollout_token_s(arch, fp8, 100, a100, eff) == rollout_token_s(arch, bf16, 100, a100, eff)
    rl = RLShape()
    for gpu in (h100, a100):  # fewer bytes per decode step on both
        assert generation_s(arch, fp8, rl, gpu, eff) < generation_s(arch, bf16, rl, gpu, eff)


def test_cli_plans_fp8_rollout_of_a_recipe(capsys):
    from megarl.cli.main import main

    recipe = Path(__file__).parent.parent / "model_configs" / "qwen2.5_7b_grpo.yaml"
    assert main(["plan", "--model", str(recipe), "--rollout-weights", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "weights fp8" in out and "fp8_tflops           1979.0 (--gpu-fp8-tflops)" in out


def test_refuses_with_the_shortfall():
    arch = load_arch("llama3.1-70b")
    with pytest.raises(NoFit) as e:
        plan(arch, 4, PlanInputs(gpu_spec("h100-80gb")))
    needed = e.value.needed / GIB
    assert needed > 79.6
    assert f"needs {needed:.1f} GiB per GPU, has 79.6 GiB (short by {needed - 79.6:.1f} GiB)" in str(e.value)


def test_cli_exit_code_2_when_nothing_fits(capsys):
    from megarl.cli.main import main

    assert main(["plan", "--model", "llama3.1-70b", "--gpus", "4"]) == 2
    assert "short by" in capsys.readouterr().err


def test_8b_plan_fits_its_gpus():
    p = plan(load_arch("llama3.1-8b"), 16, PlanInputs(gpu_spec("h100-80gb")))
    assert p.fits and all(m.total <= 79.6 * GIB for m in p.per_gpu.values())
    assert set(p.times) >= {"generation", "inference", "training", "weight sync"}


def test_measured_memory_matches_model_on_two_ranks(starts_processes):
    """One real megatron-core case (tiny model, tp=2, fp32), full and LoRA: every component within 15%."""
    from megarl_bench.memory import Case, run_memory_bench

    # ... and the same model with LoRA adapters (the base frozen), in the same two ranks
    rows = run_memory_bench([Case("tiny", tp=2, world=2), Case("tiny", tp=2, world=2, lora_rank=4)], tolerance=0.15,
                            progress=lambda *a: None)
    assert {r["component"] for r in rows} == {"weights", "gradients", "optimizer", "activations", "total"}
    assert all(r["ok"] for r in rows), rows


def test_lora_trains_only_the_adapters_in_the_plan():
    """Llama-3.1-8B, LoRA rank 16 on all seven targets, bf16, no distributed optimizer: gradients
    (fp32) and optimizer state (Adam's moments + fp32 main copy) cover r * (in + out) per target
    and layer only, counted by hand; the frozen base's bf16 weights stay."""
    from megarl.plan.memory import Layout, Workload, trained_rank

    arch, layout = load_arch("llama3.1-8b"), Layout(tp=1, pp=1, dp=1)
    full = trained_rank(arch, layout, Workload(distributed_optimizer=False), 0)
    lora = trained_rank(arch, layout, Workload(distributed_optimizer=False, lora_rank=16), 0)
    h, kv, ffn = 4096, 1024, 14336
    per_layer = 16 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + ffn) + (ffn + h))
    adapters = 32 * per_layer
    assert lora.gradients == adapters * 4 and lora.optimizer == adapters * 12
    assert lora.weights == full.weights + adapters * 2 and lora.params == full.params + adapters
    assert full.optimizer / lora.optimizer > 100


def test_qwen3_counts_its_qk_norms_whole_on_every_rank():
    """The planner's one parameter count (the family's): Qwen3-8B's config.json figures give its
    published 8,190,735,360 parameters, and each rank holds both QK-norms whole."""
    from megarl.models.hf_arch import arch_from_hf_config
    from megarl.plan.memory import layer_tensors

    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "num_hidden_layers": 36, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False}
    qwen3 = arch_from_hf_config({**cfg, "model_type": "qwen3"})
    llama = arch_from_hf_config({**cfg, "model_type": "llama"})
    assert qwen3.num_parameters() == 8_190_735_360
    assert qwen3.num_parameters() - llama.num_parameters() == 36 * 2 * 128
    for tp in (1, 2, 8):
        dense, expert = layer_tensors(qwen3, tp, 1)
        assert dense[4:6] == [128, 128] and expert == []  # after the norms, qkv and proj: not split by tp
        assert sorted(dense) == sorted(layer_tensors(llama, tp, 1)[0] + [128, 128])


def test_rollout_ahead_overlaps_generation_with_training():
    """trainer.max_staleness > 0, disaggregated: the step is max(generation, inference + training)
    + weight sync, by hand from the lockstep plan's own phase times; colocated plans stay lockstep."""
    arch, gpu = load_arch("llama3.1-8b"), gpu_spec("h100-80gb")
    lockstep = plan(arch, 16, PlanInputs(gpu), "disaggregated")
    ahead = plan(arch, 16, PlanInputs(gpu, max_staleness=1), "disaggregated")
    t = ahead.times
    assert ahead.overlapped and not lockstep.overlapped
    assert ahead.step_s == pytest.approx(max(t["generation"], t["inference"] + t["training"]) + t["weight sync"])
    assert ahead.step_s < sum(t.values())
    assert ahead.step_s <= lockstep.step_s  # the search may pick another split, never a slower one
    assert not plan(arch, 16, PlanInputs(gpu, max_staleness=1), "colocated").overlapped


@pytest.mark.parametrize("name,total_b,active_b,gpus", [("qwen3-30b-a3b", 30.5, 3.3, 8),
                                                        ("qwen3-235b-a22b", 235.1, 22.2, 64)])
def test_qwen3_moe_architectures_count_the_published_parameters_and_plan_with_expert_parallelism(
        name, total_b, active_b, gpus):
    """Qwen's model cards: 30.5B total / 3.3B activated, 235B / 22B. The planner fits each on its
    H100s with the actor's experts split over expert-parallel ranks: on 8 GPUs because an expert
    of 30B at ep = 1 sees too few rows to keep its GEMMs compute-bound, on 64 because they must."""
    from megarl.models.arch import family_of

    arch = load_arch(name)
    family = family_of(arch)
    (router, *_), experts = family.mlp_params(arch, 1, 1)
    per_layer = sum(family.layer_params(arch, 1, 1)[0]) + sum(experts)
    shared = 2 * arch.vocab_size * arch.hidden_size + arch.hidden_size  # untied embeddings, final norm
    total = arch.num_layers * per_layer + shared
    active = total - arch.num_layers * sum(experts) * (1 - arch.moe_topk / arch.num_experts)
    assert total / 1e9 == pytest.approx(total_b, abs=0.1) and active / 1e9 == pytest.approx(active_b, abs=0.2)
    p = plan(arch, gpus, PlanInputs(gpu_spec("h100-80gb")))
    actor = p.roles["actor"]
    assert p.fits
    assert actor.layout.ep > 1, actor.layout
    if name == "qwen3-235b-a22b":
        # attention over tp, each expert whole (etp=1) over the ep ranks
        assert actor.layout.etp == 1, actor.layout


def test_expert_gemm_efficiency_by_hand():
    """The roofline of one rank's expert GEMMs (Qwen3-30B-A3B: hidden 2048, expert 768, 128 experts,
    top 8; H100 989 TFLOPS, 3350 GB/s at 70%). At ep = 1 a 3072-token micro-batch gives each
    expert 192 rows: reading the weights takes longer than multiplying them. At ep = 8 the rows of
    8 ranks meet at each expert (1536): compute-bound."""
    from megarl.plan.hardware import Efficiency
    from megarl.plan.steptime import expert_gemm_efficiency

    arch = load_arch("qwen3-30b-a3b")
    gpu, eff = gpu_spec("h100-80gb"), Efficiency(hbm_efficiency=0.7)  # the figures by hand below
    flops, hbm = 989e12, 3350e9 * 0.7

    def roofline(rows: int) -> float:
        compute = (2 * rows * 2048 * 1536 + 2 * rows * 768 * 2048) / flops
        memory = 2 * ((rows * 2048 + 2048 * 1536 + rows * 1536) + (rows * 768 + 768 * 2048 + rows * 2048)) / hbm
        return compute / max(compute, memory)

    assert expert_gemm_efficiency(arch, Layout(pp=8), 3072, gpu, eff) == pytest.approx(roofline(192))
    assert roofline(192) < 0.4
    assert expert_gemm_efficiency(arch, Layout(dp=8, ep=8), 3072, gpu, eff) == 1.0 == roofline(1536)
    # sequence parallelism over tp=2 halves a rank's tokens; etp = tp gathers them back
    assert expert_gemm_efficiency(arch, Layout(tp=2, dp=4, ep=4, etp=1), 3072, gpu, eff) == pytest.approx(
        roofline(384))
    assert expert_gemm_efficiency(load_arch("llama3.1-8b"), Layout(), 3072, gpu, eff) == 1.0


def test_moe_token_exchange_by_hand():
    """megatron-core's all-to-all dispatcher: 4 exchanges (dispatch, combine; forward, backward) of
    top-k copies of each rank's tokens, (ep-1)/ep of them leaving; etp > 1 adds 4 all-gathers /
    reduce-scatters of (etp-1) shares over the expert's ranks."""
    from megarl.plan.hardware import Efficiency
    from megarl.plan.memory import layer_tensors
    from megarl.plan.steptime import moe_token_exchange_s

    arch = load_arch("qwen3-30b-a3b")  # hidden 2048, 48 layers, top 8
    gpu, eff = gpu_spec("h100-80gb"), Efficiency()
    link = gpu.nvlink_gbps * 1e9 * eff.link_efficiency
    tokens = 1_000_000
    per_rank = tokens / 2 / 2 * 48 / 1 * 8  # dp=2, tp=2 (sequence-parallel shards), pp=1, top 8
    whole = Layout(tp=2, dp=2, ep=4, etp=1)  # 4 ranks a stage: ep over all of them
    assert moe_token_exchange_s(arch, whole, tokens, gpu, eff) == pytest.approx(4 * per_rank * 4096 * 3 / 4 / link)
    split = Layout(tp=2, dp=2, ep=2)  # etp = tp = 2
    assert moe_token_exchange_s(arch, split, tokens, gpu, eff) == pytest.approx(
        4 * per_rank * 4096 * (1 / 2 + 1) / link)
    assert moe_token_exchange_s(load_arch("llama3.1-8b"), whole, tokens, gpu, eff) == 0.0
    assert split.expert_dp == 1 and whole.expert_dp == 1 and Layout(tp=2, dp=4, ep=2, etp=1).expert_dp == 4
    # etp=1 holds each expert whole: twice the expert parameters of etp = tp = 2 on a rank
    assert sum(layer_tensors(arch, 2, 2, 1)[1]) == 2 * sum(layer_tensors(arch, 2, 2)[1])


def test_long_sequences_plan_context_parallelism():
    """Llama-3.1-8B's actor on 8 H100s: at the default 3k-token sequences context parallelism only
    costs (its key/value exchange, fewer data-parallel ranks); at 131k tokens the fastest layout that
    fits splits the sequences over cp ranks (activations and logits divide by cp)."""
    from megarl.plan.hardware import Efficiency
    from megarl.plan.search import best_trained
    from megarl.plan.steptime import RLShape, context_parallel_exchange_s

    arch, gpu = load_arch("llama3.1-8b"), gpu_spec("h100-80gb")
    short = best_trained("actor", arch, 8, PlanInputs(gpu), 75 * GIB)
    assert short[0].layout.cp == 1, short[0].layout
    long = best_trained("actor", arch, 8, PlanInputs(gpu, rl=RLShape(prompts=8, response_len=131072)), 75 * GIB)
    assert long[0].layout.cp > 1, long[0].layout
    # the exchange by hand: each layer, 3 of 4 shares' keys and values (8 query groups of 128 over
    # tp 2, bf16) come in, and their gradients go back, over NVLink at 450 GB/s x 0.7
    per_token = 2 * 8 * 128 / 2 * 2
    expected = 2 * 1e6 * 3 / 4 * per_token * 32 / (450e9 * 0.7)
    got = context_parallel_exchange_s(arch, Layout(tp=2, cp=4, sequence_parallel=True), 1e6, gpu, Efficiency())
    assert got == pytest.approx(expected)
    assert all(p.layout.cp == 1 for p in best_trained("actor", load_arch("qwen3-30b-a3b"), 8, PlanInputs(gpu),
                                                        80 * GIB))  # megarl's MoE models keep cp = 1
