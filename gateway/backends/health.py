"""Active health checks: each remote backend probed every ``[routing] health_check_seconds``, its breaker told.

A probe is the backend's ``check_health()`` (``GET {base_url}/models`` for the HTTP kinds); the embedded ``local``
backend has none and is always healthy. A failed probe counts as a failed request would. A successful one brings
a half-open backend back, but does not clear the failures real requests have counted on a healthy one: an upstream
that lists its models while it fails its completions must still be ejected. An ejected backend is not probed until
its cooldown has passed; then the first probe (or request) is its trial.
"""

from __future__ import annotations

import asyncio

import structlog

from gateway.backends.base import BackendError
from gateway.backends.pool import Member

log = structlog.get_logger()


class HealthMonitor:
    def __init__(self, members: list[Member], interval: float) -> None:
        self.members = [m for m in members if callable(getattr(m.backend, "check_health", None))]
        self.interval = interval

    async def probe(self, member: Member) -> None:
        breaker = member.breaker
        if not breaker.admits():
            return
        trial = breaker.state == "half_open"
        breaker.begin()
        try:
            # A probe still unanswered when the next is due has failed.
            await asyncio.wait_for(member.backend.check_health(), self.interval)  # type: ignore[attr-defined]
        except (BackendError, TimeoutError) as exc:
            breaker.failed()
            log.warning("backend.unhealthy", backend=member.name, state=breaker.state,
                        consecutive_failures=breaker.consecutive_failures,
                        error=exc.message if isinstance(exc, BackendError) else "the health check timed out")
            return
        except BaseException:
            breaker.abandoned()
            raise
        if trial:
            breaker.succeeded()
            log.info("backend.recovered", backend=member.name)

    async def run(self) -> None:
        """Probe every member, every interval, until cancelled."""
        while True:
            await asyncio.gather(*(self.probe(m) for m in self.members))
            await asyncio.sleep(self.interval)
