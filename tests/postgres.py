"""A throwaway PostgreSQL server: ``initdb`` in a temporary folder, started on a free loopback port.

Debian's ``postgresql`` package provides the binaries (``.ci/run`` installs it). PostgreSQL refuses to run as
root, so under root the server runs as the ``postgres`` user the package creates. Without the binaries the
tests that need a server skip, unless ``HARNESS_REQUIRE_PG=1`` (set in CI) makes that a failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from tests.markers import missing, require_integration
from tests.standin import free_port


def _bin_dir() -> Path | None:
    for found in (shutil.which("pg_ctl"), *sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), reverse=True)):
        if found:
            return Path(found).resolve().parent
    return None


def require_postgres() -> Path:
    """The folder of PostgreSQL's server binaries, or a skip (a failure with ``HARNESS_REQUIRE_PG=1``)."""
    found = _bin_dir()
    if found is None:
        missing("PostgreSQL's server (Debian's postgresql package)", "HARNESS_REQUIRE_PG")
    return found


class PostgresServer:
    """One cluster; ``database()`` gives each caller a fresh, empty database on it."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="harness-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as_user, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        require_integration("a PostgreSQL server")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "harness", "--auth=trust", "-E", "UTF8",
                  "--no-instructions")
        self.resume()
        return self

    def resume(self) -> None:
        """Start the server (again, after ``pause``), on the same port."""
        # fsync stays on: the kill -9 tests rely on commits being durable the way production's are.
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200 "
                   "-c shared_buffers=64MB")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def pause(self) -> None:
        """Stop the server as an operator does (its clients' connections are closed), keeping its data."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def admin_url(self) -> str:
        return f"postgresql://harness@127.0.0.1:{self.port}/postgres"

    def database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://harness@127.0.0.1:{self.port}/{name}"
