"""Keeps what the backends have loaded in line with the registry, without pulling an adapter from under a request.

Every loaded version has a slot per backend that counts its in-flight requests. A version the registry no
longer wants loaded (superseded by a promotion, rolled back, retired) is marked draining and unloaded when its
last request finishes; new requests already go elsewhere, because each version has its own backend name.
A backend that lost an adapter (it restarted) is noticed two ways: its own list of loaded adapters, checked
on every refresh, and a request failing with ``AdapterNotLoaded``, which reloads the adapter and retries once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from gateway.backends.base import AdapterNotLoaded, Backend, BackendError, ChatRequest, ChatResult, serves_adapters
from gateway.backends.pool import BackendPool
from gateway.errors import APIError
from gateway.routing import Snapshot, Target
from replay.adapters import AdapterRegistry, AdapterVersion

log = structlog.get_logger()


@dataclass(eq=False)
class _Slot:
    path: str
    loaded: bool = False
    in_flight: int = 0
    draining: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class LoadResult:
    backend: str
    adapter: str
    ok: bool
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "adapter": self.adapter, "ok": self.ok, "error": self.error}


class AdapterManager:
    def __init__(self, backends: list[Backend], registry: AdapterRegistry,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None],
                 also_wanted: Callable[[], list[AdapterVersion]] = list) -> None:
        self.hosts = [b for b in backends if serves_adapters(b)]
        self.registry = registry
        self.snapshot = Snapshot()
        self._spawn = spawn
        self._also_wanted = also_wanted  # versions canaries send traffic to, kept loaded too
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._stamp: str | None = None
        self.health: dict[str, dict[str, Any]] = {}  # each remote backend's last probe, for /healthz

    def lease(self, target: Target[Backend]) -> Backend:
        """The backend an adapter target's requests go through: it holds the version loaded while they run."""
        version = target.adapter
        assert version is not None

        def leased(backend: Backend) -> Backend | None:
            if not serves_adapters(backend):
                return None
            return AdapterBackend(backend, target.base, version, self)  # type: ignore[return-value]

        # Of a pool, only the members that load adapters; each loads the version on its first request for it.
        backend = target.backend.narrowed(leased) if isinstance(target.backend, BackendPool) else leased(
            target.backend)
        if backend is None:
            raise APIError(400, f"The backend serving '{target.base}' does not load adapters.", param="model",
                           code="adapter_not_supported")
        return backend

    def hosts_for(self, base: str) -> list[Backend]:
        return [b for b in self.hosts if base in b.models]

    def loaded(self) -> dict[str, list[str]]:
        """What each backend holds, as far as this gateway knows (for health and tests)."""
        out: dict[str, list[str]] = {b.name: [] for b in self.hosts}
        for (backend, name), slot in self._slots.items():
            if slot.loaded:
                out[backend].append(name)
        return {k: sorted(v) for k, v in out.items()}

    def in_flight(self, backend: str, adapter: str) -> int:
        slot = self._slots.get((backend, adapter))
        return slot.in_flight if slot else 0

    # -- loading -----------------------------------------------------------------------------------

    def _slot(self, backend: Backend, version: AdapterVersion) -> _Slot:
        slot = self._slots.get((backend.name, version.backend_name))
        if slot is None:
            slot = self._slots[(backend.name, version.backend_name)] = _Slot(version.path)
        return slot

    async def _ensure(self, backend: Backend, version: AdapterVersion, slot: _Slot) -> None:
        if slot.loaded:
            return
        async with slot.lock:
            if not slot.loaded:
                await backend.load_adapter(version.backend_name, version.path)  # type: ignore[attr-defined]
                slot.loaded = True
                log.info("adapter.loaded", backend=backend.name, adapter=version.backend_name)

    async def load(self, version: AdapterVersion, backends: list[Backend] | None = None) -> list[LoadResult]:
        """Load ``version`` into every backend serving its base (or those named)."""
        targets = self.hosts_for(version.base_model) if backends is None else backends

        async def one(backend: Backend) -> LoadResult:
            slot = self._slot(backend, version)
            slot.draining = False
            try:
                await self._ensure(backend, version, slot)
            except BackendError as exc:
                log.warning("adapter.load_failed", backend=backend.name, adapter=version.backend_name,
                            error=exc.message)
                return LoadResult(backend.name, version.backend_name, False, exc.message)
            return LoadResult(backend.name, version.backend_name, True)

        return list(await asyncio.gather(*(one(b) for b in targets)))

    async def _unload_when_idle(self, backend: Backend, name: str) -> None:
        slot = self._slots.get((backend.name, name))
        if slot is None:
            return
        async with slot.lock:
            if not slot.draining or slot.in_flight:
                return
            if slot.loaded:
                try:
                    await backend.unload_adapter(name)  # type: ignore[attr-defined]
                except BackendError as exc:
                    log.warning("adapter.unload_failed", backend=backend.name, adapter=name, error=exc.message)
                    return
                log.info("adapter.unloaded", backend=backend.name, adapter=name)
            if self._slots.get((backend.name, name)) is slot and slot.draining and not slot.in_flight:
                del self._slots[(backend.name, name)]

    # -- leases: one per request ------------------------------------------------------------------------

    async def acquire(self, backend: Backend, version: AdapterVersion) -> Lease:
        slot = self._slot(backend, version)
        slot.in_flight += 1
        slot.draining = False  # wanted again: a request for it arrived
        lease = Lease(self, backend, version.backend_name, slot)
        try:
            await self._ensure(backend, version, slot)
        except BaseException:
            lease.release()
            raise
        return lease

    async def reload(self, backend: Backend, version: AdapterVersion) -> None:
        """The backend said it does not hold ``version``: forget that it did, and load it again."""
        slot = self._slot(backend, version)
        slot.loaded = False
        log.warning("adapter.lost", backend=backend.name, adapter=version.backend_name)
        await self._ensure(backend, version, slot)

    def _released(self, backend: Backend, name: str, slot: _Slot) -> None:
        slot.in_flight -= 1
        if slot.draining and slot.in_flight == 0:
            self._spawn(self._unload_when_idle(backend, name))

    # -- reconciling with the registry ----------------------------------------------------------------

    async def refresh(self, *, force: bool = False) -> Snapshot:
        """Re-read the registry when it changed (or ``force``), and return the snapshot routing uses."""
        stamp = await asyncio.to_thread(self.registry.stamp)
        if force or stamp != self._stamp:
            self.snapshot = Snapshot(await asyncio.to_thread(self.registry.all))
            self._stamp = stamp
        return self.snapshot

    def wanted(self) -> dict[tuple[str, str], AdapterVersion]:
        """(backend, adapter backend name) -> version, for every version that should stay loaded."""
        versions = [v for v in self.snapshot.versions.values() if v.status == "active" or
                    (v.status == "candidate" and v.published)]
        versions += [v for v in self._also_wanted() if v.status != "retired"]
        return {(b.name, v.backend_name): v for v in versions for b in self.hosts_for(v.base_model)}

    async def reconcile(self) -> list[LoadResult]:
        """Notice lost adapters, load what is wanted, and drain what is not."""
        await self._notice_lost()
        wanted = self.wanted()
        by_name = {b.name: b for b in self.hosts}
        results: list[LoadResult] = []
        for (backend_name, _), version in wanted.items():
            slot = self._slots.get((backend_name, version.backend_name))
            if slot is None or not slot.loaded or slot.draining:
                results += await self.load(version, [by_name[backend_name]])
        for key, slot in list(self._slots.items()):
            if key not in wanted and not slot.draining:
                slot.draining = True
                if slot.in_flight == 0:
                    self._spawn(self._unload_when_idle(by_name[key[0]], key[1]))
        return results

    async def _notice_lost(self) -> None:
        for backend in self.hosts:
            probe = getattr(backend, "probe", None)
            if probe is not None:
                self.health[backend.name] = await probe()
            try:
                reported = await backend.loaded_adapters()  # type: ignore[attr-defined]
            except BackendError as exc:
                log.warning("adapter.probe_failed", backend=backend.name, error=exc.message)
                continue
            if reported is None:
                continue
            for (name, adapter), slot in self._slots.items():
                if name == backend.name and slot.loaded and adapter not in reported:
                    log.warning("adapter.lost", backend=name, adapter=adapter)
                    slot.loaded = False

    async def run(self, interval: float) -> None:
        """The refresh loop: registry changes made elsewhere (the CLI) and backend restarts are picked up here."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
                await self.reconcile()
            except Exception:  # a bad round must not end the loop; the next one tries again
                log.exception("adapter.refresh_failed")


class Lease:
    """One request's hold on a loaded adapter version; released exactly once."""

    def __init__(self, manager: AdapterManager, backend: Backend, name: str, slot: _Slot) -> None:
        self._manager, self._backend, self._name, self._slot = manager, backend, name, slot
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._manager._released(self._backend, self._name, self._slot)


