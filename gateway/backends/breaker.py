"""A circuit breaker for one backend: healthy, ejected for a cooldown, then half-open, without I/O.

``failures`` consecutive failures (real requests or health probes alike) eject the backend for ``cooldown`` seconds.
Once the cooldown has passed it is half-open: one trial (a probe or a real request) is let through, and its outcome
decides: a success makes it healthy again, a failure ejects it for another cooldown. Any success resets the count.
The clock is injected so the transitions can be tested without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

State = Literal["healthy", "ejected", "half_open"]


class Breaker:
    def __init__(self, failures: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures_to_eject = failures
        self.cooldown = cooldown
        self.consecutive_failures = 0
        self._clock = clock
        self._ejected_until: float | None = None
        self._trial = False  # a half-open trial is under way: nothing else is let through meanwhile

    @property
    def state(self) -> State:
        if self._ejected_until is None:
            return "healthy"
        return "ejected" if self._clock() < self._ejected_until else "half_open"

    def admits(self) -> bool:
        """Whether a request (or a probe) may go to the backend now."""
        state = self.state
        return state == "healthy" or (state == "half_open" and not self._trial)

    def begin(self) -> None:
        """A request goes out; when half-open, it is the trial."""
        if self.state == "half_open":
            self._trial = True

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        self._ejected_until = None
        self._trial = False

    def failed(self) -> None:
        self.consecutive_failures += 1
        self._trial = False
        # A failed trial ejects again at once; a healthy backend only after enough failures in a row.
        if self._ejected_until is not None or self.consecutive_failures >= self.failures_to_eject:
            self._ejected_until = self._clock() + self.cooldown

    def abandoned(self) -> None:
        """A request ended with no verdict on the backend (its client left): a trial is open to the next one."""
        self._trial = False
