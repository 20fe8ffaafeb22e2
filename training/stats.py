"""One-sided confidence bounds for the gate, as pure functions of per-task outcomes.

- ``rate_bounds``: the Wilson score bounds of a rate (n trials, a share of successes), one-sided at the confidence
  given, so a 0% or 100% rate on few trials still gets an honest bound;
- ``paired_bootstrap``: the one-sided bounds of any statistic of paired per-task values (candidate and reference
  on the same tasks), by resampling the tasks with a fixed seed: the same data always gives the same bounds.

Pure Python (``random.Random``), so the gate needs no numerical library and runs without the training extra.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import TypeVar

T = TypeVar("T")


def rate_bounds(successes: float, trials: int, confidence: float) -> tuple[float, float]:
    """One-sided Wilson bounds (lower, upper) of a success rate at ``confidence`` each. ``successes`` may be
    fractional (the sum of per-task success shares over several samples): each task then counts as one trial
    whose variance is at most a coin's, so the bounds stay conservative."""
    if trials <= 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(confidence)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    # At 0 or n successes the formula's bound is the end itself, bar rounding.
    lower = 0.0 if successes <= 0 else max(0.0, centre - half)
    upper = 1.0 if successes >= trials else min(1.0, centre + half)
    return lower, upper


def paired_bootstrap(items: Sequence[T], statistic: Callable[[Sequence[T]], float], *, confidence: float,
                     resamples: int, seed: int = 0) -> tuple[float, float, float]:
    """(estimate, lower, upper): ``statistic`` of ``items`` and its one-sided percentile-bootstrap bounds at
    ``confidence`` each. Each item is one task's paired outcome (both sides' values), so a resample keeps the
    pairing; the fixed ``seed`` makes the bounds a function of the data alone."""
    if not items:
        raise ValueError("a bootstrap needs at least one item")
    estimate = statistic(items)
    rng = random.Random(seed)
    population = range(len(items))
    values = sorted(statistic([items[i] for i in rng.choices(population, k=len(items))]) for _ in range(resamples))
    tail = max(0, math.floor((1 - confidence) * resamples) - 1)
    return estimate, values[tail], values[resamples - 1 - tail]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
