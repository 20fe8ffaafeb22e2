"""Several backends serving one model: a ``BackendPool`` spreads its requests over them and moves on from one that
fails before anything reached the client.

Each configured backend is one ``Member``, shared by every pool it belongs to (a backend serving two models is in
two pools, with one in-flight count and one circuit breaker). A request goes to the member with the fewest
requests in flight per unit of weight, among those whose breaker admits traffic; members tied on that (an idle
pool) take turns in proportion to their weights (smooth weighted round-robin, as nginx deals them). When every
member is ejected the request is tried on them anyway: a guess at a recovering upstream serves a client better
than a refusal. A connection failure, a timeout, a 429 or a 5xx from one member is tried on the next, each
member at most once; a stream only until ``stream()`` returns, never once chunks flow.

A pool is a ``Backend`` itself, so routing, the exchange and agent runs treat it as any other. What answered is
told in ``ChatResult.backend`` and the stream's ``backend``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from gateway.backends.base import Backend, BackendError, ChatRequest, ChatResult, ChunkStream, StreamView
from gateway.backends.breaker import Breaker
from gateway.config import PASSED_THROUGH, BackendSettings, RoutingSettings
from tools.settings import ConfigError

log = structlog.get_logger()

T = TypeVar("T")


def worth_another(exc: BackendError) -> bool:
    """A failure of the member rather than of the request: another member may well answer it."""
    return exc.status_code == 429 or exc.status_code >= 500


@dataclass(eq=False)
class Member:
    """One backend as the pools see it: its weight, its requests in flight and its breaker."""

    backend: Backend
    weight: float
    breaker: Breaker
    in_flight: int = 0
    _turn: float = 0.0  # smooth weighted round-robin's running score among tied members

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def load(self) -> float:
        return self.in_flight / self.weight

    def take(self) -> None:
        self.in_flight += 1
        self.breaker.begin()

    def release(self, failure: BaseException | None) -> None:
        """A request to this member ended: with ``failure`` (None when it succeeded)."""
        self.in_flight -= 1
        if failure is None:
            self.breaker.succeeded()
        elif not isinstance(failure, BackendError):
            self.breaker.abandoned()  # cancelled, or its client left: says nothing about the backend
        elif worth_another(failure):
            self.breaker.failed()
        else:
            self.breaker.succeeded()  # the backend answered; the request was at fault

    def status(self) -> dict[str, Any]:
        return {"state": self.breaker.state, "in_flight": self.in_flight,
                "consecutive_failures": self.breaker.consecutive_failures, "weight": self.weight}


def choose(members: Sequence[Member], exclude: Sequence[Member] = ()) -> Member | None:
    """The member the next request goes to, or None when every one is excluded (already tried)."""
    left = [m for m in members if m not in exclude]
    if not left:
        return None
    admitted = [m for m in left if m.breaker.admits()] or left
    least = min(m.load for m in admitted)
    tied = [m for m in admitted if m.load == least]
    if len(tied) == 1:
        return tied[0]
    for m in tied:
        m._turn += m.weight
    best = max(tied, key=lambda m: m._turn)
    best._turn -= sum(m.weight for m in tied)
    return best


class BackendPool:
    """The members serving one model, as one backend. ``entries`` pairs each member with the backend requests go
    through: the member's own, or a view of it (an adapter version's, see ``narrowed``)."""

    def __init__(self, model: str, entries: list[tuple[Member, Backend]]) -> None:
        self.model = model
        self.models = [model]
        self.entries = entries
        self.name = "+".join(member.name for member, _ in entries)
        self.apis = frozenset.intersection(*(frozenset(getattr(backend, "apis", ())) for _, backend in entries))
        self._by_member = dict(entries)

    @property
    def members(self) -> list[Member]:
        return [member for member, _ in self.entries]

    def narrowed(self, view: Callable[[Backend], Backend | None]) -> BackendPool | None:
        """The same members, each reached through ``view(backend)``; those it gives None for are left out. None
        when it leaves none."""
        entries = [(member, seen) for member, backend in self.entries if (seen := view(backend)) is not None]
        return BackendPool(self.model, entries) if entries else None

    async def start(self) -> None:
        """Nothing of its own: its members are started as backends."""

    async def aclose(self) -> None:
        """Nothing of its own: its members are closed as backends."""

    async def chat(self, request: ChatRequest) -> ChatResult:
        member, result = await self._answered(lambda backend: backend.chat(request))
        result.backend = member.name
        return result

    async def stream(self, request: ChatRequest) -> MemberStream:
        return await self._streamed(lambda backend: backend.stream(request))

    # OpenAI's other APIs, where every member serves them (``apis``).

    async def completions(self, request: ChatRequest) -> ChatResult:
        member, result = await self._answered(lambda backend: backend.completions(request))  # type: ignore[attr-defined]
        result.backend = member.name
        return result

    async def stream_completions(self, request: ChatRequest) -> MemberStream:
        return await self._streamed(lambda backend: backend.stream_completions(request))  # type: ignore[attr-defined]

    async def embeddings(self, request: ChatRequest) -> dict[str, Any]:
        _, answer = await self._answered(lambda backend: backend.embeddings(request))  # type: ignore[attr-defined]
        return answer

    async def _answered(self, call: Callable[[Backend], Awaitable[T]]) -> tuple[Member, T]:
        member, answer = await self._first_answer(call)
        member.release(None)
        return member, answer

    async def _streamed(self, call: Callable[[Backend], Awaitable[ChunkStream]]) -> MemberStream:
        member, stream = await self._first_answer(call)
        return MemberStream(stream, member)

    async def _first_answer(self, call: Callable[[Backend], Awaitable[T]]) -> tuple[Member, T]:
        """``call`` on one member after another until one answers; the member is still taken when it returns."""
        tried: list[Member] = []
        while (member := choose(self.members, tried)) is not None:
            member.take()
            try:
                return member, await call(self._by_member[member])
            except BackendError as exc:
                member.release(exc)
                tried.append(member)
                if not worth_another(exc) or len(tried) == len(self.entries):
                    exc.backend = member.name
                    raise
                log.warning("pool.retry", pool=self.model, backend=member.name, status=exc.status_code,
                            error=exc.message)
            except BaseException as exc:
                member.release(exc)
                raise
        raise AssertionError("a pool has at least one member")


# What a stream closed before its end (its client left) counts as: no verdict on the member.
_CLOSED_EARLY = ConnectionAbortedError("the stream was closed before its end")


class MemberStream(StreamView):
    """A member's chunk stream that keeps the member taken until it ends, and names it in ``backend``."""

    def __init__(self, stream: ChunkStream, member: Member) -> None:
        super().__init__(stream)
        self._member = member
        self._released = False
        self.backend = member.name

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        failure: BaseException | None = None
        try:
            async for chunk in self._stream:
                yield chunk
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._release(failure)

    def _release(self, failure: BaseException | None) -> None:
        if not self._released:
            self._released = True
            self._member.release(failure)

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._release(_CLOSED_EARLY)


