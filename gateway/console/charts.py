"""Line charts drawn on the server: a series of numbers in, the pixel geometry of an SVG chart out (its line, its
axes' ticks and labels), which ``_chart.html`` turns into markup. No script draws anything: the CSP allows none
but the console's own, and a chart needs none. Pure."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 60, 40, 14, 42  # margins around the plot: room for the ticks' labels
MAX_X_NAMES = 8  # named x ticks beyond this are thinned, so their labels do not overlap
MAX_DOTS = 60  # a series this short gets a dot per point (one point alone would draw no line)


def number(value: float) -> str:
    """A tick's label: short, no exponent for counts of steps."""
    if value == int(value) and abs(value) < 1e9:
        return f"{int(value):,}"
    return f"{value:.3g}"


def percent(value: float) -> str:
    return f"{value:.0%}"


@dataclass(frozen=True)
class Tick:
    at: float  # pixels along its axis
    label: str


@dataclass(frozen=True)
class Dot:
    x: float
    y: float
    title: str  # what hovering over it says


@dataclass(frozen=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    points: list[tuple[float, float]]  # pixels, in order
    x_ticks: list[Tick] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    dots: list[Dot] = field(default_factory=list)
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def left(self) -> int:
        return LEFT

    @property
    def right(self) -> int:
        return self.width - RIGHT

    @property
    def top(self) -> int:
        return TOP

    @property
    def bottom(self) -> int:
        return self.height - BOTTOM

    @property
    def polyline(self) -> str:
        """The line's ``points`` attribute."""
        return " ".join(f"{x:.1f},{y:.1f}" for x, y in self.points)

    @property
    def empty(self) -> bool:
        return not self.points


def nice_step(span: float, count: int = 5) -> float:
    """A tick step of 1, 2 or 5 times a power of ten giving about ``count`` ticks over ``span``."""
    raw = span / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _domain(lo: float, hi: float) -> tuple[float, float, float]:
    """The axis' range, widened to whole ticks, and its step."""
    if hi == lo:  # a flat series: a unit around it
        lo, hi = lo - (abs(lo) / 2 or 1.0), hi + (abs(hi) / 2 or 1.0)
    step = nice_step(hi - lo)
    return math.floor(lo / step) * step, math.ceil(hi / step) * step, step


def _ticks(lo: float, hi: float, step: float, place: Callable[[float], float],
           fmt: Callable[[float], str]) -> list[Tick]:
    ticks, i = [], 0
    while (value := lo + i * step) <= hi + step / 1e6:
        ticks.append(Tick(place(value), fmt(0.0 if abs(value) < step / 1e6 else value)))
        i += 1
    return ticks


def line_chart(values: Sequence[float | None], *, title: str, x_label: str, y_label: str,
               xs: Sequence[float] | None = None, names: Sequence[str] | None = None,
               y_range: tuple[float, float] | None = None, y_format: Callable[[float], str] = number,
               width: int = WIDTH, height: int = HEIGHT) -> Chart:
    """``values`` as a line over ``xs`` (default 1, 2, …), or over ``names`` (one per value, evenly spaced: e.g.
    checkpoints); missing and non-finite values are left out. ``y_range``: a fixed y axis (rates: 0 to 1)."""
    positions = list(xs) if xs is not None else [float(i) for i in range(1, len(values) + 1)]
    labels = list(names) if names is not None else [number(x) for x in positions]
    kept = [(x, y, label) for x, y, label in zip(positions, values, labels, strict=True)
            if y is not None and math.isfinite(y)]
    if not kept:
        return Chart(title, x_label, y_label, points=[], width=width, height=height)
    left, right, top, bottom = LEFT, width - RIGHT, TOP, height - BOTTOM

    ys = [y for _, y, _ in kept]
    if y_range is not None:
        (y_lo, y_hi), y_step = y_range, nice_step(y_range[1] - y_range[0])
    else:
        y_lo, y_hi, y_step = _domain(min(ys), max(ys))

    def place_y(y: float) -> float:
        return bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top)

    if names is not None:  # evenly spaced, each at its own name
        spots = list(range(len(kept)))
        x_lo, x_hi = 0.0, float(max(len(kept) - 1, 1))
    else:
        spots = [x for x, _, _ in kept]
        x_lo, x_hi = min(spots), max(spots)

    def place_x(x: float) -> float:
        if x_hi == x_lo:
            return (left + right) / 2
        return left + (x - x_lo) / (x_hi - x_lo) * (right - left)

    points = [(place_x(x), place_y(y)) for x, (_, y, _) in zip(spots, kept, strict=True)]
    if names is not None:
        every = math.ceil(len(kept) / MAX_X_NAMES)
        x_ticks = [Tick(place_x(i), kept[i][2]) for i in range(0, len(kept), every)]
    elif x_hi == x_lo:
        x_ticks = [Tick(place_x(x_lo), number(x_lo))]
    else:
        step = nice_step(x_hi - x_lo)
        first = math.ceil(x_lo / step) * step
        x_ticks = _ticks(first, x_hi, step, place_x, number)
    dots = [Dot(px, py, f"{label}: {y_format(y)}") for (px, py), (_, y, label) in zip(points, kept, strict=True)] \
        if len(kept) <= MAX_DOTS else []
    return Chart(title, x_label, y_label, points=points, x_ticks=x_ticks,
                 y_ticks=_ticks(y_lo, y_hi, y_step, place_y, y_format),
                 dots=dots, width=width, height=height)
