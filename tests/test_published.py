"""The planner's step time against published runs (sources in megarl.plan.published): each
estimate must stay within 30% of its published figure."""

from __future__ import annotations

import pytest

from megarl.plan.published import RUNS, estimate, format_comparison


def test_at_least_four_published_runs_with_sources():
    assert len(RUNS) >= 4
    for run in RUNS:
        assert "@" in run.source and run.recipe and run.step_s > 0


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_estimate_within_30_percent_of_published(run):
    c = estimate(run)
    assert 0.7 <= c.ratio <= 1.3, format_comparison([c])


def test_generation_follows_the_longest_response():
    # same mean, longer tail: more decode steps with a thinning batch, so generation takes longer
    from dataclasses import replace

    run = RUNS[0]
    short_tail = replace(run, max_seq=int(run.mean_seq * 1.5))
    assert estimate(run).times["generation"] > estimate(short_tail).times["generation"]