class AdapterBackend:
    """A backend as one adapter version sees it: each request carries the adapter, holds a lease on it while it
    runs, and reloads it once if the backend lost it. Everything else is the wrapped backend's."""

    def __init__(self, backend: Backend, base: str, version: AdapterVersion, manager: AdapterManager) -> None:
        self.backend = backend
        self.base = base
        self.version = version
        self.manager = manager
        self.name = backend.name
        self.models = [base]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.backend, attr)

    def _request(self, request: ChatRequest) -> ChatRequest:
        return replace(request, model=self.base, adapter=self.version.backend_name)

    async def chat(self, request: ChatRequest) -> ChatResult:
        lease = await self.manager.acquire(self.backend, self.version)
        try:
            try:
                return await self.backend.chat(self._request(request))
            except AdapterNotLoaded:
                await self.manager.reload(self.backend, self.version)
                return await self.backend.chat(self._request(request))
        finally:
            lease.release()

    async def stream(self, request: ChatRequest) -> LeasedStream:
        lease = await self.manager.acquire(self.backend, self.version)
        try:
            try:
                stream = await self.backend.stream(self._request(request))
            except AdapterNotLoaded:
                await self.manager.reload(self.backend, self.version)
                stream = await self.backend.stream(self._request(request))
        except BaseException:
            lease.release()
            raise
        return LeasedStream(stream, lease)


class LeasedStream:
    """A backend's chunk stream that releases its lease when it ends or is closed."""

    def __init__(self, stream: Any, lease: Lease) -> None:
        self._stream = stream
        self._lease = lease

    @property
    def extras(self) -> Any:
        return self._stream.extras

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in self._stream:
                yield chunk
        finally:
            self._lease.release()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._lease.release()
