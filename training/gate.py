"""The gate: a candidate replaces the reference (the active adapter, else the base) only if no configured
metric got worse beyond its margin on the test split.

Margins (``[training.gate]``) are absolute for rates and steps, and relative for perplexity (0.05: at most
5% higher). A metric the reference has but the candidate lacks counts as worse; one neither has is skipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gateway.config import GateSettings
from training.metrics import HIGHER_IS_BETTER


@dataclass(frozen=True)
class Check:
    metric: str
    reference: float | None
    candidate: float | None
    margin: float
    passed: bool


@dataclass(frozen=True)
class Decision:
    passed: bool
    checks: list[Check]

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": [asdict(c) for c in self.checks]}


def _check(metric: str, reference: float | None, candidate: float | None, margin: float) -> Check | None:
    if reference is None:
        return None
    if candidate is None:
        return Check(metric, reference, candidate, margin, False)
    if metric == "general_perplexity":
        passed = candidate <= reference * (1 + margin)
    elif HIGHER_IS_BETTER[metric]:
        passed = candidate >= reference - margin
    else:
        passed = candidate <= reference + margin
    return Check(metric, reference, candidate, margin, passed)


def decide(candidate: dict[str, float | None], reference: dict[str, float | None], gate: GateSettings) -> Decision:
    checks = [c for metric, margin in gate.model_dump().items()
              if (c := _check(metric, reference.get(metric), candidate.get(metric), margin)) is not None]
    return Decision(passed=all(c.passed for c in checks), checks=checks)
