"""Threads a test left running that would keep the interpreter from exiting once the run is over (an aiosqlite
connection never closed is one: its worker thread is not a daemon). The run would hang after its summary, with
nothing to say why; instead it names them and exits, failed."""

from __future__ import annotations

import os
import sys
import threading
import time

# Executors' workers are joined at exit once told to stop; they never hold the exit up while idle.
_EXECUTOR_PREFIXES = ("ThreadPoolExecutor", "asyncio_")


def blocking_threads(grace_seconds: float = 5.0) -> list[threading.Thread]:
    """The live non-daemon threads besides the main one and idle executors', after ``grace_seconds`` to end."""
    deadline = time.monotonic() + grace_seconds
    while True:
        left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
                and t.is_alive() and not t.name.startswith(_EXECUTOR_PREFIXES)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def exit_if_any_left(status: int) -> None:
    """Name the threads that would hold the exit up, and exit at once, failed; return when there are none."""
    left = blocking_threads()
    if not left:
        return
    names = ", ".join(f"{t.name} ({getattr(t, '_target', None)})" for t in left)
    sys.stderr.write(f"\nerror: {len(left)} thread(s) left running after the tests would keep this process from "
                     f"exiting (a store or connection never closed?): {names}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 1)
