"""The adapter registry: every version of every LoRA adapter, in the store (its SQLite file or PostgreSQL database).

Statuses: ``candidate`` (registered; servable by its explicit ``@version``), ``active`` (what
``base:adapter`` resolves to; at most one per name) and ``retired`` (never served again). ``published``
versions are kept loaded in every backend serving their base. Operations are short transactions on their
own connection (SQLite's ``BEGIN IMMEDIATE``, PostgreSQL's advisory lock), so gateways and the CLI can change the
same registry safely.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import orjson

from replay.database import PostgresConnection, is_postgres
from replay.schema import migrate, migrate_postgres

T = TypeVar("T")

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
STATUSES = ("candidate", "active", "retired")


class RegistryError(Exception):
    """A registry operation that cannot be done; ``status`` is the HTTP status the admin API answers."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_adapter") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True)
class AdapterVersion:
    name: str
    version: int
    base_model: str
    path: str
    status: str
    published: bool
    metrics: dict[str, Any] | None
    parent_version: int | None
    uploaded: bool
    created_at: float
    activated_at: float | None

    @property
    def backend_name(self) -> str:
        """The name backends load this version under: a new version never replaces an old one in place."""
        return f"{self.name}@{self.version}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "backend_name": self.backend_name}


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name or ""):
        raise RegistryError(f"adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-' "
                            "(no ':' or '@', which model names use)", code="invalid_adapter_name")
    return name


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``name`` or ``name@version``."""
    name, sep, version = ref.partition("@")
    if sep and not version.isdigit():
        raise RegistryError(f"{ref!r}: the version after '@' must be a number", code="invalid_adapter_version")
    return check_name(name), int(version) if sep else None


def _row(row: Any) -> AdapterVersion:
    return AdapterVersion(
        name=row["name"], version=row["version"], base_model=row["base_model"], path=row["path"],
        status=row["status"], published=bool(row["published"]),
        metrics=orjson.loads(row["metrics"]) if row["metrics"] else None, parent_version=row["parent_version"],
        uploaded=bool(row["uploaded"]), created_at=row["created_at"], activated_at=row["activated_at"])


# The advisory lock registry changes take on PostgreSQL.
_REGISTRY_LOCK = 0x61_64_61_70


class AdapterRegistry:
    def __init__(self, location: str) -> None:
        """The registry in the store at ``location``: an SQLite file or a ``postgresql://`` URL."""
        self.path = location
        self._migrated = False

    @contextmanager
    def _connect(self) -> Iterator[Any]:
        if is_postgres(self.path):
            with self._connect_postgres() as pg:
                yield pg
            return
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=10000")
            if not self._migrated:
                migrate(conn)
                self._migrated = True
            conn.row_factory = sqlite3.Row
            yield conn
        finally:
            conn.close()

    @contextmanager
    def _connect_postgres(self) -> Iterator[PostgresConnection]:
        conn = PostgresConnection(self.path)
        try:
            if not self._migrated:
                migrate_postgres(conn.conn)
                self._migrated = True
            yield conn
        finally:
            conn.close()

    def _transaction(self, fn: Callable[[Any], T]) -> T:
        with self._connect() as conn:
            if isinstance(conn, PostgresConnection):
                conn.begin_exclusive(_REGISTRY_LOCK)
            else:
                conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

    # -- reads -------------------------------------------------------------------------------------

    def all(self) -> list[AdapterVersion]:
        with self._connect() as conn:
            return [_row(r) for r in conn.execute("SELECT * FROM adapters ORDER BY name, version")]

    def stamp(self) -> str:
        """Changes whenever any version changes: the gateway re-reads the registry only then. A digest of every
        version's state, not the newest ``updated_at``: replicas write that with their own clocks, and a change
        made on one whose clock runs behind would not move it."""
        with self._connect() as conn:
            rows = conn.execute("SELECT name, version, status, published, path, metrics, activated_at, updated_at "
                                "FROM adapters ORDER BY name, version").fetchall()
        return hashlib.sha256(orjson.dumps([list(r) for r in rows])).hexdigest()

    def get(self, name: str, version: int | None = None) -> AdapterVersion:
        with self._connect() as conn:
            return _get(conn, name, version)

    def active(self, name: str) -> AdapterVersion | None:
        """The version ``base:name`` resolves to, if any."""
        with self._connect() as conn:
            return _active(conn, name)

    # -- changes -----------------------------------------------------------------------------------

    def register(self, name: str, base_model: str, path: str | Callable[[int], str], *,
                 metrics: dict[str, Any] | None = None, parent_version: int | None = None,
                 uploaded: bool = False) -> AdapterVersion:
        """Add the next version of ``name`` as a candidate. ``path`` may be a function of the new version
        number (an upload is moved to its final folder inside the same transaction)."""
        check_name(name)
        if not base_model:
            raise RegistryError("an adapter needs the base model it was trained on", code="invalid_base_model")

        def run(conn: Any) -> AdapterVersion:
            (latest,) = conn.execute("SELECT COALESCE(MAX(version), 0) FROM adapters WHERE name = ?",
                                     (name,)).fetchone()
            others = conn.execute("SELECT DISTINCT base_model FROM adapters WHERE name = ?", (name,)).fetchall()
            if others and others[0][0] != base_model:
                raise RegistryError(f"adapter {name!r} belongs to base model {others[0][0]!r}, not {base_model!r}",
                                    status=409, code="base_model_mismatch")
            parent = parent_version
            if parent is None:
                active = conn.execute("SELECT version FROM adapters WHERE name = ? AND status = 'active'",
                                      (name,)).fetchone()
                parent = active[0] if active else None
            version = latest + 1
            now = time.time()
            conn.execute(
                "INSERT INTO adapters(name, version, base_model, path, status, published, metrics, parent_version, "
                "uploaded, created_at, updated_at) VALUES (?, ?, ?, ?, 'candidate', 0, ?, ?, ?, ?, ?)",
                (name, version, base_model, path(version) if callable(path) else path,
                 orjson.dumps(metrics).decode() if metrics is not None else None, parent, int(uploaded), now, now))
            return _get(conn, name, version)

        return self._transaction(run)

    def publish(self, name: str, version: int | None = None) -> AdapterVersion:
        """Mark a version to be loaded everywhere its base is served (the newest when none is named)."""
        def run(conn: Any) -> AdapterVersion:
            found = _get(conn, name, version)
            _refuse_retired(found, "publish")
            _update(conn, found, published=1)
            return _get(conn, name, found.version)

        return self._transaction(run)

    def promote(self, name: str, version: int) -> tuple[AdapterVersion, AdapterVersion | None]:
        """Make ``version`` the one ``base:name`` resolves to; returns it and the version it replaced."""
        def run(conn: Any) -> tuple[AdapterVersion, AdapterVersion | None]:
            found = _get(conn, name, version)
            _refuse_retired(found, "promote")
            old = _active(conn, name)
            if old is not None and old.version == found.version:
                return found, None
            if old is not None:
                _update(conn, old, status="candidate", published=0)
            _update(conn, found, status="active", published=1, activated_at=time.time())
            return _get(conn, name, found.version), old

        return self._transaction(run)

    def rollback(self, name: str) -> tuple[AdapterVersion, AdapterVersion]:
        """Re-activate the version that was active before the current one; returns (restored, demoted).
        The demoted version forgets it was active, so rolling back again goes one further back."""
        def run(conn: Any) -> tuple[AdapterVersion, AdapterVersion]:
            current = _active(conn, name)
            if current is None:
                _get(conn, name, None)  # 404 when the name is unknown
                raise RegistryError(f"adapter {name!r} has no active version to roll back from", status=409,
                                    code="nothing_to_roll_back")
            row = conn.execute(
                "SELECT * FROM adapters WHERE name = ? AND version != ? AND status != 'retired' "
                "AND activated_at IS NOT NULL ORDER BY activated_at DESC LIMIT 1", (name, current.version)).fetchone()
            if row is None:
                raise RegistryError(f"adapter {name!r} has no earlier active version to roll back to", status=409,
                                    code="nothing_to_roll_back")
            previous = _row(row)
            _update(conn, current, status="candidate", published=0, activated_at=None)
            _update(conn, previous, status="active", published=1)
            return _get(conn, name, previous.version), _get(conn, name, current.version)

        return self._transaction(run)

    def retire(self, name: str, version: int) -> AdapterVersion:
        def run(conn: Any) -> AdapterVersion:
            found = _get(conn, name, version)
            _update(conn, found, status="retired", published=0)
            return _get(conn, name, version)

        return self._transaction(run)

    def set_metrics(self, name: str, version: int, metrics: dict[str, Any]) -> AdapterVersion:
        def run(conn: Any) -> AdapterVersion:
            found = _get(conn, name, version)
            _update(conn, found, metrics=orjson.dumps({**(found.metrics or {}), **metrics}).decode())
            return _get(conn, name, version)

        return self._transaction(run)


