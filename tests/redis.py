"""A throwaway Redis server: ``redis-server`` on a free loopback port, in a temporary folder, keeping nothing on disk.

Debian's ``redis-server`` package provides the binary. Without it the tests that need a server skip, unless
``HARNESS_REQUIRE_REDIS=1`` (set in CI) makes that a failure.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.markers import missing, require_integration
from tests.standin import free_port


def require_redis() -> str:
    """The path of ``redis-server``, or a skip (a failure with ``HARNESS_REQUIRE_REDIS=1``)."""
    found = shutil.which("redis-server")
    if found is None:
        missing("redis-server (Debian's redis-server package)", "HARNESS_REQUIRE_REDIS")
    return found


class RedisServer:
    """One server; ``stop()`` then ``start()`` again is a restart on the same port, empty."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="harness-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        require_integration("a Redis server")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root), "--logfile", str(self.root / "server.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
