"""sql_query: read-only SQL on the SQLite file named by ``[tools] sql_database``.

Each statement runs in a worker process (``tools.builtin.sql_worker``, which describes the locks on it), never in
the gateway: there SQLite's heap limit and an address-space limit bound the memory of the whole statement, which
per-value limits cannot (``json_group_array`` took the gateway past a gigabyte before it checked its length). Workers
live on between calls, so a call costs a round trip over a pipe, not a process start; at most ``sql_workers`` run
at once, and one that ran out of memory, past its time, or died is replaced on the next call.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import selectors
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import structlog

from tools.builtin.sql_worker import MIB
from tools.context import ToolContext
from tools.settings import ToolsSettings
from tools.spec import ToolError, ToolSpec

log = structlog.get_logger(__name__)

_WORKER_SCRIPT = Path(__file__).with_name("sql_worker.py")
# The worker interrupts a statement at its own deadline; only if it has not answered this much later is it killed.
_GRACE = 2.0


class _Broken(Exception):
    """The worker process died or answered nonsense."""


class _Worker:
    """One worker process and the pipe to it; used by one call at a time."""

    def __init__(self, max_memory: int) -> None:
        # -I -S: no environment variables, user site or site-packages, only the standard library it needs.
        # Its own session: a Ctrl-C meant for the gateway does not reach it; it leaves when the pipe closes.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_WORKER_SCRIPT), str(max_memory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True, start_new_session=True,
            # One malloc arena: a thread's own arena reserves 64 MB of address space, which the limit counts.
            env={"MALLOC_ARENA_MAX": "1"},
        )
        self._stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
        self._stdout = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self._selector = selectors.DefaultSelector()  # epoll where there is one: no FD_SETSIZE ceiling
        self._selector.register(self._stdout, selectors.EVENT_READ)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, request: dict[str, Any], deadline: float, max_reply: int) -> dict[str, Any]:
        """Sends one request and waits for its reply until ``deadline``; TimeoutError past it."""
        body = json.dumps(request).encode()
        try:
            self._stdin.write(struct.pack(">I", len(body)) + body)
        except OSError as exc:
            raise _Broken(f"it could not be sent the query: {exc}") from None
        size = struct.unpack(">I", self._read(4, deadline))[0]
        if size > max_reply:
            raise _Broken(f"it answered with {size} bytes, more than the {max_reply} a result may take")
        reply = json.loads(self._read(size, deadline))
        if not isinstance(reply, dict) or not ("result" in reply or "error" in reply):
            raise _Broken("it answered something that is not a reply")
        return reply

    def _read(self, count: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        while count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not self._selector.select(left):
                continue
            chunk = os.read(self._stdout, min(count, MIB))
            if not chunk:
                raise _Broken(self._exit_description())
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def _exit_description(self) -> str:
        try:
            code = self.proc.wait(1)
        except subprocess.TimeoutExpired:
            return "it closed its pipe"
        return f"it was killed by signal {-code}" if code < 0 else f"it exited with status {code}"

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self._selector.close()
        self._stdin.close()
        self.proc.stdout.close()  # type: ignore[union-attr]


class WorkerPool:
    """At most ``size`` worker processes, each running one statement at a time, kept between calls."""

    def __init__(self, size: int, max_memory: int) -> None:
        self.size, self.max_memory = size, max_memory
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """Runs one request (see ``sql_worker``) and returns its result; blocking, and raises ``ToolError``."""
        timeout = float(request["timeout"])
        # A queue longer than a statement may run means the tool is flooded: say so rather than pile up threads.
        if not self._slots.acquire(timeout=timeout):
            raise ToolError(f"sql_query is already running {self.size} queries ([tools] sql_workers); "
                            "try again in a moment")
        try:
            reply = self._ask(request, timeout)
        finally:
            self._slots.release()
        if "error" in reply:
            raise ToolError(str(reply["error"]))
        return reply["result"]

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None or not worker.alive():
            if worker is not None:
                worker.close()
            worker = _Worker(self.max_memory)
        max_reply = 16 * int(request["max_bytes"]) + int(request["max_rows"]) * 64 * 1024 + MIB
        try:
            reply = worker.ask(request, time.monotonic() + timeout + _GRACE, max_reply)
        except TimeoutError:
            worker.close()
            log.warning("sql_query worker killed past its deadline", timeout=timeout)
            raise ToolError(f"the query ran longer than its limit of {timeout:g}s") from None
        except (_Broken, OSError, ValueError) as exc:
            worker.close()
            log.warning("sql_query worker failed", reason=str(exc))
            raise ToolError(f"the query's worker process stopped ({exc}); it may have needed more than "
                            f"{self.max_memory // MIB} MiB of memory") from None
        if reply.get("recycle"):
            worker.close()
        else:
            with self._lock:
                self._idle.append(worker)
        return reply

    def close(self) -> None:
        """Ends the idle workers; ones still running a statement end when their call does."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


_pools: dict[tuple[int, int], WorkerPool] = {}
_pools_lock = threading.Lock()


def worker_pool(size: int, max_memory: int) -> WorkerPool:
    """The process's pool for these limits (a worker's heap limit can only be lowered, so each limit has its own)."""
    with _pools_lock:
        pool = _pools.get((size, max_memory))
        if pool is None:
            pool = _pools[(size, max_memory)] = WorkerPool(size, max_memory)
        return pool


@atexit.register
def _close_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.close()


def run_query(database: str, query: str, *, timeout: float, max_rows: int, max_bytes: int,
              max_memory_mb: int = ToolsSettings.default_of("sql_max_memory_mb"),
              workers: int = ToolsSettings.default_of("sql_workers"),
              ) -> dict[str, Any]:
    """Runs one read-only statement in a worker process; blocking, so callers run it in a thread."""
    request = {"database": database, "query": query, "timeout": timeout, "max_rows": max_rows,
               "max_bytes": max_bytes}
    return worker_pool(workers, max_memory_mb * MIB).run(request)


async def _run(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
    settings = context.settings
    if not settings.sql_database:
        raise ToolError("no database is configured ([tools] sql_database)")
    return await asyncio.to_thread(
        run_query, settings.sql_database, arguments["query"], timeout=settings.sql_timeout,
        max_rows=settings.sql_max_rows, max_bytes=settings.sql_max_bytes, max_memory_mb=settings.sql_max_memory_mb,
        workers=settings.sql_workers,
    )


def build(settings: ToolsSettings) -> ToolSpec:
    return ToolSpec(
        name="sql_query",
        description=(
            "Run one read-only SQL query (SQLite dialect) on the configured database and get the columns and "
            f"rows (at most {settings.sql_max_rows}). List tables with SELECT name, sql FROM sqlite_master; "
            "describe one with PRAGMA table_info(name)."
        ),
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1, "description": "one SELECT statement"}},
            "required": ["query"],
            "additionalProperties": False,
        },
        run=_run,
        # A call may wait up to sql_timeout for a free worker, then run up to sql_timeout (and the grace before
        # the worker is killed); this leaves room past both to return rows.
        timeout=2 * settings.sql_timeout + 5.0,
        output_cap=settings.output_cap,
        permissions=frozenset({"database:read"}),
    )
