"""The adapter manager against an in-memory adapter host: lazy loads, leases, draining, lost adapters."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.adapters.manager import AdapterBackend, AdapterManager
from gateway.backends.base import AdapterNotLoaded, BackendError, ChatRequest, ChatResult
from replay.adapters import AdapterRegistry


class Host:
    """Holds adapters by name; records every load and unload, and the adapter each request named."""

    def __init__(self) -> None:
        self.name = "host"
        self.models = ["qwen"]
        self.loaded: dict[str, str] = {}
        self.log: list[tuple[str, str]] = []
        self.served: list[str | None] = []
        self.load_delay = 0.0

    async def load_adapter(self, name: str, path: str) -> None:
        await asyncio.sleep(self.load_delay)
        if "missing" in path:
            raise BackendError(f"no adapter at {path}", status_code=400)
        self.log.append(("load", name))
        self.loaded[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.log.append(("unload", name))
        self.loaded.pop(name, None)

    async def loaded_adapters(self) -> set[str]:
        return set(self.loaded)

    async def chat(self, request: ChatRequest) -> ChatResult:
        if request.adapter and request.adapter not in self.loaded:
            raise AdapterNotLoaded(f"unknown adapter {request.adapter}", adapter=request.adapter)
        self.served.append(request.adapter)
        await asyncio.sleep(float(request.body.get("sleep", 0)))
        return ChatResult(response={"choices": [{"message": {"content": str(request.adapter)}}]})


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
def setup(tmp_path: Path, host: Host) -> tuple[AdapterManager, AdapterRegistry, set[asyncio.Task[Any]]]:
    registry = AdapterRegistry(str(tmp_path / "h.db"))
    tasks: set[asyncio.Task[Any]] = set()
    manager = AdapterManager([host], registry, lambda coro: tasks.add(asyncio.ensure_future(coro)))
    return manager, registry, tasks


async def settle(tasks: set[asyncio.Task[Any]]) -> None:
    while pending := [t for t in tasks if not t.done()]:
        await asyncio.gather(*pending)


async def test_concurrent_first_requests_load_an_adapter_once(setup, host: Host) -> None:
    manager, registry, _ = setup
    registry.register("sql", "qwen", "/a/1")
    registry.promote("sql", 1)
    await manager.refresh()
    version = manager.snapshot.active["sql"]
    host.load_delay = 0.05
    backend = AdapterBackend(host, "qwen", version, manager)  # type: ignore[arg-type]
    results = await asyncio.gather(*(backend.chat(ChatRequest(body={}, model="x")) for _ in range(5)))
    assert [r.message["content"] for r in results] == ["sql@1"] * 5
    assert host.log == [("load", "sql@1")]
    assert manager.in_flight("host", "sql@1") == 0


async def test_reconcile_loads_what_is_wanted_and_drains_the_rest_after_its_requests(setup, host: Host) -> None:
    manager, registry, tasks = setup
    registry.register("sql", "qwen", "/a/1")
    registry.register("sql", "qwen", "/a/2")
    registry.promote("sql", 1)
    await manager.refresh()
    assert [r.ok for r in await manager.reconcile()] == [True]
    old = manager.snapshot.active["sql"]
    slow = asyncio.create_task(AdapterBackend(host, "qwen", old, manager).chat(  # type: ignore[arg-type]
        ChatRequest(body={"sleep": 0.3}, model="qwen")))
    await asyncio.sleep(0.05)
    registry.promote("sql", 2)
    await manager.refresh()
    await manager.reconcile()
    await settle(tasks)
    assert ("load", "sql@2") in host.log and ("unload", "sql@1") not in host.log  # still in flight
    assert (await slow).message["content"] == "sql@1"
    await settle(tasks)
    assert host.log[-1] == ("unload", "sql@1")
    assert manager.loaded() == {"host": ["sql@2"]}


async def test_a_lost_adapter_is_noticed_and_reloaded(setup, host: Host) -> None:
    manager, registry, _ = setup
    registry.register("sql", "qwen", "/a/1")
    registry.promote("sql", 1)
    await manager.refresh()
    await manager.reconcile()
    host.loaded.clear()  # the backend restarted
    await manager.reconcile()
    assert host.log == [("load", "sql@1"), ("load", "sql@1")]


async def test_a_request_that_finds_its_adapter_gone_reloads_it_and_retries_once(setup, host: Host) -> None:
    manager, registry, _ = setup
    registry.register("sql", "qwen", "/a/1")
    registry.promote("sql", 1)
    await manager.refresh()
    await manager.reconcile()
    host.loaded.clear()
    backend = AdapterBackend(host, "qwen", manager.snapshot.active["sql"], manager)  # type: ignore[arg-type]
    result = await backend.chat(ChatRequest(body={}, model="qwen"))
    assert result.message["content"] == "sql@1"
    assert host.log.count(("load", "sql@1")) == 2


async def test_a_failed_load_is_reported_not_raised_and_retried_at_the_next_round(setup, host: Host) -> None:
    manager, registry, _ = setup
    registry.register("sql", "qwen", "/missing/1")
    registry.promote("sql", 1)
    await manager.refresh()
    results = await manager.reconcile()
    assert [(r.ok, "no adapter" in (r.error or "")) for r in results] == [(False, True)]
    assert [r.ok for r in await manager.reconcile()] == [False]
