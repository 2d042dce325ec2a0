"""What the weight sync's log-prob check accepts, by the dtypes in play (trainer.verify_tolerance,
trainer.verify_mult_error). The figures it is set against were measured on the demo in bfloat16
(actor, reference and rollout; `trainer.verify_sync=every`, 3 steps): a correct sync differs by
0.49 to 0.62 in its worst token and 1.058 to 1.063 in token_mult_prob_error. In float32 the same
check is within 1e-4."""

from __future__ import annotations

import math

import pytest

from megarl.config.loader import load_config
from megarl.config.schema import RunConfig
from megarl.recipes import DEFAULT
from megarl.workers.weight_sync import sync_check_bounds

BF16_MEASURED = (0.6233, 1.0625)  # step 1 of the run above: (max |diff|, token_mult_prob_error)


def _accepts(bounds: tuple[float, float], measured: tuple[float, float]) -> bool:
    return measured[0] <= bounds[0] and measured[1] <= bounds[1]


def test_float32_keeps_the_token_bound():
    assert sync_check_bounds(("float32", "float32"), None, 1.1) == (1e-3, math.inf)
    assert not _accepts(sync_check_bounds(("float32", "float32"), None, 1.1), BF16_MEASURED)


@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float16", "float32"),
                                    ("fp8", "bfloat16")])
def test_sixteen_bits_on_either_side_bound_the_mean(dtypes):
    bounds = sync_check_bounds(dtypes, None, 1.1)
    assert bounds == (math.inf, 1.1) and _accepts(bounds, BF16_MEASURED)
    assert not _accepts(bounds, (0.6, 1.5))  # a mean this far off is not rounding


def test_an_explicit_tolerance_is_the_only_bound():
    assert sync_check_bounds(("bfloat16", "bfloat16"), 0.7, 1.1) == (0.7, math.inf)


def test_the_defaults_and_their_ranges():
    cfg = load_config(RunConfig, DEFAULT, [])
    assert (cfg.trainer.verify_tolerance, cfg.trainer.verify_mult_error) == (None, 1.1)
    from megarl.validation.ranges import range_errors

    cfg = load_config(RunConfig, DEFAULT, ["trainer.verify_mult_error=1.0", "trainer.verify_tolerance=0"])
    problems = range_errors(cfg)
    assert any(p.startswith("trainer.verify_mult_error=1.0") for p in problems), problems
    assert any(p.startswith("trainer.verify_tolerance=0") for p in problems), problems
