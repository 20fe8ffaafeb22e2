"""The eval gate's decision as ``replay-train`` stores it with a version and a run (``Decision.as_dict()``), read for
the adapters' and training runs' pages, its figures formatted as ``replay-train`` prints them. Read here rather than
through ``training.gate``, which the gateway does not depend on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GateCheck:
    """One of the gate's checks as stored with the version (``training.gate.Check``, as a dict), its figures
    formatted as ``replay-train`` prints them."""

    name: str
    reference: str
    candidate: str
    bound: str
    must_be: str
    n: int
    outcome: str  # pass | FAIL | skip
    note: str

    @property
    def why(self) -> str:
        """Why it failed, as ``Decision.summary`` says it."""
        return self.note if self.bound == "–" else f"{self.bound} (must be {self.must_be})"


@dataclass(frozen=True)
class Gate:
    passed: bool
    reason: str
    tasks: int | None
    samples: int | None
    confidence: float | None
    seed: int | None
    checks: list[GateCheck]


def _figure(name: str, value: Any, *, own: bool = False) -> str:
    """A check's figure: a rate as a percentage, except steps, and a side's own perplexity (its rise is one)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return "–"
    plain = name == "excess steps" or (own and name == "perplexity rise")
    return f"{value:.2f}" if plain else f"{value:.1%}"


def _check(raw: dict[str, Any]) -> GateCheck:
    name = str(raw.get("name", "?"))
    skipped, passed = raw.get("bound") is None, bool(raw.get("passed"))
    return GateCheck(name=name, reference=_figure(name, raw.get("reference"), own=True),
                     candidate=_figure(name, raw.get("candidate"), own=True),
                     bound=f"{raw.get('side', '')} bound {_figure(name, raw.get('bound'))}" if not skipped else "–",
                     must_be=f"{raw.get('relation', '')} {_figure(name, raw.get('threshold'))}",
                     n=int(raw.get("n") or 0), outcome="skip" if skipped and passed else "pass" if passed else "FAIL",
                     note=str(raw.get("note") or ""))


def gate_of(metrics: dict[str, Any] | None) -> Gate | None:
    """The gate's decision ``replay-train`` stored in a version's metrics (``Decision.as_dict()``), if any. Read
    here rather than through ``training.gate``, which the gateway does not depend on."""
    raw = (metrics or {}).get("gate")
    if not isinstance(raw, dict):
        return None
    checks = [_check(c) for c in raw.get("checks") or () if isinstance(c, dict)]
    failed = [c for c in checks if c.outcome == "FAIL"]
    reason = "gate passed" if raw.get("passed") else "gate refused: " + "; ".join(f"{c.name} {c.why}" for c in failed)
    return Gate(passed=bool(raw.get("passed")), reason=reason, tasks=raw.get("tasks"), samples=raw.get("samples"),
                confidence=raw.get("confidence"), seed=raw.get("seed"), checks=checks)
