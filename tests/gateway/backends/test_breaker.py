"""The circuit breaker's states, driven by an injected clock."""

from __future__ import annotations

from gateway.backends.breaker import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, failures: int = 3, cooldown: float = 10.0) -> Breaker:
    return Breaker(failures, cooldown, clock)


def test_consecutive_failures_eject_and_a_success_between_them_resets_the_count() -> None:
    b = breaker(Clock())
    b.failed()
    b.failed()
    b.succeeded()
    b.failed()
    b.failed()
    assert (b.state, b.consecutive_failures, b.admits()) == ("healthy", 2, True)
    b.failed()
    assert (b.state, b.admits()) == ("ejected", False)


def test_after_the_cooldown_one_trial_is_let_through_and_its_success_brings_the_backend_back() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failed()
    clock.now += 9.9
    assert b.state == "ejected"
    clock.now += 0.2
    assert (b.state, b.admits()) == ("half_open", True)
    b.begin()
    assert not b.admits(), "a second request went through while the trial was under way"
    b.succeeded()
    assert (b.state, b.consecutive_failures, b.admits()) == ("healthy", 0, True)


def test_a_failed_trial_ejects_again_for_a_whole_cooldown() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failed()
    clock.now += 10
    b.begin()
    b.failed()
    assert b.state == "ejected"
    clock.now += 9.9
    assert b.state == "ejected"
    clock.now += 0.1
    assert b.state == "half_open"


def test_an_abandoned_trial_leaves_the_next_request_the_trial() -> None:
    clock = Clock()
    b = breaker(clock, failures=1)
    b.failed()
    clock.now += 10
    b.begin()
    b.abandoned()
    assert (b.state, b.admits()) == ("half_open", True)


def test_beginning_a_request_on_a_healthy_backend_takes_no_trial() -> None:
    b = breaker(Clock())
    b.begin()
    b.begin()
    assert b.admits()
