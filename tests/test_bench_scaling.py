"""``megarl bench scaling``: the efficiency arithmetic and argument checks. Its one real run (a tiny
model at 1 and 2 ranks, every default mode and the weight sync) is the command line's, in
tests/test_benchmarks_end_to_end.py: one Ray, rank and vLLM start-up serves both."""

from __future__ import annotations

import json

import pytest

from megarl_bench.scaling import (
    ScalingArgs,
    check_args,
    format_tables,
    scaling_rows,
    sequences_per_replica,
    sync_rows,
    tokens_per_step,
    write_outputs,
)


def _close(row: dict, **expected: float) -> None:
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-9), (key, row[key], value)


def test_strong_scaling_efficiency_is_t1_over_n_tn():
    # Same 1000 tokens per step at every N: 2.0 s, 1.25 s, 1.0 s.
    rows = scaling_rows([(4, 1.0, 1000), (1, 2.0, 1000), (2, 1.25, 1000)])  # any order in
    assert [r["ranks"] for r in rows] == [1, 2, 4]
    _close(rows[0], per_second=500, speedup=1.0, efficiency=1.0)
    _close(rows[1], per_second=800, speedup=1.6, efficiency=0.8)  # 2.0 / (2 * 1.25)
    _close(rows[2], per_second=1000, speedup=2.0, efficiency=0.5)  # 2.0 / (4 * 1.0)


def test_weak_scaling_efficiency_is_t1_over_tn():
    # 1000 tokens per rank: the step's work grows with N.
    rows = scaling_rows([(1, 2.0, 1000), (2, 2.5, 2000), (4, 4.0, 4000)])
    _close(rows[1], per_second=800, speedup=1.6, efficiency=0.8)  # 2.0 / 2.5
    _close(rows[2], per_second=1000, speedup=2.0, efficiency=0.5)  # 2.0 / 4.0


def test_efficiency_is_relative_to_the_fewest_ranks():
    rows = scaling_rows([(2, 1.0, 100), (4, 0.8, 100)])
    _close(rows[1], speedup=1.25, efficiency=0.625)  # 2 * 1.0 / (4 * 0.8)
    assert scaling_rows([]) == []


def test_sync_rows_bandwidth_and_efficiency():
    rows = sync_rows([{"ranks": 2, "bytes": 1e9, "sync_seconds": 1.0, "raw_seconds": 0.5},
                      {"ranks": 1, "bytes": 1e9, "sync_seconds": 2.0, "raw_seconds": 1.0}])
    _close(rows[0], ranks=1, gb_per_s=0.5, raw_gb_per_s=1.0, efficiency=0.5, speedup=1.0)
    _close(rows[1], ranks=2, gb_per_s=1.0, raw_gb_per_s=2.0, efficiency=0.5, speedup=2.0)


def test_batches_and_tokens_per_mode():
    args = ScalingArgs()  # ranks 1,2,4,8, micro-batch 2: strong global batch 2 * lcm = 16 sequences
    assert args.strong_batch == 16 and args.weak_batch_per_rank == 2
    assert sequences_per_replica(args, "dp-strong", 4) == 4
    assert tokens_per_step(args, "dp-strong", 4) == 16 * 128
    assert sequences_per_replica(args, "dp-weak", 4) == 2
    assert tokens_per_step(args, "dp-weak", 4) == 4 * 2 * 128
    assert sequences_per_replica(args, "tp-strong", 8) == 16
    assert tokens_per_step(args, "tp-strong", 8) == 16 * 128
    assert tokens_per_step(args, "pp-strong", 2) == 16 * 128
    assert ScalingArgs(ranks=(1, 3), micro_batch=1).strong_batch == 3


def test_default_arguments_are_valid():
    assert check_args(ScalingArgs()) == []
    assert check_args(ScalingArgs(modes=("pp-strong",), ranks=(1, 2, 4), layers=4)) == []


@pytest.mark.parametrize("overrides, expected", [
    (dict(ranks=(1, 0)), "--ranks must be distinct positive integers"),
    (dict(ranks=(2, 2)), "--ranks must be distinct positive integers"),
    (dict(modes=("dp-strong", "zz")), "unknown mode(s) ['zz']"),
    (dict(seq_len=0), "--seq-len=0 must be >= 1"),
    (dict(warmup=-1), "--warmup=-1 must be >= 0"),
    (dict(dtype="float16"), "--dtype='float16' must be float32 or bfloat16"),
    (dict(hidden=100, heads=6), "--heads=6 does not divide --hidden=100"),
    (dict(hidden=128, heads=8), "head dim 16: vLLM's CPU attention needs >= 32"),
    (dict(ranks=(1, 3)), "--modes tp-strong at 3 ranks: tp=3 does not divide num_attention_heads=8"),
    (dict(ranks=(1, 2), heads=2, hidden=64, sync=False, modes=("tp-strong",), ffn=63),
     "tp=2 does not divide intermediate_size=63"),
    (dict(modes=("pp-strong",), layers=6), "--modes pp-strong at 4 ranks: pp=4 does not divide num_hidden_layers"),
    (dict(ranks=(1, 2), global_batch=6, micro_batch=2), "--modes dp-strong at 2 ranks: the global batch of 6"),
    (dict(ranks=(1, 16), sync=True), "weight sync (actor tp=16): tp=16 does not divide num_attention_heads=8"),
    (dict(rollout_tp=3), "--rollout-tp=3 does not divide --heads=8"),
])
def test_bad_arguments_name_the_option(overrides, expected):
    errors = check_args(ScalingArgs(**overrides))
    assert any(expected in e for e in errors), errors


def test_cli_refuses_bad_arguments_before_starting_anything(capsys):
    from megarl.cli.main import main

    assert main(["bench", "scaling", "--ranks", "1,3"]) == 2
    err = capsys.readouterr().err
    assert "megarl bench: error: invalid benchmark" in err and "tp-strong at 3 ranks" in err


def _synthetic_result() -> dict:
    args = ScalingArgs(ranks=(1, 2, 4), modes=("dp-strong",))
    from dataclasses import asdict

    return {
        "machine": {"cores": 2, "backend": "gloo", "device": "cpu"}, "dtype": "float32", "params": 5.25e6,
        "args": asdict(args) | {"ffn": args.ffn_size, "global_batch": args.strong_batch},
        "threads_per_rank": {1: 2, 2: 1, 4: 1},
        "train": {"dp-strong": scaling_rows([(1, 1.0, 1536), (2, 0.8, 1536), (4, 1.6, 1536)])},
        "sync": sync_rows([{"ranks": r, "bytes": 20 * 2**20, "sync_seconds": 0.1 * r, "raw_seconds": 0.05}
                           for r in (1, 2, 4)]),
        "wall_seconds": 12.0,
    }


def test_tables_print_cores_and_efficiencies(tmp_path):
    text = format_tables(_synthetic_result())
    assert "2 cores on this node" in text and "4 ranks oversubscribe the 2 cores" in text
    assert "efficiency = T1/(N*TN)" in text
    # dp-strong at 2 ranks: 1.0 / (2 * 0.8) = 0.625 -> "0.62"; at 4: 1.0 / (4 * 1.6) = 0.156
    assert "    2 |    0.800 |       1920 |    1.25 |       0.62" in text
    assert "    4 |    1.600 |        960 |    0.62 |       0.16" in text
    assert "efficiency = raw transfer time / sync time" in text
    written = write_outputs(_synthetic_result(), str(tmp_path / "out"))
    assert json.loads(open(written[0]).read())["train"]["dp-strong"][1]["efficiency"] == pytest.approx(0.625)
    assert open(written[1], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
