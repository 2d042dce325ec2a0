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
