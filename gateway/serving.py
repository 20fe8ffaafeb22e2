"""How ``harness serve`` runs uvicorn: in this process, or as ``[server] workers`` processes on one socket.

Several workers run under uvicorn's own supervisor (``uvicorn.supervisors.Multiprocess``). This process binds the
socket once and spawns the workers; each accepts on that socket and makes for itself, from the settings (which
can be pickled across to it), what cannot be: its app, with its own store and backends (``build_app``), and its
protocol class (made at run time, so not importable by name). The supervisor replaces a worker that dies, and on
SIGTERM or SIGINT sends each worker SIGTERM and waits for it: a worker finishes the requests it holds, and its
app's shutdown closes the store, committing what it accepted.

One socket rather than one per worker (``SO_REUSEPORT``): connections waiting to be accepted outlive a worker's
death (a closed ``SO_REUSEPORT`` socket resets the ones queued on it), port 0 gives every worker the same port,
and no other process of the same user can bind the port beside the gateway and take a share of its connections.
The kernel does not deal connections out evenly: whichever worker is free to accept takes the next, so a busy one
takes fewer. Each worker's state is its own: metrics, connections per address, caches.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from gateway.app import build_app
from gateway.config import ServerSettings, Settings
from gateway.logging import configure_logging
from gateway.server import BoundedHttpTools, bounded_protocol

log = structlog.get_logger()


def serve(settings: Settings, app: ASGIApp) -> None:
    """Serve until stopped. With several workers ``app`` itself is not served: that it was built shows the settings
    build (a mistake only building finds is reported once, before any worker starts), and each worker builds its
    own."""
    server = settings.server
    if server.workers == 1:
        uvicorn.run(app, http=protocol_for(server), **_options(server))
        return
    config = _WorkerConfig(settings, functools.partial(build_app, settings), factory=True, workers=server.workers,
                           **_options(server))
    supervisor = _Supervisor(config, sockets=[config.bind_socket()])
    supervisor.run()
    # uvicorn stops every worker when one fails to start (each would fail alike): the exit status says so.
    if any(process.exitcode == STARTUP_FAILURE for process in supervisor.processes):
        sys.exit(STARTUP_FAILURE)


def protocol_for(server: ServerSettings) -> type[BoundedHttpTools]:
    """The protocol class with ``[server]``'s limits on heads, bodies and connections per address."""
    # Half by default: one address (a runaway client, or one holding slow connections) leaves the other half
    # to everyone else, health checks included, while a single local user still has 1,024 connections.
    per_client = server.max_connections_per_client or max(1, server.max_connections // 2)
    return bounded_protocol(max_head_bytes=server.max_head_bytes, max_headers=server.max_headers,
                            head_timeout=server.head_timeout, body_timeout=server.body_timeout,
                            max_connections_per_client=per_client)


def _options(server: ServerSettings) -> dict[str, Any]:
    """uvicorn's settings, the same in one process and in each worker."""
    # ws="none": no route speaks WebSocket, so an upgrade request is just a request.
    return {"host": server.host, "port": server.port, "log_level": "warning", "access_log": False, "loop": "uvloop",
            "ws": "none", "timeout_graceful_shutdown": 10, "timeout_keep_alive": server.keep_alive_seconds,
            "limit_concurrency": server.max_connections}


class _WorkerConfig(uvicorn.Config):
    """uvicorn's settings with the gateway's along, pickled to each worker: there ``load`` makes the protocol class
    and ``configure_logging`` the gateway's logging (a spawned worker starts from structlog's defaults)."""

    def __init__(self, settings: Settings, app: Any, **options: Any) -> None:
        self.settings = settings  # before uvicorn's __init__, which configures logging
        super().__init__(app, **options)

    def configure_logging(self) -> None:
        super().configure_logging()
        configure_logging(self.settings.server.log_format, self.settings.server.log_level)

    def load(self) -> None:
        self.http = protocol_for(self.settings.server)
        super().load()


class _Supervisor(Multiprocess):
    """uvicorn's supervisor, telling the gateway's log which workers it started and which it replaced."""

    def init_processes(self) -> None:
        super().init_processes()
        log.info("server.workers_started", workers=[process.pid for process in self.processes])

    def keep_subprocess_alive(self) -> None:
        before = list(self.processes)
        super().keep_subprocess_alive()
        for old, new in zip(before, self.processes, strict=True):
            if new is not old:
                log.warning("server.worker_replaced", worker=old.pid, exitcode=old.exitcode, replacement=new.pid)
