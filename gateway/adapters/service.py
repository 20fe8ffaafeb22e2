"""The adapter lifecycle: register, publish, promote, roll back, retire.

The admin routes and ``harness adapters`` both call this. Inside a running gateway it has the
``AdapterManager`` and loads a version into the backends before the registry says it is served, so a
failed load changes nothing; from the CLI on the store alone it changes the registry, and a running
gateway picks the change up at its next refresh.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gateway.adapters import archive
from gateway.adapters.manager import AdapterManager, LoadResult
from replay.adapters import AdapterRegistry, AdapterVersion, RegistryError, check_name


class AdapterService:
    def __init__(self, registry: AdapterRegistry, adapters_dir: str | Path, max_upload_bytes: int,
                 manager: AdapterManager | None = None) -> None:
        self.registry = registry
        self.adapters_dir = Path(adapters_dir)
        self.max_upload_bytes = max_upload_bytes
        self.manager = manager

    async def list(self) -> list[AdapterVersion]:
        return await asyncio.to_thread(self.registry.all)

    async def register(self, name: str, base: str, *, path: str | None = None, upload: bytes | None = None,
                       metrics: dict[str, Any] | None = None, parent_version: int | None = None) -> AdapterVersion:
        """Add a version from a folder the backends can read (``path``) or from an uploaded archive."""
        check_name(name)
        if (path is None) == (upload is None):
            raise RegistryError("give either a path or an uploaded archive", code="invalid_adapter_source")
        if upload is not None:
            if len(upload) > self.max_upload_bytes:
                raise RegistryError(f"the archive is larger than the limit of {self.max_upload_bytes} bytes",
                                    status=413, code="request_too_large")
            unpacked = await asyncio.to_thread(archive.unpack, upload, self.adapters_dir / name,
                                               max_bytes=self.max_upload_bytes)
            try:
                return await asyncio.to_thread(
                    self.registry.register, name, base,
                    lambda version: unpacked.move_to(self.adapters_dir / name / str(version)),
                    metrics=metrics, parent_version=parent_version, uploaded=True)
            finally:
                unpacked.discard()
        assert path is not None
        folder = Path(path).expanduser()
        if not folder.is_absolute():
            raise RegistryError(f"the adapter path {path!r} must be absolute: backends resolve it on their own host",
                                code="invalid_adapter_path")
        if folder.exists() and not (folder / archive.CONFIG_FILE).is_file():
            raise RegistryError(f"{folder} is not an adapter folder: it has no {archive.CONFIG_FILE}",
                                code="invalid_adapter_path")
        return await asyncio.to_thread(self.registry.register, name, base, str(folder), metrics=metrics,
                                       parent_version=parent_version)

    async def _load_everywhere(self, version: AdapterVersion) -> list[LoadResult]:
        """Load into every backend serving the base; RegistryError (502) naming the failures if any failed."""
        if self.manager is None:
            return []
        if version.status == "retired":
            raise RegistryError(f"{version.backend_name} is retired", status=409, code="adapter_retired")
        if not self.manager.hosts_for(version.base_model):
            raise RegistryError(f"no configured backend serving {version.base_model!r} loads adapters "
                                "(kinds sglang, vllm and local do)", status=409, code="no_adapter_backend")
        results = await self.manager.load(version)
        failed = [r for r in results if not r.ok]
        if failed:
            detail = "; ".join(f"{r.backend}: {r.error}" for r in failed)
            raise RegistryError(f"loading {version.backend_name} failed, nothing changed: {detail}", status=502,
                                code="adapter_load_failed")
        return results

    async def _settle(self) -> None:
        if self.manager is not None:
            await self.manager.refresh(force=True)
            await self.manager.reconcile()

    async def publish(self, name: str, version: int | None = None) -> tuple[AdapterVersion, list[LoadResult]]:
        """Load a version (the newest when none is named) everywhere its base is served, and keep it loaded."""
        found = await asyncio.to_thread(self.registry.get, name, version)
        results = await self._load_everywhere(found)
        published = await asyncio.to_thread(self.registry.publish, name, found.version)
        await self._settle()
        return published, results

    async def promote(self, name: str, version: int) -> tuple[AdapterVersion, AdapterVersion | None]:
        """Make ``version`` the one ``base:name`` resolves to; the version it replaces drains and unloads."""
        found = await asyncio.to_thread(self.registry.get, name, version)
        await self._load_everywhere(found)
        promoted, replaced = await asyncio.to_thread(self.registry.promote, name, version)
        await self._settle()
        return promoted, replaced

    async def rollback(self, name: str) -> tuple[AdapterVersion, AdapterVersion]:
        restored, demoted = await asyncio.to_thread(self.registry.rollback, name)
        await self._settle()  # loads the restored version before the demoted one drains
        return restored, demoted

    async def retire(self, name: str, version: int) -> AdapterVersion:
        retired = await asyncio.to_thread(self.registry.retire, name, version)
        await self._settle()
        return retired