def member_settings(backends: list[BackendSettings], member_retries: int) -> list[BackendSettings]:
    """The backends as they are built: one that shares a model with another retries at most ``member_retries``
    times itself, so that a failing upstream hands its request on to the next member soon."""
    owners: dict[str, int] = {}
    for b in backends:
        for model in b.models:
            owners[model] = owners.get(model, 0) + 1
    return [b.model_copy(update={"max_retries": min(b.max_retries, member_retries)})
            if any(owners[m] > 1 for m in b.models) else b for b in backends]


def build_pools(backends: list[Backend], settings: list[BackendSettings], routing: RoutingSettings,
                clock: Callable[[], float] = time.monotonic) -> tuple[list[Member], dict[str, Backend]]:
    """A member for every backend, and each model's backend: the one serving it, or a pool of all that do."""
    weights = {b.name: b.weight for b in settings}
    kinds = {b.name: b.kind for b in settings}
    members = [Member(b, weights[b.name], Breaker(routing.eject_after_failures, routing.eject_seconds, clock))
               for b in backends]
    serving: dict[str, list[Member]] = {}
    for member in members:
        for model in member.backend.models:
            serving.setdefault(model, []).append(member)
    models: dict[str, Backend] = {}
    for model, group in serving.items():
        if len(group) == 1:
            models[model] = group[0].backend
            continue
        passed = [m.name for m in group if kinds[m.name] in PASSED_THROUGH]
        if passed:
            raise ConfigError(f"model {model!r} is listed by several backends, {passed[0]!r} among them: an "
                              f"{kinds[passed[0]]} backend passes its requests through as they came and cannot "
                              "share a model")
        models[model] = BackendPool(model, [(m, m.backend) for m in group])
    return members, models
