"""The gate's arithmetic: which differences are within their margins."""

from __future__ import annotations

from gateway.config import GateSettings
from training.gate import decide

REFERENCE = {"success_rate": 0.5, "mean_steps": 2.0, "valid_call_rate": 0.8, "invalid_call_rate": 0.1,
             "recovery_rate": 0.4, "general_perplexity": 10.0}
GATE = GateSettings(success_rate=0.02, valid_call_rate=0.0, recovery_rate=0.05, invalid_call_rate=0.05,
                    mean_steps=0.5, general_perplexity=0.05)


def failed(candidate: dict) -> list[str]:
    return [c.metric for c in decide({**REFERENCE, **candidate}, REFERENCE, GATE).failures()]


def test_an_equal_or_better_candidate_passes() -> None:
    assert decide(REFERENCE, REFERENCE, GATE).passed
    better = {"success_rate": 0.9, "mean_steps": 1.5, "valid_call_rate": 1.0, "invalid_call_rate": 0.0,
              "recovery_rate": 0.9, "general_perplexity": 9.0}
    assert decide(better, REFERENCE, GATE).passed


def test_drops_within_their_margins_pass_and_beyond_them_fail() -> None:
    assert failed({"success_rate": 0.485}) == []
    assert failed({"success_rate": 0.47}) == ["success_rate"]
    assert failed({"valid_call_rate": 0.79}) == ["valid_call_rate"]  # margin 0: any drop
    assert failed({"invalid_call_rate": 0.14}) == []
    assert failed({"invalid_call_rate": 0.2}) == ["invalid_call_rate"]
    assert failed({"mean_steps": 2.6}) == ["mean_steps"]


def test_perplexity_is_compared_relatively() -> None:
    assert failed({"general_perplexity": 10.49}) == []
    assert failed({"general_perplexity": 10.6}) == ["general_perplexity"]


def test_a_metric_the_candidate_lacks_fails_and_one_the_reference_lacks_is_skipped() -> None:
    assert failed({"recovery_rate": None}) == ["recovery_rate"]
    decision = decide(REFERENCE, {**REFERENCE, "recovery_rate": None}, GATE)
    assert decision.passed and "recovery_rate" not in [c.metric for c in decision.checks]


def test_the_decision_serialises_with_every_check() -> None:
    stored = decide(REFERENCE, REFERENCE, GATE).as_dict()
    assert stored["passed"] is True and len(stored["checks"]) == 6