def _get(conn: Any, name: str, version: int | None) -> AdapterVersion:
    if version is None:
        row = conn.execute("SELECT * FROM adapters WHERE name = ? ORDER BY version DESC LIMIT 1", (name,)).fetchone()
    else:
        row = conn.execute("SELECT * FROM adapters WHERE name = ? AND version = ?", (name, version)).fetchone()
    if row is None:
        what = f"{name}@{version}" if version is not None else name
        raise RegistryError(f"no adapter {what!r} in the registry", status=404, code="adapter_not_found")
    return _row(row)


def _active(conn: Any, name: str) -> AdapterVersion | None:
    row = conn.execute("SELECT * FROM adapters WHERE name = ? AND status = 'active'", (name,)).fetchone()
    return _row(row) if row else None


def _refuse_retired(found: AdapterVersion, action: str) -> None:
    if found.status == "retired":
        raise RegistryError(f"{found.backend_name} is retired; register it again to {action} it", status=409,
                            code="adapter_retired")


def _update(conn: Any, found: AdapterVersion, **fields: Any) -> None:
    columns = ", ".join(f"{k} = ?" for k in fields)
    conn.execute(f"UPDATE adapters SET {columns}, updated_at = ? WHERE name = ? AND version = ?",
                 (*fields.values(), time.time(), found.name, found.version))
