"""The console's server-drawn line charts: where each point lands, the axes' ticks and labels, and the edge cases
(one point, a flat series, missing values, long series)."""

from __future__ import annotations

import math

import pytest

from gateway.console import charts
from gateway.console.charts import line_chart


def _parsed(chart: charts.Chart) -> list[tuple[float, float]]:
    return [tuple(float(v) for v in pair.split(",")) for pair in chart.polyline.split()]


def test_points_span_the_plot_from_first_to_last_and_higher_values_sit_higher() -> None:
    chart = line_chart([2.5, 2.0, 1.2, 0.9], title="SFT loss", x_label="step", y_label="loss")
    points = _parsed(chart)
    assert len(points) == 4 and len(chart.dots) == 4
    assert points[0][0] == chart.left and points[-1][0] == chart.right
    assert [y for _, y in points] == sorted(y for _, y in points)  # falling loss: each point lower on the page
    assert all(chart.top <= y <= chart.bottom for _, y in points)
    assert [t.label for t in chart.x_ticks] == ["1", "2", "3", "4"]
    # The y axis is widened to whole ticks around the data, lowest tick at the bottom.
    assert [t.label for t in chart.y_ticks] == ["0.5", "1", "1.5", "2", "2.5"]
    assert chart.y_ticks[0].at == chart.bottom and chart.y_ticks[-1].at == chart.top


def test_a_fixed_range_names_on_the_x_axis_and_percent_labels() -> None:
    chart = line_chart([0.25, 0.5, None, 1.0], names=["checkpoint-1", "checkpoint-2", "lost", "RL step 1"],
                       title="Validation success", x_label="checkpoint", y_label="success", y_range=(0.0, 1.0),
                       y_format=charts.percent)
    points = _parsed(chart)
    assert len(points) == 3  # the missing value is left out, not drawn as 0
    assert [t.label for t in chart.x_ticks] == ["checkpoint-1", "checkpoint-2", "RL step 1"]
    assert [t.label for t in chart.y_ticks] == ["0%", "20%", "40%", "60%", "80%", "100%"]
    assert points[-1][1] == chart.top and points[0][1] == pytest.approx(chart.bottom - 0.25 * (chart.bottom -
                                                                                              chart.top))
    assert [d.title for d in chart.dots] == ["checkpoint-1: 25%", "checkpoint-2: 50%", "RL step 1: 100%"]


def test_one_point_a_flat_series_and_nothing_at_all() -> None:
    one = line_chart([0.3], title="t", x_label="x", y_label="y")
    assert _parsed(one) == [((one.left + one.right) / 2, pytest.approx((one.top + one.bottom) / 2))]
    assert len(one.dots) == 1 and [t.label for t in one.x_ticks] == ["1"]
    flat = line_chart([2.0, 2.0, 2.0], title="t", x_label="x", y_label="y")
    assert len({y for _, y in _parsed(flat)}) == 1 and len(flat.y_ticks) >= 2
    empty = line_chart([None, math.nan, math.inf], title="t", x_label="x", y_label="y")
    assert empty.empty and empty.polyline == "" and not empty.x_ticks


def test_a_long_series_keeps_its_x_values_has_round_ticks_and_no_dots() -> None:
    xs = list(range(1, 1001))
    chart = line_chart([x / 1000 for x in xs], xs=xs, title="t", x_label="x", y_label="y")
    assert len(chart.points) == 1000 and chart.dots == []
    assert [t.label for t in chart.x_ticks] == ["200", "400", "600", "800", "1,000"]
    assert chart.x_ticks[-1].at == chart.right


def test_tick_steps_and_labels_are_round() -> None:
    assert [charts.nice_step(span) for span in (1, 7, 12, 0.03, 480)] == [0.2, 2, 5, 0.01, 100]
    assert [charts.number(v) for v in (3.0, 12500.0, 0.30000000000000004, 1.23456)] == ["3", "12,500", "0.3",
                                                                                        "1.23"]
