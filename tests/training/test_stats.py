"""The gate's bounds: Wilson's one-sided bounds and the paired bootstrap."""

from __future__ import annotations

import random

import pytest

from training.stats import mean, paired_bootstrap, rate_bounds

BOOT = {"confidence": 0.95, "resamples": 10_000}  # what the gate uses unless [training.gate] says otherwise


def test_wilson_bounds_are_one_sided_and_honest_at_the_extremes() -> None:
    low, high = rate_bounds(50, 100, 0.95)
    assert low == pytest.approx(0.4189, abs=1e-4) and high == pytest.approx(0.5811, abs=1e-4)  # z = 1.645
    assert rate_bounds(0, 20, 0.95)[0] == 0.0 and 0.09 < rate_bounds(0, 20, 0.95)[1] < 0.13
    assert rate_bounds(20, 20, 0.95)[1] == 1.0 and rate_bounds(20, 20, 0.95)[0] > 0.85
    assert rate_bounds(5, 10, confidence=0.99)[0] < rate_bounds(5, 10, 0.95)[0]
    assert rate_bounds(0, 0, 0.95) == (0.0, 1.0)


def test_the_paired_bootstrap_is_a_function_of_its_data_and_seed() -> None:
    rng = random.Random(3)
    pairs = [(rng.random() < 0.6, rng.random() < 0.4) for _ in range(100)]

    def gain(items: list[tuple[bool, bool]]) -> float:
        return mean([c - r for c, r in items])

    first = paired_bootstrap(pairs, gain, seed=0, **BOOT)
    assert paired_bootstrap(pairs, gain, seed=0, **BOOT) == first
    estimate, lower, upper = first
    assert lower < estimate < upper and estimate == gain(pairs)
    # About the normal approximation's width for a mean of 100 paired differences.
    diffs = [c - r for c, r in pairs]
    sd = (sum((d - estimate) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
    assert estimate - lower == pytest.approx(1.645 * sd / 10, rel=0.15)


def test_the_bootstrap_cannot_see_a_difference_that_is_not_there() -> None:
    same = [(1, 1)] * 30 + [(0, 0)] * 70
    assert paired_bootstrap(same, lambda items: mean([c - r for c, r in items]), **BOOT) == (0.0, 0.0, 0.0)
    two = [(1, 0)] * 2 + [(0, 0)] * 98  # two wins of a hundred: within noise
    assert paired_bootstrap(two, lambda items: mean([c - r for c, r in items]), **BOOT)[1] == 0.0
    with pytest.raises(ValueError):
        paired_bootstrap([], mean, **BOOT)
