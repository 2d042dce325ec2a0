"""``megarl bench mfu``: the FLOP count against a published parameter count, the argument checks,
and one real training step of a tiny model on this machine's device."""

from __future__ import annotations

import json

import pytest

from megarl.config.loader import ConfigError
from megarl.plan.archs import load_arch
from megarl_bench.mfu import MfuBenchArgs, check_args, format_table, run_mfu_bench, step_flops


def test_matmul_parameters_are_llama_3_2_1b_published_count_less_its_norms():
    # Meta's model card: 1,235,814,400 parameters (tied embeddings). The GEMM parameters are all
    # of them but the RMSNorm weights: 16 layers x 2 norms x 2048 + the final norm's 2048.
    flops = step_flops(load_arch("llama3.2-1b"), seq=4096)
    assert flops.matmul_params == 1_235_814_400 - (16 * 2 * 2048 + 2048)
    # causal attention per token: 16 layers x 2 GEMMs x 2 FLOPs x 2048 (q dim) x 4096 / 2 keys
    assert flops.attention_flops_causal == 16 * 2 * 2 * 2048 * 2048
    assert flops.train_per_token == 3 * (2 * flops.matmul_params + flops.attention_flops_causal)
    assert flops.train_per_token_full_attention - flops.train_per_token == 3 * flops.attention_flops_causal


def test_bad_arguments_are_named_in_one_error():
    with pytest.raises(ConfigError) as e:
        check_args(MfuBenchArgs(archs=["no-such-arch", "mixtral-8x7b"], seq=1, dtype="fp8", peak_tflops=-1))
    text = str(e.value)
    for fragment in ("--arch no-such-arch", "MoE FLOPs", "--seq", "--dtype", "--peak-tflops"):
        assert fragment in text


def test_one_real_step_gives_a_finite_loss_and_the_mfu_from_the_given_peak(tmp_path, starts_processes):
    arch_dir = tmp_path / "tiny"
    arch_dir.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (arch_dir / "config.json").write_text(json.dumps(config))
    result = run_mfu_bench(MfuBenchArgs(archs=[str(arch_dir)], seq=32, steps=2, warmup=1, dtype="float32",
                                        peak_tflops=1.0, profile=True), progress=lambda *a: None)
    (row,) = result["rows"]
    assert "error" not in row, row
    assert len(row["losses"]) == 2 and all(0 < loss < 20 for loss in row["losses"])
    assert row["tokens_per_s"] == pytest.approx(32 / row["seconds"])
    assert row["mfu"] == pytest.approx(row["model_tflops"])  # peak 1 TFLOP/s
    assert "tiny" in format_table(result)
    assert "aten::mm" in row["profile"]  # --profile: the top operators of two more steps
