"""Suite metrics from episodes, against hand-computed values."""

from __future__ import annotations

import pytest

from training.metrics import Episode, format_value, metrics_of, success_interval, wilson_interval


def episode(success: bool, steps: int, calls: int, invalid: int, *, family: str = "calculator",
            faulted: bool = False, unseen: bool = False) -> Episode:
    return Episode(task_id="t", family=family, success=success, steps=steps, tool_calls=calls, invalid_calls=invalid,
                   needs_tools=family != "cannot", faulted=faulted, status="completed", termination_reason=None,
                   final="", run_id="r", unseen_tools=unseen)


def test_metrics_match_hand_computed_values() -> None:
    episodes = [
        episode(True, 2, 1, 0),                       # valid use
        episode(False, 3, 2, 1),                      # one invalid call: not valid use
        episode(False, 1, 0, 0),                      # never called a tool: not valid use
        episode(True, 1, 0, 0, family="cannot"),      # needs no tool: not counted for validity
        episode(True, 3, 2, 0, faulted=True),         # recovered
        episode(False, 4, 1, 0, faulted=True),        # did not recover
        episode(True, 2, 1, 0, unseen=True),          # a tool only described, used well
        episode(False, 2, 1, 1, unseen=True),         # and used badly
    ]
    m = metrics_of(episodes)
    assert m["success_rate"] == 4 / 8
    assert m["mean_steps"] == (2 + 3 + 1 + 1 + 3 + 4 + 2 + 2) / 8
    assert m["valid_call_rate"] == 4 / 7  # episodes 1, 5, 6, 7 of the seven that need tools
    assert m["invalid_call_rate"] == 2 / 8  # calls: 1 + 2 + 0 + 0 + 2 + 1 + 1 + 1
    assert m["recovery_rate"] == 1 / 2
    assert m["unseen_tool_success_rate"] == 1 / 2


def test_answering_without_a_call_where_no_tool_fits_is_counted_right_or_wrong() -> None:
    def direct(calls: int, invalid: int, final: str, success: bool = False) -> Episode:
        return Episode(task_id="t", family="no_tool", success=success, steps=1, tool_calls=calls,
                       invalid_calls=invalid, needs_tools=False, faulted=False, status="completed",
                       termination_reason=None, final=final, run_id="r", direct=True)

    m = metrics_of([direct(0, 0, "Paris.", True), direct(0, 0, "Lyon."), direct(1, 0, "Paris."),
                    direct(0, 1, "Paris."), direct(0, 0, "I cannot say."), direct(0, 0, " "),
                    episode(True, 1, 0, 0)])
    assert m["direct_answer_rate"] == 2 / 6
    assert metrics_of([episode(True, 1, 0, 0)])["direct_answer_rate"] is None


def test_no_calls_and_no_faults_are_reported_plainly() -> None:
    m = metrics_of([episode(False, 1, 0, 0)])
    assert m["invalid_call_rate"] == 0.0 and m["recovery_rate"] is None and m["valid_call_rate"] == 0.0
    assert m["unseen_tool_success_rate"] is None
    assert metrics_of([])["success_rate"] is None


def test_values_format_for_people() -> None:
    assert format_value("success_rate", 0.456) == "46%"
    assert format_value("mean_steps", 2.0) == "2.00"
    assert format_value("recovery_rate", None) == "-"


def test_the_success_interval_is_wilsons() -> None:
    # Reference values of the 95% Wilson score interval.
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    low, high = wilson_interval(6, 63)  # the README's candidate: 10% of 63 test tasks
    assert low < 6 / 63 < high and high - low > 0.12  # 63 tasks cannot tell 10% from 20%
    assert wilson_interval(0, 0) == (0.0, 1.0)
    episodes = [episode(i < 3, 2, 1, 0) for i in range(12)]
    assert success_interval(episodes) == wilson_interval(3, 12) and success_interval([]) is None
