"""What ``megarl bench refit --delta-lr`` counts: bf16 elements a step changed, and the bytes a
changed-only sync would send, against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from megarl_bench.refit_delta import count_changed, delta_summary


def test_a_change_counts_only_where_it_moves_the_bf16_value():
    # bf16 has 8 significant bits: spacing 2**-7 at 1.0, 2**-27 at 2**-20. A step of 1e-3 moves
    # 1.0 to no other bf16 value (half a spacing is 3.9e-3); 1e-2 does; at 2**-20, 1e-8 does
    # (half a spacing there is 3.7e-9).
    before = {"w": torch.tensor([1.0, 1.0, 2.0**-20, 0.5]), "b": torch.tensor([3.0])}
    after = {"w": torch.tensor([1.0 + 1e-3, 1.0 + 1e-2, 2.0**-20 + 1e-8, 0.5]), "b": torch.tensor([3.0])}
    before_bf16 = {n: t.to(torch.bfloat16) for n, t in before.items()}  # what the snapshot keeps
    assert count_changed(before_bf16, after) == {"elements": 5, "changed": 2}


def test_the_encodings_are_priced_against_two_bytes_an_element():
    s = delta_summary([{"elements": 800, "changed": 40}, None, {"elements": 200, "changed": 10}], lr=1e-5)
    assert s["changed_fraction"] == pytest.approx(0.05)
    assert s["positions_values_bytes_ratio"] == pytest.approx(6 * 50 / 2000)  # int32 + bf16 per change
    assert s["bitmask_values_bytes_ratio"] == pytest.approx((1000 / 8 + 2 * 50) / 2000)


def test_a_delta_message_is_the_cheaper_encoding_worked_out_by_hand():
    from megarl.reshard.delta import BITMASK, POSITIONS, apply, encode

    # 5 bf16 values, 2 changed (one of them 0.0 -> -0.0, equal as numbers, not as bytes): positions
    # would take 2 * (4 + 2) = 12 bytes, a bitmask 1 + 2 * 2 = 5: bits 1 and 4 set, 0b10010 = 18
    last = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0], dtype=torch.bfloat16)
    now = torch.tensor([1.0, 2.5, 3.0, 4.0, -0.0], dtype=torch.bfloat16)
    header, body = encode(now, last)
    assert header.tolist() == [BITMASK, 2, 5] and body[0] == 18
    values = body[1:].clone()  # at an odd offset: a copy to view as 2-byte values
    assert values.view(torch.bfloat16).tolist() == [2.5, 0.0] and values[2:].view(torch.int16) == -32768
    got = last.clone()
    apply(got, header, body)
    assert torch.equal(got.view(torch.int16), now.view(torch.int16))
    # 64 fp32 values, 1 changed: positions 4 + 4 = 8 bytes against a bitmask's 8 + 4
    last = torch.zeros(64)
    now = last.clone()
    now[37] = 0.5
    header, body = encode(now, last)
    assert header.tolist() == [POSITIONS, 1, 8] and body[:4].view(torch.int32).item() == 37
    apply(last, header, body)
    assert torch.equal(last, now)
    assert encode(now, now)[0].tolist() == [0, 0, 0] and encode(now, now)[1] is None  # nothing changed


def test_delta_sync_is_refused_for_an_engine_that_rounds_what_it_receives():
    from megarl.config.schema import RunConfig
    from megarl.platform import current_platform
    from megarl.validation.rollout_checks import fp8_rollout_errors

    cfg = RunConfig()
    cfg.trainer.delta_sync, cfg.trainer.verify_sync = True, "never"
    assert fp8_rollout_errors(cfg, None, current_platform()) == []
    cfg.rollout.weights = "fp8_emulated"
    assert fp8_rollout_errors(cfg, None, current_platform()) == [
        "trainer.delta_sync needs rollout.weights=model, got 'fp8_emulated': the engine rounds or quantizes each "
        "weight it receives, so it does not hold the bytes a delta builds on"]
