"""Loopback HTTP servers for the network tools' tests, and settings that point the tools at tmp paths."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gateway.config import ToolsSettings
from tests.markers import require_integration


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class LoopbackServer:
    """A threaded HTTP server on one loopback address; answers from ``routes``, records every request."""

    host: str
    routes: dict[str, Reply | Callable[[], Reply]] = field(default_factory=dict)
    received: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                server.received.append((self.command, self.path, dict(self.headers.items())))
                route = server.routes.get(self.path.split("?", 1)[0])
                reply = route() if callable(route) else route or Reply(404, b"not found")
                self.send_response(reply.status)
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(reply.body)

            do_GET = do_POST = do_HEAD = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer((self.host, 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        # A short poll keeps shutdown (and so each test's teardown) quick.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def wrap(self, context: ssl.SSLContext) -> None:
        """Serve HTTPS from now on (call before the first request)."""
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)

    def url(self, path: str = "/") -> str:
        return f"http://{self.host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.received]

    def start(self) -> LoopbackServer:
        require_integration("a loopback site")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def site() -> Iterator[LoopbackServer]:
    """A server on 127.0.0.1, which tests allow-list."""
    server = LoopbackServer("127.0.0.1").start()
    yield server
    server.stop()


@pytest.fixture
def trap() -> Iterator[LoopbackServer]:
    """A server on 127.0.0.2, which no test allows: it must never receive a request from a tool."""
    server = LoopbackServer("127.0.0.2").start()
    yield server
    server.stop()


@pytest.fixture
def settings(tmp_path: Path) -> ToolsSettings:
    """Settings whose workspace and database live in the test's tmp folder; of loopback only 127.0.0.1 (any port)
    is allowed."""
    return ToolsSettings(
        workspace=str(tmp_path / "workspace"),
        sql_database=str(tmp_path / "data.db"),
        allow_networks=["127.0.0.1/32"],
        http_timeout=10,
        browser_timeout=20,
    )
